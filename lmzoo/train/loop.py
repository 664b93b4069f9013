"""`train_and_evaluate(config, workdir)`: the one loop, written around any trainer.

It builds the run (`lmzoo.train.run`), restores the latest good checkpoint or starts fresh, and steps the
trainer to config.train.steps with logging, checkpoints, in-loop evaluation, preemption and Ctrl-C handling,
then samples and summarises. A run restarted with the same workdir continues exactly where it stopped.
"""

import contextlib
import errno
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from tqdm import tqdm

from lmzoo import checkpoint, kernels, sharding, storage
from lmzoo import config as config_lib
from lmzoo import metrics as metrics_lib
from lmzoo import workdir as workdir_lib
from lmzoo.kernels import host_memory
from lmzoo.objectives.base import Objective
from lmzoo.train.run import Run, assemble, has_checkpoints, restore_or_init, validated_objective

log = logging.getLogger(__name__)


HEADLINE_METRICS = (
    "loss",
    "perplexity",
    "accuracy",
    "score",
    "kl",
)  # printed after each in-loop evaluation, when present

# The training metrics the progress bar shows, when present, by their short names: a supervised run's loss and
# learning rate; a PPO run's reward-model score, KL to the reference and KL coefficient β.
PROGRESS_METRICS = {
    "loss": "loss",
    "learning_rate": "learning_rate",
    "objective/scores": "reward",
    "objective/kl": "kl",
    "objective/kl_coef": "beta",
}


class NonFiniteLossError(FloatingPointError):
    pass


class StepPrograms:
    """The loop's training calls as programs compiled ahead of time (`jit(...).lower(...).compile()`), one for each
    jitted function and batch shapes, called directly. So the first call's program can be traced and compiled on a
    thread while the state is restored or initialised (`_prepared_meanwhile`), overlapping the checkpoint's reading or
    the init's run instead of following them, and no later call traces it again."""

    def __init__(self, run: Run):
        self._run = run
        self._programs: dict[Any, Any] = {}
        self._ahead: dict[Any, list] = {}  # the `_signature` of the arguments each program was compiled for
        self._checked: set[Any] = set()

    @staticmethod
    def _key(fn: Any, batch: dict) -> tuple:
        return fn, tuple((name, value.shape, value.dtype) for name, value in sorted(batch.items()))

    def compile(self, fn: Any, state: Any, batch: dict) -> Any:
        """`fn`'s program for `state` and `batch` (arrays or ShapeDtypeStructs with their shardings), kept."""
        with self._run.context():
            program = fn.lower(state, batch).compile()
        key = self._key(fn, batch)
        self._programs[key], self._ahead[key] = program, _signature((state, batch))
        return program

    def program(self, fn: Any, state: Any, batch: dict) -> Any:
        """The program that runs `fn(state, batch)`. A program compiled ahead for ShapeDtypeStructs is checked
        against the first arrays it gets and compiled again for them where they differ (a weakly typed leaf, another
        sharding)."""
        key = self._key(fn, batch)
        program = self._programs.get(key)
        if program is None or (key not in self._checked and not _same_signature(self._ahead[key], (state, batch))):
            program = self.compile(fn, state, batch)
        self._checked.add(key)
        return program


def _signature(tree: Any) -> list[tuple]:
    """(shape, dtype, weak type, sharding) of each leaf of a tree of arrays or ShapeDtypeStructs."""
    return [(x.shape, x.dtype, x.weak_type, x.sharding) for x in jax.tree.leaves(tree)]


def _same_signature(expected: list[tuple], given: Any) -> bool:
    """Whether the leaves of `given` match `expected` (a `_signature`): shapes, dtypes, weak types, shardings."""
    leaves = _signature(given)
    return len(leaves) == len(expected) and all(
        a[:3] == b[:3] and a[3].is_equivalent_to(b[3], len(a[0])) for a, b in zip(expected, leaves, strict=True)
    )


