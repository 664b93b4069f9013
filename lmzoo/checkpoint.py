"""Orbax checkpoints of the whole train state plus the data loader's position.

Layout: `<workdir>/checkpoints/<step>/{state,data}`. Restore targets carry shardings, so a
checkpoint written on one mesh restores onto another. Restoring tells three failures apart:
- a damaged step (truncated or missing files) is reported, naming the file, and skipped in favour of
  the previous good one, which is replaced once the resumed run saves that step again;
- a step whose shapes do not match the model raises IncompatibleCheckpointError naming the parameters;
- an I/O error that says nothing about the files (permission, device, network filesystem) raises
  CheckpointReadError at once: nothing is skipped or deleted.
When steps exist but none restores, restoring raises instead of letting a run start over.
A checkpoint written with the other `config.model.scan_layers` restores too: its layer stacks, Adam's moments with
the parameters (elementwise, so a stack of per-layer moments is the scanned stack's), are relaid into the model's
layout on restore (`mapping.to_layout`).
A failed save raises CheckpointSaveError with its cause (a full disk named as such) and the steps committed before it.
In a bucket, a save that cannot finish because the bucket stopped answering is abandoned once the bucket has not
answered for `storage.deadline_seconds()`: waiting for it raises CheckpointSaveError naming the last committed step.
"""

import asyncio
import contextlib
import errno
import functools
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from lmzoo import storage
from lmzoo.convert import mapping

