"""Orbax checkpoints of the whole train state plus the data loader's position.

Layout: `<workdir>/checkpoints/<step>/{state,data}`. Restore targets carry shardings, so a
checkpoint written on one mesh restores onto another. Restoring tells three failures apart:
- a damaged step (truncated or missing files) is reported, naming the file, and skipped in favour of
  the previous good one, which is replaced once the resumed run saves that step again;
- a step whose shapes do not match the model raises IncompatibleCheckpointError naming the parameters;
- an I/O error that says nothing about the files (permission, device, network filesystem) raises
  CheckpointReadError at once: nothing is skipped or deleted.
When steps exist but none restores, restoring raises instead of letting a run start over.
A failed save raises CheckpointSaveError with its cause (a full disk named as such).
"""

import asyncio
import contextlib
import errno
import functools
import json
import logging
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from lmzoo import storage

log = logging.getLogger(__name__)


def _flat(tree: Any) -> dict[str, Any]:
    """{"a/b/c": leaf} of a nested mapping."""
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def _unflat(flat: dict[str, Any], like: Any) -> Any:
    """`like`'s structure with each leaf replaced by flat["a/b/c"] of its path."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: flat["/".join(str(getattr(k, "key", k)) for k in path)], like
    )


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
    """An exception's type and the first line of its message (at most 300 characters)."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


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


class Checkpointer:
    """Saves and restores (state, data_state) under `directory`; keeps the newest `max_to_keep`."""

    def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = storage.path(directory)
        on_s3 = os.fspath(directory).startswith("s3://")
        if on_s3:
            _orbax_writes_s3()
        self.failed = False
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

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        # Steps >= `step` can only be unreadable checkpoints a resumed run fell back past; orbax would
        # skip (or, forced, refuse) every save up to the newest of them, so they are dropped first.
        for stale in [s for s in self.steps() if s >= step]:
            self.manager.delete(stale)
        try:
            return self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
                force=force,
            )
        except Exception as e:
            raise self._save_error(e) from None

    def _save_error(self, error: BaseException) -> CheckpointSaveError:
        self.failed = _ORBAX_NOISE.futures_abandoned = True
        kept = [s for s in self.steps() if (self.directory / str(s)).is_dir()]
        return CheckpointSaveError(
            f"saving a checkpoint in {self.directory} failed: {_save_cause(error)}. Training stopped; "
            f"the previous checkpoints {kept} are intact. Fix the cause and rerun the same command to resume."
        )

    def check_for_errors(self) -> None:
        """Raises CheckpointSaveError if a background save has failed."""
        try:
            self.manager.check_for_errors()
        except Exception as e:
            raise self._save_error(e) from None

    def wait(self) -> None:
        """Waits for the background save; raises CheckpointSaveError if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._save_error(e) from None

    def close(self) -> None:
        """Closes the manager; a save error here was already raised by `wait` or is logged (not raised over another error)."""
        already_reported = self.failed
        try:
            self.manager.close()
        except Exception as e:
            error = self._save_error(e)
            if not already_reported:
                log.error("%s", error)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def check_compatible(self, step: int, target: Any) -> None:
        """Raises IncompatibleCheckpointError naming every leaf whose saved shape differs from `target`."""
        saved = self.manager.item_metadata(step)["state"]
        saved_shapes = {
            _path_str(p): tuple(m.shape)
            for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]
            if hasattr(m, "shape")
        }
        if not saved_shapes:
            raise FileNotFoundError(
                f"{self.directory / str(step) / 'state' / '_METADATA'}: no parameter metadata (missing or damaged)"
            )
        target_shapes = {_path_str(p): tuple(t.shape) for p, t in jax.tree_util.tree_flatten_with_path(target)[0]}
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

    @_abandoning_futures_on_error()
    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """target: a pytree of jax.ShapeDtypeStruct with shardings."""
        self.check_compatible(step, target)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
        )
        return restored["state"], dict(restored["data"])

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
        shapes = {key: tuple(m.shape) for key, m in _flat(dict(saved["params"])).items()}
        targets = _flat(placed) if placed is not None else {}

        def restore_arg(key: str):
            like = targets.get(key, targets.get(key.removeprefix("backbone/")))
            where = getattr(like, "sharding", None)
            if where is None or tuple(like.shape) != shapes[key]:
                return ocp.RestoreArgs(restore_type=np.ndarray)
            return ocp.ArrayRestoreArgs(sharding=where, dtype=like.dtype, global_shape=shapes[key])

        restore_args = _unflat({key: restore_arg(key) for key in shapes}, params)
        args = ocp.args.PyTreeRestore(
            item={"params": params}, restore_args={"params": restore_args}, partial_restore=True
        )
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(self.directory / str(step) / "state", args=args)["params"]

    def restore_latest_params(self, placed: Any = None) -> tuple[int, Any] | None:
        """(step, params) of the newest checkpoint whose params restore (see `restore_params`), falling back past
        damaged ones as `restore_latest` does; None if there is no step."""
        restored = self._newest_readable(lambda step: (self.restore_params(step, placed), None))
        return None if restored is None else restored[:2]

    def restore_latest(self, target: Any) -> tuple[int, Any, dict] | None:
        """The newest checkpoint that restores, falling back past damaged ones; None if there is no step.

        Raises IncompatibleCheckpointError (shapes differ from `target`), CheckpointReadError (an I/O
        error, or every step damaged): the steps are left as they are.
        """
        return self._newest_readable(lambda step: self.restore(step, target))

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