def evaluate(run: Run, state: Any, split: str = "validation") -> dict[str, float]:
    """The in-loop evaluation: every evaluator of config.eval.evaluators on at most config.eval.max_batches."""
    from lmzoo import evaluation

    metrics = {}
    for name in run.config.eval.evaluators:
        metrics.update(evaluation.EVALUATORS[name](run, state, split, max_batches=run.config.eval.max_batches)[0])
    return metrics


EXIT_PREEMPTED = 75  # SIGTERM (or a multi-host preemption notice): checkpoint saved; rerun to resume (EX_TEMPFAIL)
EXIT_INTERRUPTED = 130  # Ctrl-C: checkpoint saved; rerun to resume (the shell's code for SIGINT)


class TrainingStopped(Exception):
    """Training stopped early, after saving a checkpoint (or while starting, before any step); `exit_code` tells a
    scheduler why."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    """Why the run should checkpoint and stop, if it should: SIGTERM or a multi-host preemption notice
    (preempted), or Ctrl-C (interrupted). A second Ctrl-C kills the process by SIGINT at once, unsaved."""

    def __init__(self):
        self.reason: str | None = None
        self.multi_host = jax.process_count() > 1
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                if signum == signal.SIGTERM and self.multi_host:
                    continue  # every host must stop at the same step: JAX's preemption sync point decides
                self.previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        if signum == signal.SIGINT:
            if self.reason == "interrupted":
                os.write(
                    2, b"\nsecond Ctrl-C: aborted without saving; a rerun resumes from the last saved checkpoint\n"
                )
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)  # die of SIGINT at once (the OS drops the workdir lock)
            self.reason = "interrupted"
            print(
                "\nCtrl-C: saving a checkpoint, then stopping (press Ctrl-C again to abort without saving)",
                file=sys.stderr,
            )
        else:
            self.reason = "preempted"

    def __call__(self, step: int) -> str | None:
        if self.multi_host and self.reason is None and checkpoint.reached_preemption(step):
            self.reason = "preempted"
        return self.reason

    def close(self):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _sigterm_stops_start():
    """SIGTERM while the run starts (before any step, nothing saved) raises TrainingStopped (exit status 143), so
    the staged run state is discarded and the lock released on the way out, instead of the process dying with them.

    Yields `raise_if_stopped`, to call before committing the staged state: Python drops (as "unraisable") an
    exception raised by a signal handler that runs inside a garbage-collector callback (JAX registers one), so the
    handler also records the signal, the stop is raised there at the latest, and the dropped one is not printed."""
    received = []

    def raise_if_stopped():
        if received:
            raise TrainingStopped(
                "stopped by SIGTERM while starting, before the first step: the workdir is as it was (exit status 143); "
                "rerun the same command to start",
                128 + signal.SIGTERM,
            )

    if threading.current_thread() is not threading.main_thread():
        yield raise_if_stopped
        return

    def stop(signum, frame):
        received.append(signum)
        raise_if_stopped()

    def drop_silently_if_stop(unraisable):
        if not isinstance(unraisable.exc_value, TrainingStopped):
            previous_hook(unraisable)

    previous, previous_hook = signal.signal(signal.SIGTERM, stop), sys.unraisablehook
    sys.unraisablehook = drop_silently_if_stop
    try:
        yield raise_if_stopped
        raise_if_stopped()
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = previous_hook


@contextlib.contextmanager
def _full_disk_named(workdir: str):
    """A full disk while starting is named with the workdir and the unfinished checkpoints of a failed save, which
    hold space there and which no run reads."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        checkpoints = storage.path(workdir) / "checkpoints"
        names = storage.list_dir(checkpoints) if storage.exists(checkpoints) else []
        partial = [os.fspath(checkpoints / name) for name in names if ".orbax-checkpoint-tmp" in name]
        held = (
            f"; unfinished checkpoints of a failed save hold space there and can be deleted: {partial}"
            if partial
            else ""
        )
        raise OSError(
            f"the disk holding {workdir} is full ({e.strerror}: {e.filename or 'while starting'}){held}; free space, "
            "then rerun the same command"
        ) from None