log = logging.getLogger(__name__)


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _flat(tree: Any) -> dict[str, Any]:
    """{"a/b/c": leaf} of a pytree (mapping keys, dataclass fields and sequence indices joined by "/")."""
    return {_path_str(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _unflat(flat: dict[str, Any], like: Any) -> Any:
    """`like`'s structure with each leaf replaced by flat["a/b/c"] of its path."""
    return jax.tree_util.tree_map_with_path(lambda path, _: flat[_path_str(path)], like)


def _in_layout(flat: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    """The leaves of `flat` ({"a/b/c": leaf}) with their layer stacks in the layout of `target`'s paths
    (`mapping.to_layout`: per-layer leaves stacked where target scans the stack, a scanned stack split where it does
    not), by path."""

    def nested(leaves: dict[str, Any]) -> dict:
        return traverse_util.unflatten_dict({tuple(key.split("/")): leaf for key, leaf in leaves.items()})

    return mapping.flatten(mapping.to_layout(nested(flat), nested(target)))


def _stand_in(metadata: Any) -> np.ndarray:
    """A saved leaf's shape and dtype as an array that holds no memory (a broadcast zero), which `_in_layout` relays
    without reading the checkpoint."""
    return np.broadcast_to(np.zeros((), metadata.dtype), tuple(metadata.shape))


def _restore_arg(like: Any, shape: tuple[int, ...]) -> ocp.RestoreArgs:
    """Read a saved leaf of `shape` straight into the sharding and dtype of `like` where that has a sharding and the
    same shape, else as a host numpy array."""
    where = getattr(like, "sharding", None)
    if where is None or tuple(like.shape) != shape:
        return ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.ArrayRestoreArgs(sharding=where, dtype=like.dtype, global_shape=shape)


def reached_preemption(step: int) -> bool:
    """JAX's multi-host preemption sync point (every process agrees on the step); False without the service."""
    from jax.experimental import multihost_utils

    try:
        return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:
        return False


class IncompatibleCheckpointError(ValueError):
    pass


class CheckpointReadError(OSError):
    """Checkpoints exist but could not be read; the run stops and nothing is deleted."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed; the previous checkpoints are intact."""


# tensorstore/orbax status words that mean the stored bytes themselves are wrong or missing.
_DAMAGE = re.compile(
    r"DATA_LOSS|OUT_OF_RANGE|NOT_FOUND|INVALID_ARGUMENT|Error decoding|Error reading|No such file|not a valid"
)


def _causes(error: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _is_damage(error: BaseException) -> bool:
    """Whether a restore error shows damaged or missing files (not an I/O failure of the filesystem)."""
    for e in _causes(error):
        if isinstance(e, OSError) and e.errno in (
            errno.EIO,
            errno.EACCES,
            errno.EPERM,
            errno.ESTALE,
            errno.ETIMEDOUT,
            errno.ENOMEM,
        ):
            return False
        if re.search(
            r"PERMISSION_DENIED|UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|Input/output error|Permission denied",
            str(e),
        ):
            return False
    return any(
        isinstance(e, (FileNotFoundError, KeyError, json.JSONDecodeError)) or _DAMAGE.search(str(e))
        for e in _causes(error)
    )


def _save_cause(error: BaseException) -> str:
    """A short account of why a save failed; a full disk is named as such."""
    for e in _causes(error):
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
            return "the disk is full (No space left on device)"
    root = _causes(error)[-1]
    return f"{type(root).__name__}: {str(root).splitlines()[0][:300] if str(root) else ''}"


def _summary(error: BaseException) -> str:
    """An exception's type and the first line of its message (at most 300 characters; tensorstore's "See full
    TensorStore details: <bound method ...>" tail left out)."""
    first = str(error).splitlines()[0].split(" See full TensorStore details")[0] if str(error) else ""
    return f"{type(error).__name__}: {first[:300]}"


class _DropOrbaxNoise(logging.Filter):
    """Drops orbax's warnings and errors (hundreds of lines of background-thread tracebacks for one failed
    save) and, while a restore runs and once a save failed or a restore met a damaged checkpoint, asyncio's
    "exception was never retrieved" reports of orbax's abandoned futures (logged whenever they are collected,
    often after the run's own message): the Checkpointer reports each failure itself, with its cause in one line."""

    futures_abandoned = False
    reads_in_progress = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            return not (self.futures_abandoned or self.reads_in_progress)
        return record.levelno < logging.WARNING or "/orbax/" not in record.pathname.replace("\\", "/")


_ORBAX_NOISE = _DropOrbaxNoise()


def _drop_abandoned_coroutine_reports(previous_hook):
    """A `sys.unraisablehook` that drops Python's "Exception ignored in: <coroutine ...>" reports of orbax's and
    tensorstore's coroutines collected after a save failed or a restore met a damaged checkpoint (as `_DropOrbaxNoise`
    drops asyncio's), and passes every other report to `previous_hook`."""

    def hook(unraisable):
        code = getattr(unraisable.object, "cr_code", None)
        where = code.co_filename.replace("\\", "/") if code is not None else ""
        if _ORBAX_NOISE.futures_abandoned and ("/orbax/" in where or "/tensorstore/" in where):
            return
        previous_hook(unraisable)

    hook.drops_abandoned_coroutines = True
    return hook


if not getattr(sys.unraisablehook, "drops_abandoned_coroutines", False):
    sys.unraisablehook = _drop_abandoned_coroutine_reports(sys.unraisablehook)


@contextlib.contextmanager
def _abandoning_futures_on_error():
    """A failed orbax read leaves its other reads' futures unretrieved: asyncio's reports of them are dropped
    while the read runs (orbax's loop may collect them before the failure reaches its caller) and, once it failed,
    from then on (whichever caller turns the failure into its one-line error)."""
    _ORBAX_NOISE.reads_in_progress += 1
    try:
        yield
    except Exception:
        _ORBAX_NOISE.futures_abandoned = True
        raise
    finally:
        _ORBAX_NOISE.reads_in_progress -= 1


class _LoopTakingLateCallbacks(asyncio.SelectorEventLoop):
    """An event loop that drops callbacks arriving from other threads after it closed.

    orbax runs each save on a fresh loop and closes it when the save coroutine ends. When one tensorstore
    write fails (a full disk), that coroutine ends while the other writes are still in flight; each of
    them later hands its result to the closed loop, and tensorstore prints the RuntimeError of every such
    call as a traceback from its own thread. The results have nobody left to read them, so they are dropped.
    """

    def call_soon_threadsafe(self, callback, *args, context=None):
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if self.is_closed():
                return None
            raise


class _EventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    _loop_factory = _LoopTakingLateCallbacks


@functools.cache
def _orbax_writes_s3() -> None:
    """Gives orbax-checkpoint tensorstore's S3 driver for s3:// paths. orbax 0.12.8 (its newest release, pinned in
    requirements.txt) sends gs:// paths to tensorstore's GCS driver and every other path to local files, so "s3://b/x"
    would be written as the relative folder "s3:/b/x". Three of its functions decide that; each keeps its behaviour
    for every other path and gains the s3:// case (tests/storage/test_bucket_workdir.py runs a workdir on an S3 server
    through them). A bucket has no atomic rename, so an s3:// checkpoint commits as orbax commits on GCS: a commit
    file written last (`Checkpointer` picks `CommitFileTemporaryPath`)."""
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils

    uses_bucket_driver, normalize_path = tensorstore_utils._use_gcs_driver, tensorstore_utils._normalize_path
    bucket_kvstore = gcs_utils.get_kvstore_for_gcs
    tensorstore_utils._use_gcs_driver = lambda directory: directory.startswith("s3://") or uses_bucket_driver(directory)
    tensorstore_utils._normalize_path = lambda path: (
        "s3://" + os.path.normpath(path.removeprefix("s3://")) if path.startswith("s3://") else normalize_path(path)
    )
    gcs_utils.get_kvstore_for_gcs = lambda path: (
        storage.tensorstore_s3_kvstore(path) if path.startswith("s3://") else bucket_kvstore(path)
    )


@functools.cache
def _orbax_bucket_retries() -> None:
    """tensorstore's GCS driver retries a request 32 times by default, with delays up to 32 s: a quarter of an hour
    before a save to a server that stopped answering fails. orbax's GCS kvstore specs get storage's bounded retries
    (tensorstore's S3 specs get them in `storage.tensorstore_s3_kvstore`)."""
    from orbax.checkpoint._src.path import gcs_utils

    bucket_kvstore = gcs_utils.get_kvstore_for_gcs

    def with_bounded_retries(path: str) -> dict[str, Any]:
        spec = bucket_kvstore(path)
        if spec.get("driver") == "gcs":
            spec = {**spec, "gcs_request_retries": spec.get("gcs_request_retries", storage.TENSORSTORE_RETRIES)}
        return spec

    gcs_utils.get_kvstore_for_gcs = with_bounded_retries


# How often a wait on a save to a bucket asks the bucket whether it still answers.
PROBE_SECONDS = 2.0


_saves_abandoned = False


def _exit_without_waiting_for_saves() -> None:
    """Lets the process exit without waiting for an abandoned save. Its threads are daemon threads (started under the
    daemon thread of `Checkpointer._within_deadline`), which an exiting Python does not wait for; but it does join
    every thread of a concurrent.futures pool, daemon or not (`concurrent.futures.thread._python_exit`), and orbax's
    pools would hold the exit until their requests to the bucket end (minutes of retries). The pools' daemon threads
    are taken off that list."""
    global _saves_abandoned
    _saves_abandoned = True
    from concurrent.futures import thread as pool_threads

    joined_at_exit = getattr(pool_threads, "_threads_queues", None)
    if joined_at_exit is not None:
        for pool_thread in list(joined_at_exit):
            if pool_thread.daemon:
                joined_at_exit.pop(pool_thread, None)


def exit_past_abandoned_saves(exit_code: Any) -> None:
    """Ends the process as `sys.exit(exit_code)` would, but at once (stdout and stderr flushed, the interpreter not
    finalized), if a save was abandoned in it; returns otherwise. `exit_code`: a SystemExit's code (None: 0; an
    int; anything else is printed to stderr and the status is 1, as Python does). An abandoned save's threads are
    still blocked in the bucket clients' C++ code: a finalizing interpreter ends each one that comes back for the
    interpreter lock by unwinding it, and a `catch (...)` on that stack turns the unwinding into an abort (exit
    status -6 in place of the run's own). Call it where the process would exit, after every `with` block of the run
    has closed."""
    if not _saves_abandoned:
        return
    if exit_code is not None and not isinstance(exit_code, int):
        print(exit_code, file=sys.stderr)
        exit_code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code or 0)


class Checkpointer:
    """Saves and restores (state, data_state) under `directory`; keeps the newest `max_to_keep`."""

    def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = storage.path(directory)
        self.remote = storage.is_remote(directory)
        on_s3 = os.fspath(directory).startswith("s3://")
        if self.remote:
            _orbax_bucket_retries()
        if on_s3:
            _orbax_writes_s3()
        self.failed = False
        self.abandoned = False  # a save was given up on: the bucket stopped answering
        self.async_save = async_save
        self.max_to_keep = max_to_keep
        for logger in ("absl", "asyncio"):  # orbax logs through absl; adding a filter twice is a no-op
            logging.getLogger(logger).addFilter(_ORBAX_NOISE)
        if type(asyncio.get_event_loop_policy()) is asyncio.DefaultEventLoopPolicy:
            asyncio.set_event_loop_policy(_EventLoopPolicy())  # the loops orbax makes for its saves
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=async_save,
                create=True,
                temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath if on_s3 else None,
            ),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
        )
        # The steps known to be committed (what restores found, then each save that finished), and the one in flight.
        self.committed = sorted(self.manager.all_steps())
        self.saving: int | None = None

    def _committed_now(self) -> None:
        """The save in flight finished: its step is committed, and orbax keeps the newest `max_to_keep`."""
        if self.saving is not None:
            self.committed = sorted({*self.committed, self.saving})[-(self.max_to_keep or 0) :]  # None: orbax keeps all
            self.saving = None

    def committed_note(self) -> str:
        """The steps a stopped run leaves committed, for its one-line message: the last one known committed, and the
        save in flight, whose requests a server that stopped answering may still carry out when it answers again."""
        if not self.committed:
            note = "no checkpoint had been committed yet"
        else:
            last = self.committed[-1]
            note = f"the last committed checkpoint is step {last} ({self.directory / str(last)})"
        if self.saving is not None:
            note += f", and the save of step {self.saving} was in flight (it may yet commit)"
        return note

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        # Steps >= `step` can only be unreadable checkpoints a resumed run fell back past; orbax would
        # skip (or, forced, refuse) every save up to the newest of them, so they are dropped first.
        def save_in_order():
            for stale in [s for s in self.steps() if s >= step]:
                self.manager.delete(stale)
            self.committed = [s for s in self.committed if s < step]
            return self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
                force=force,
            )

        self.wait()  # orbax would wait for the previous save itself, inside the save: waited for first, it is known
        self.saving = step
        try:
            saved = self._within_deadline(save_in_order, step)
        except CheckpointSaveError:
            raise
        except Exception as e:
            raise self._save_error(e) from None
        if not saved:
            self.saving = None
        elif not self.async_save:
            self._committed_now()
        return saved

    def _within_deadline(self, call, step: int | None):
        """`call()`; on a bucket, run on a thread of its own and abandoned (CheckpointSaveError) once the bucket has not
        answered for `storage.deadline_seconds()`, asked every PROBE_SECONDS while the call lasts. orbax's threads
        that the call starts inherit its daemon flag, so an abandoned save does not hold the process at its exit."""
        if not self.remote:
            return call()
        if self.abandoned:
            raise self._abandoned_error(step)
        outcome = {}

        def run():
            try:
                outcome["value"] = call()
            except BaseException as error:  # handed to the waiting thread
                outcome["error"] = error

        worker = threading.Thread(target=run, name="lmzoo-checkpoint-save", daemon=True)
        worker.start()
        answered, deadline = time.monotonic(), storage.deadline_seconds()
        while True:
            worker.join(PROBE_SECONDS)
            if not worker.is_alive():
                break
            if storage.answers(self.directory):
                answered = time.monotonic()
            elif storage.gave_up(self.directory) or time.monotonic() - answered >= deadline:
                storage.give_up_on(self.directory)
                self.abandoned = self.failed = _ORBAX_NOISE.futures_abandoned = True
                _exit_without_waiting_for_saves()
                raise self._abandoned_error(step)
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    def _abandoned_error(self, step: int | None) -> CheckpointSaveError:
        which = f"checkpoint {step}" if step is not None else "the checkpoint in flight"
        return CheckpointSaveError(
            f"saving {which} in {self.directory} could not finish: the bucket's server stopped answering (given up "
            f"on after {storage.deadline_seconds():g} s, {storage.DEADLINE_VARIABLE}), so the save was abandoned. "
            f"Training stopped; {self.committed_note()}: rerun the same command once the bucket answers, to resume"
        )

    def _save_error(self, error: BaseException) -> CheckpointSaveError:
        self.failed = _ORBAX_NOISE.futures_abandoned = True
        self.saving = None  # failed: not in flight
        kept = f"the previous checkpoints {self.committed} are intact" if self.committed else self.committed_note()
        return CheckpointSaveError(
            f"saving a checkpoint in {self.directory} failed: {_save_cause(error)}. Training stopped; "
            f"{kept}. Fix the cause and rerun the same command to resume."
        )

    def check_for_errors(self) -> None:
        """Raises CheckpointSaveError if a background save has failed (orbax waits here for the save's metadata
        writes: on a bucket, within the deadline)."""
        try:
            if self.saving is None:
                self.manager.check_for_errors()
            else:
                self._within_deadline(self.manager.check_for_errors, self.saving)
        except CheckpointSaveError:
            raise
        except Exception as e:
            raise self._save_error(e) from None

    def wait(self) -> None:
        """Waits for the background save; raises CheckpointSaveError if it failed (or, on a bucket that stopped
        answering, was abandoned)."""
        try:
            self._within_deadline(self.manager.wait_until_finished, self.saving)
        except CheckpointSaveError:
            raise
        except Exception as e:
            raise self._save_error(e) from None
        self._committed_now()

    def close(self) -> None:
        """Closes the manager; a save error here was already raised by `wait` or is logged (not raised over another
        error). A save abandoned, or one that cannot finish because the bucket stopped answering, is left to its thread: the
        error that stopped the run already names the bucket."""
        if self.abandoned or (self.remote and storage.gave_up(self.directory)):
            _exit_without_waiting_for_saves()  # the bucket does not answer: a save in flight is left to its threads
            return
        already_reported = self.failed
        try:
            self._within_deadline(self.manager.close, self.saving)
        except CheckpointSaveError as error:  # abandoned: the run stops for another error, which names the bucket
            log.info("%s", error)
        except Exception as e:
            error = self._save_error(e)
            if not already_reported:
                log.error("%s", error)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def _saved_leaves(self, step: int) -> dict[str, Any]:
        """The metadata (shape, dtype) of each array of `step`'s state, by path ("params/blocks/layer_0/...")."""
        saved = {key: m for key, m in _flat(self.manager.item_metadata(step)["state"]).items() if hasattr(m, "shape")}
        if not saved:
            raise FileNotFoundError(
                f"{self.directory / str(step) / 'state' / '_METADATA'}: no parameter metadata (missing or damaged)"
            )
        return saved

    def check_compatible(self, step: int, target: Any) -> bool:
        """Raises IncompatibleCheckpointError naming every leaf whose saved shape differs from `target`'s, the saved
        layer stacks taken in target's layout (`_in_layout`: a checkpoint of the other scan_layers fits); returns
        whether they are laid out otherwise, so that restoring relays them."""
        saved = self._saved_leaves(step)
        relaid = _in_layout({key: _stand_in(m) for key, m in saved.items()}, _flat(target))
        saved_shapes = {key: tuple(leaf.shape) for key, leaf in relaid.items()}
        target_shapes = {key: tuple(t.shape) for key, t in _flat(target).items()}
        problems = [
            f"{k}: checkpoint {saved_shapes[k]} vs model {v}"
            for k, v in target_shapes.items()
            if k in saved_shapes and saved_shapes[k] != v
        ]
        problems += [f"{k}: missing from the checkpoint" for k in target_shapes if k not in saved_shapes]
        problems += [f"{k}: in the checkpoint but not in the model" for k in saved_shapes if k not in target_shapes]
        if problems:
            raise IncompatibleCheckpointError(
                f"checkpoint {self.directory / str(step)} does not match the configured model "
                f"({len(problems)} mismatching parameters):\n  "
                + "\n  ".join(problems[:20])
                + "\nUse the config the checkpoint was written with, or a new workdir."
            )
        return saved.keys() != target_shapes.keys()

    @_abandoning_futures_on_error()
    def restore(self, step: int, target: Any, reading: Callable[[], None] = lambda: None) -> tuple[Any, dict]:
        """target: a pytree of jax.ShapeDtypeStruct with shardings. A checkpoint whose layer stacks are laid out
        otherwise (the other scan_layers) is read in its own layout and relaid (`_restore_relaid`). reading: called
        once the checkpoint is found to fit `target`, as its arrays begin to be read."""
        relaid = self.check_compatible(step, target)
        reading()
        if relaid:
            data = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
            return self._restore_relaid(step, target), dict(data)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
        )
        return restored["state"], dict(restored["data"])

    def _restore_relaid(self, step: int, target: Any) -> Any:
        """The state of `step` in `target`'s layer layout: read in its own (each leaf whose path and shape target
        shares straight into its sharding, the others onto the host), each layer stack relaid (`_in_layout`) and
        placed in target's sharding and dtype (`mapping.place`)."""
        targets = _flat(target)
        saved = self.manager.item_metadata(step)["state"]
        read = self._read(
            step,
            jax.tree.map(lambda m: np.zeros((), m.dtype), saved),
            _unflat({key: _restore_arg(targets.get(key), tuple(m.shape)) for key, m in _flat(saved).items()}, saved),
        )
        relaid = _in_layout(_flat(read), targets)
        return _unflat({key: mapping.place(relaid[key], like) for key, like in targets.items()}, target)

    def _read(self, step: int, item: Any, restore_args: Any) -> Any:
        """`item`'s part of `step`'s state (a tree of the saved structure), each leaf read as `restore_args` says."""
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(self.directory / str(step) / "state", args=args)

    def restore_step(self, step: int, target: Any) -> tuple[Any, dict]:
        """`restore` of one chosen step, falling back to no other: a damaged or unreadable step raises
        CheckpointReadError naming it, its cause and the other kept steps."""
        try:
            return self.restore(step, target)
        except IncompatibleCheckpointError:
            raise
        except Exception as e:  # orbax raises ValueError/OSError/KeyError variants for damaged files
            others = [s for s in self.steps() if s != step]
            raise CheckpointReadError(
                f"checkpoint {self.directory / str(step)} cannot be read ({_summary(e)}); nothing was changed. "
                f"Choose another of the kept steps {others} with --step, or leave --step out for the latest that restores"
            ) from None

    @_abandoning_futures_on_error()
    def restore_params(self, step: int, placed: Any = None) -> Any:
        """The state's `params` subtree of `step`, read from the checkpoint's own metadata (no model needed; the rest
        of the state is not read): as host numpy arrays, except where `placed` (a params tree of jax.Arrays or
        ShapeDtypeStructs with shardings; a classifier's backbone matches a saved `backbone` subtree) has a leaf of the
        same shape: that parameter is restored straight into its sharding and dtype, each process reading only the
        shards its devices hold."""
        saved = self.manager.item_metadata(step)["state"]
        if not hasattr(saved, "get") or "params" not in saved:
            raise FileNotFoundError(
                f"{self.directory / str(step) / 'state'}: no params in its metadata (missing or damaged)"
            )
        params = jax.tree.map(lambda m: np.zeros((), m.dtype), dict(saved["params"]))
        targets = _flat(placed) if placed is not None else {}
        restore_args = {
            key: _restore_arg(targets.get(key, targets.get(key.removeprefix("backbone/"))), tuple(m.shape))
            for key, m in _flat(dict(saved["params"])).items()
        }
        return self._read(step, {"params": params}, {"params": _unflat(restore_args, params)})["params"]

    def restore_latest_params(self, placed: Any = None) -> tuple[int, Any] | None:
        """(step, params) of the newest checkpoint whose params restore (see `restore_params`), falling back past
        damaged ones as `restore_latest` does; None if there is no step."""
        restored = self._newest_readable(lambda step: (self.restore_params(step, placed), None))
        return None if restored is None else restored[:2]

    def restore_latest(self, target: Any, reading: Callable[[], None] = lambda: None) -> tuple[int, Any, dict] | None:
        """The newest checkpoint that restores, falling back past damaged ones; None if there is no step.
        reading: as `restore`'s (called for each step tried).

        Raises IncompatibleCheckpointError (shapes differ from `target`), CheckpointReadError (an I/O
        error, or every step damaged): the steps are left as they are.
        """
        return self._newest_readable(lambda step: self.restore(step, target, reading))

    def _newest_readable(self, read) -> tuple[int, Any, Any] | None:
        """(step, *read(step)) of the newest step `read` can read, falling back past damaged ones."""
        damaged = []
        for step in reversed(self.steps()):
            path = self.directory / str(step)
            try:
                state, data_state = read(step)
            except IncompatibleCheckpointError:
                raise
            except Exception as e:  # orbax raises ValueError/OSError/KeyError variants for damaged files
                summary = _summary(e)
                if not _is_damage(e):
                    raise CheckpointReadError(
                        f"reading checkpoint {path} failed with an I/O error ({summary}); nothing was skipped or "
                        "deleted. Check the filesystem, then rerun the same command."
                    ) from e
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, summary)
                damaged.append(f"{path}: {summary}")
                continue
            return step, state, data_state
        if damaged:
            raise CheckpointReadError(
                f"no checkpoint in {self.directory} could be restored; nothing was deleted. Move {self.directory} "
                "aside to start over, or use a new --workdir. Damaged:\n  " + "\n  ".join(damaged)
            )
        return None