def _count(tree: Any) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def start_summary(run: Run, loader: Any, start: int) -> str:
    """Parameter count, dataset size, tokens per step and the device mesh, printed when training starts."""
    cfg, compiled = run.config, run.compiled
    frozen = _count(compiled.abstract_state.frozen)
    mesh = ", ".join(f"{name}={size}" for name, size in compiled.mesh.shape.items())
    tokenizer = "the store's" if cfg.data.source == "store" else cfg.data.tokenizer.kind  # a store brings its own
    lines = [
        f"workdir {run.workdir}: {'resuming at step ' + str(start) if start else 'new run'} of {cfg.train.steps} steps",
        f"model {cfg.model_name}: {_count(compiled.abstract_state.params):,} trained parameters"
        + (f" (+ {frozen:,} frozen)" if frozen else ""),
        f"data {run.objective.reader.describe(cfg)}: training split of {loader.dataset_size}; "
        f"tokenizer {tokenizer} ({run.tokenizer.vocab_size} ids)",
        f"per step: {run.objective.step_summary()}",
        f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} (JAX backend {jax.default_backend()}) in "
        f"{jax.process_count()} process(es); mesh {mesh}",
    ]
    unused = sharding.unused_accelerator_warning()
    if unused:
        lines.append(unused)
    if cfg.optim.decay_steps > cfg.train.steps:
        lines.append(
            f"note: optim.decay_steps={cfg.optim.decay_steps} > train.steps={cfg.train.steps}: the run ends before the "
            f"learning rate decays to optim.min_learning_rate; pass --config.optim.decay_steps={cfg.train.steps} to decay fully"
        )
    if cfg.optim.decay_steps < cfg.train.steps:
        lines.append(
            f"note: train.steps={cfg.train.steps} > optim.decay_steps={cfg.optim.decay_steps}: steps after "
            f"{cfg.optim.decay_steps} train at optim.min_learning_rate={cfg.optim.min_learning_rate}; pass "
            f"--config.optim.decay_steps={cfg.train.steps} to decay over the whole run"
        )
    return "\n".join(lines)


def end_summary(run: Run, seconds: float, done: int) -> str:
    """Total time, where the outputs are, and how to evaluate and resume, printed when training ends."""
    workdir = run.workdir
    lines = [
        f"trained to step {done} in {seconds / 60:.1f} min",
        f"checkpoints: {run.checkpointer.directory} (steps {run.checkpointer.steps()})",
        f"metrics: {workdir / 'metrics.jsonl'}; TensorBoard events: {workdir / 'tb'} "
        "(view: pip install tensorboard && tensorboard --logdir " + str(workdir / "tb") + ")",
    ]
    if storage.exists(workdir / "sample.txt"):
        lines.append(f"sample: {workdir / 'sample.txt'}")
    lines += [
        f"evaluate: python eval.py --workdir={workdir}",
        f"resume or extend: python train.py <same flags> --workdir={workdir} --config.train.steps=N (N > {done})",
    ]
    return "\n".join(lines)


def _start(objective: Objective, workdir: str, stage: workdir_lib.StagedRunState | None, command_line: Collection[str]):
    """Everything a training run checks before its first step: build, restore (the config must match the
    checkpoint's; `command_line`: the overridden keys, which a refusal names), the training data; stages the config
    to be committed once all passed."""
    run = assemble(objective, workdir, stage)
    saved_config = run.workdir / "config.json"
    resumable = has_checkpoints(run.workdir) and storage.exists(saved_config)
    programs = StepPrograms(run)
    try:
        loader = run.train_loader()
        first_step = max(run.checkpointer.steps(), default=0) if resumable else 0
        with _prepared_meanwhile(run, programs, loader, first_step) as start_preparing:
            state, data_state = restore_or_init(run, start_preparing)
        fingerprint = run.objective.reader.fingerprint(run.config)
        if resumable and data_state["step"] > 0:
            _warn_if_data_changed(run.workdir / "data.json", fingerprint, int(data_state["step"]))
            config_lib.check_resume(run.config, int(data_state["step"]), run.workdir, command_line)
        if next(iter(run.eval_batches("validation")), None) is None:
            raise ValueError("the validation split has no examples; use more data or a larger validation split")
    except BaseException:
        run.close()
        raise
    if data_state["step"] > 0 and jax.process_index() == 0:  # said once every check passed, never before a refusal
        print(f"resumed from {run.checkpointer.directory / str(data_state['step'])}")
    if stage is not None:
        stage.write_text("config.json", run.config.to_json_best_effort(indent=2))
        stage.write_text("data.json", json.dumps({"fingerprint": fingerprint}))
    return run, state, data_state, loader, programs


def _prepared_meanwhile(run: Run, programs: StepPrograms, loader: Any, step: int):
    """A context giving `start()`, which prepares the first step on a thread while the state is made
    (`restore_or_init` calls it as the work begins that leaves Python's interpreter lock free, which tracing and
    importing hold): the program of the loop's first call (from `step`), compiled from the state's shapes (not for a
    trainer with phases, which the loop runs as jitted functions), and the metric writer's event files module."""
    work = [metrics_lib.event_writer_class] if jax.process_index() == 0 else []
    size = call_size(step, run.config.train, run.config.train.steps_per_call)
    if not run.compiled.phases and size > 0:  # (size 0: a finished run)
        with run.context():
            fn, device_batch = _device_calls(run.compiled, [loader.batch(s) for s in range(step, step + size)])[0]
        work.insert(0, functools.partial(programs.compile, fn, run.compiled.abstract_state, device_batch))
    return _on_a_thread(work)


@contextlib.contextmanager
def _on_a_thread(work: list[Callable[[], Any]]):
    """A context that gives `start()`, which runs each of `work` in order on a thread (at its first call; at the
    block's end if never called). The block's end waits for the thread (a compiler left running while the process
    exits aborts it), then raises the block's error, or else the work's."""
    outcome: dict[str, BaseException] = {}

    def run_work() -> None:
        try:
            for part in work:
                part()
        except BaseException as error:  # raised in the caller's thread, after the block
            outcome["error"] = error

    thread = threading.Thread(target=run_work, name="lmzoo-start")

    def start() -> None:
        if thread.ident is None:
            thread.start()

    try:
        yield start
    except BaseException:
        if thread.ident is not None:
            thread.join()
        raise
    start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]


def _warn_if_data_changed(saved: epath.Path, fingerprint: str, step: int) -> None:
    """Warns when the files config.data names changed since the checkpoints were written (a resume then draws its
    batches from other data)."""
    if storage.exists(saved) and json.loads(storage.read_text(saved)).get("fingerprint") != fingerprint:
        log.warning(
            "the training data changed since step %d was saved (a file config.data names has another size or "
            "modification time): the resumed run continues on the new data, so it will not repeat the batches an "
            "uninterrupted run would have read",
            step,
        )


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, command_line: Collection[str] = ()
) -> dict[str, float]:
    """Trains to `config.train.steps`; returns the final validation metrics. `command_line`: the config keys given
    as overrides (train.py's `--config.KEY=...`), which a refused resume tells apart from the config file's.

    Process 0 holds the workdir's lock for the whole run (a second run on it stops, naming this one; on a bucket
    the lock is a lease, checked before each step's writes). Nothing in the workdir changes until the config, data,
    tokenizer and checkpoint all passed their checks: config.json and tokenizer/ are staged and committed before the
    first step.
    Raises TrainingStopped (after saving a checkpoint) on SIGTERM, preemption or Ctrl-C; SIGTERM while starting
    raises it at once, with the workdir as it was.
    """
    began = time.time()
    objective = validated_objective(config)  # every config check, before the workdir is touched
    is_main = jax.process_index() == 0
    lock, started, run = None, False, None
    try:
        with _sigterm_stops_start() as raise_if_stopped, _full_disk_named(workdir):
            lock = workdir_lib.lock(workdir) if is_main else None
            if is_main:
                for name in workdir_lib.remove_leftovers(workdir):
                    log.warning("removed %s, left in %s by a run that was killed while writing it", name, workdir)
            # Only process 0 writes the workdir: the others start with nothing staged.
            with workdir_lib.StagedRunState(workdir) if is_main else contextlib.nullcontext() as stage:
                run, state, data_state, loader, programs = _start(objective, workdir, stage, command_line)
                if stage is not None:
                    raise_if_stopped()
                    stage.commit()
        started = True
        return _train(run, state, data_state, loader, programs, began, lock)
    except storage.BucketUnreachableError as error:
        saved = run.checkpointer.committed_note() if started else "what the run saved before is kept"
        raise storage.BucketUnreachableError(
            f"{error}. Training stopped; {saved}: rerun the same command once the bucket answers, to resume"
        ) from None
    except workdir_lib.LeaseLostError as error:
        if not started:
            raise
        note = run.checkpointer.committed_note()
        raise workdir_lib.LeaseLostError(f"{error} {note[0].upper()}{note[1:]}.") from None
    finally:
        if lock is not None:
            lock.release(failed_start=not started)


def run_timed_phases(phases: dict, state: Any, batch: Any) -> tuple[Any, dict]:
    """One step of a trainer with phases, each jitted phase waited for: (state, metrics + "time/<phase>_ms")."""
    carry, times = None, {}
    for name, phase in phases.items():
        began = time.perf_counter()
        carry = jax.block_until_ready(phase(state, batch, carry))
        times[f"time/{name}_ms"] = (np.float32(1e3 * (time.perf_counter() - began)), np.float32(1.0))
    state, metrics = carry
    return state, {**metrics, **times}


def progress_postfix(summary: dict[str, float]) -> dict[str, str]:
    """The progress bar's fields of a training summary (PROGRESS_METRICS present in it), 4 significant digits."""
    return {short: f"{summary[name]:.4g}" for name, short in PROGRESS_METRICS.items() if name in summary}


def call_size(step: int, train: ml_collections.ConfigDict, steps_per_call: int) -> int:
    """Steps the compiled call from `step` runs: at most `steps_per_call`, ending at the next step that logs,
    saves or evaluates, or at the last, so those land on call boundaries exactly as with one step per call."""
    size = min(steps_per_call, train.steps - step)
    for every in (train.log_every, train.checkpoint_every, train.eval_every):
        size = min(size, every - step % every)
    return size


def _device_calls(compiled, host_batches: list[dict]) -> list[tuple[Any, dict]]:
    """(jitted function, device batch) calls that run `host_batches` in order: one `steps` call on them stacked
    when there are several of one shape, else one `step` call each (a loader that trims padding per batch)."""
    shapes = {tuple((k, v.shape) for k, v in sorted(b.items())) for b in host_batches}
    if len(host_batches) > 1 and len(shapes) == 1:
        stacked = {k: np.stack([b[k] for b in host_batches]) for k in host_batches[0]}
        return [(compiled.steps, sharding.put_batch(stacked, compiled.stacked_batch_sharding))]
    return [(compiled.step, sharding.put_batch(b, compiled.batch_sharding)) for b in host_batches]


def _train(
    run: Run,
    state: Any,
    data_state: dict,
    loader: Any,
    programs: StepPrograms,
    began: float,
    lock: workdir_lib.WorkdirLock | workdir_lib.LeaseLock | None,
) -> dict[str, float]:
    """The steps from the restored `state` to config.train.steps, then evaluation, a sample and the end summary.
    `lock`: the workdir's lock on process 0 (None on the others), checked before each step's writes."""
    from lmzoo.evaluation.generation import sample_text

    config, compiled, workdir = run.config, run.compiled, str(run.workdir)
    is_main = jax.process_index() == 0
    start = int(data_state["step"])
    if is_main:
        print(start_summary(run, loader, start), flush=True)
    writer = metrics_lib.MetricWriter(workdir, enabled=is_main, resume_step=start)
    stop_signals = StopSignals()
    last_good = start
    total, window_start, window_step, window_tokens = None, time.time(), start, 0
    progress = tqdm(
        total=config.train.steps,
        initial=start,
        disable=not is_main,
        desc="train",
        mininterval=0.5 if sys.stderr.isatty() else 30.0,
    )
    final = None
    with run.context():  # the platform of the run's mesh
        step_buffers = host_memory.StepBuffers(kernels.platform())
    try:
        step = start
        while step < config.train.steps:
            size = call_size(step, config.train, 1 if compiled.phases else config.train.steps_per_call)
            host_batches = [loader.batch(s) for s in range(step, step + size)]
            window_tokens += sum(run.objective.real_tokens(b) for b in host_batches)
            with run.context():
                for fn, device_batch in _device_calls(compiled, host_batches):
                    if compiled.phases:
                        state, step_metrics = run_timed_phases(compiled.phases, state, device_batch)
                    else:
                        program = programs.program(fn, state, device_batch)
                        step_buffers.before_call(program, state, device_batch)
                        state, step_metrics = program(state, device_batch)
                    total = metrics_lib.accumulate(total, step_metrics)
            run.checkpointer.check_for_errors()
            if lock is not None:
                lock.check()
            done = step + size
            at_log = done % config.train.log_every == 0 or done == config.train.steps
            at_ckpt = done % config.train.checkpoint_every == 0 or done == config.train.steps
            at_eval = done % config.train.eval_every == 0 or done == config.train.steps
            stop = stop_signals(done)
            if at_log or at_ckpt or stop:
                summary = metrics_lib.summarize(total, token_nll=run.objective.loss_is_token_nll)
                if not metrics_lib.all_finite(summary):
                    raise NonFiniteLossError(
                        f"non-finite training metrics between steps {window_step} and {done}: {summary}. "
                        f"Training stopped; the last good checkpoint (step {last_good}) is kept in {workdir}/checkpoints. "
                        "Lower config.optim.learning_rate or check the data."
                    )
                elapsed = max(time.time() - window_start, 1e-9)
                summary["tokens_per_sec"] = window_tokens * jax.process_count() / elapsed
                writer.write(done, summary, "train")
                progress.set_postfix(progress_postfix(summary))
                total, window_start, window_step, window_tokens = None, time.time(), done, 0
            if at_ckpt or stop:
                run.checkpointer.save(done, state.replace(frozen={}), {"step": done}, force=bool(stop))
                if at_eval or stop:
                    run.checkpointer.wait()  # the step is on disk before an evaluation that might fail
                last_good = done
            if stop:
                progress.close()
                code = EXIT_INTERRUPTED if stop == "interrupted" else EXIT_PREEMPTED
                raise TrainingStopped(
                    f"{stop}: saved checkpoint {done} in {run.checkpointer.directory}; rerun the same command to resume "
                    f"(exit status {code})",
                    code,
                )
            if at_eval:
                with step_buffers.released():  # the step's buffers, kept mapped between steps
                    final = evaluate(run, state)
                writer.write(done, final, "validation")
                headline = ", ".join(f"{k} {final[k]:.4g}" for k in HEADLINE_METRICS if k in final)
                progress.write(f"step {done}: validation {headline}")
            progress.update(size)
            step = done
        progress.close()
        run.checkpointer.wait()
        step_buffers.release()
        if final is None:
            final = evaluate(run, state)
        params = run.compiled.host_params(state) if config.train.sample_tokens > 0 else None
        if is_main and params is not None:
            text = sample_text(
                run,
                params,
                config.train.sample_prompt,
                max_new_tokens=config.train.sample_tokens,
                temperature=0.8,
                top_k=0,
                top_p=0.95,
                seed=config.train.seed,
                note_window=False,
            )
            storage.write_text(run.workdir / "sample.txt", config.train.sample_prompt + text)
            print(f"--- sample (step {int(state.step)}) ---\n{config.train.sample_prompt}{text}\n---")
        if is_main:
            print(end_summary(run, time.time() - began, max(start, config.train.steps)))
        return final
    finally:
        progress.close()
        stop_signals.close()
        writer.close()
        run.close()
