"""`train_and_evaluate(config, workdir)`: the one loop, written around any trainer.

`build` makes a `Run` from a config and a workdir: the objective (`lmzoo.objectives`), tokenizer,
model, trainer compiled over the mesh, and a checkpointer. It reads no data unless the tokenizer must
be trained on it; loaders are built on first use, so restoring and scoring a checkpoint needs only
its workdir. A run restarted with the same workdir restores the latest good checkpoint (state,
loader position) and continues exactly where it stopped; frozen parameters are read again from
the paths the config names, never from the checkpoint.
"""

import dataclasses
import json
import logging
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from lmzoo import checkpoint, objectives, sharding, tokenizers
from lmzoo import config as config_lib
from lmzoo import workdir as workdir_lib
from lmzoo.objectives import base
from lmzoo.train import host_memory
from lmzoo.train import metrics as metrics_lib
from lmzoo.train import trainer as trainer_lib

log = logging.getLogger(__name__)


HEADLINE_METRICS = ("loss", "perplexity", "accuracy", "score", "kl")  # printed after each in-loop evaluation, when present


class NonFiniteLossError(FloatingPointError):
    pass


@dataclasses.dataclass
class Run:
    """What training and evaluation build from a config and a workdir. Data is read on first use."""

    config: ml_collections.ConfigDict
    workdir: pathlib.Path
    objective: base.Objective
    tokenizer: tokenizers.Tokenizer
    model: nn.Module
    compiled: trainer_lib.CompiledTrainer
    checkpointer: checkpoint.Checkpointer
    splits: dict[str, Any] = dataclasses.field(default_factory=dict)  # raw examples by split name

    @property
    def abstract_state(self) -> Any:
        """Restore target of a checkpoint: the state without its frozen parameters."""
        return self.compiled.abstract_state.replace(frozen={})

    @property
    def shard(self) -> base.Shard:
        return base.Shard(jax.process_index(), jax.process_count())

    def context(self):
        """Mesh and rules context under which every jitted function of the run is traced and called."""
        return self.compiled.context()

    def raw(self, split: str) -> Any:
        """The raw examples of `split` ("train", "validation", or a name given to `add_split`)."""
        if split not in self.splits:
            if split not in ("train", "validation"):
                raise ValueError(
                    f"unknown split {split!r}; choose one of {sorted({'train', 'validation', *self.splits})}"
                )
            self.splits.update(self.objective.read(self.config))
        return self.splits[split]

    def add_split(self, name: str, path: str) -> None:
        """Makes the examples of a file (in the objective's format) evaluable as split `name`."""
        self.splits[name] = self.objective.read_file(self.config, path)

    def train_loader(self):
        return self.objective.train_loader(self.config, self.tokenizer, self.raw("train"), self.shard)

    def eval_batches(self, split: str):
        return self.objective.eval_batches(self.config, self.tokenizer, self.raw(split), self.shard)


def has_checkpoints(workdir: pathlib.Path) -> bool:
    """Whether `workdir` holds a saved step (a finished orbax step folder)."""
    folder = workdir / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def _tokenizer(config: ml_collections.ConfigDict, run_splits: dict, objective: base.Objective, workdir: pathlib.Path,
               stage: workdir_lib.StagedRunState | None) -> tokenizers.Tokenizer:  # fmt: skip
    """The run's tokenizer: the workdir's when it has checkpoints (so a resumed run keeps its ids); else
    built (from the run's data for kinds learnt from a corpus) and, when `stage` is given, staged there.
    A tokenizer left by a run that never saved a checkpoint is rebuilt, never reused."""
    saved = workdir / "tokenizer" / "spec.json"
    if saved.exists() and has_checkpoints(workdir):
        return tokenizers.from_spec(json.loads(saved.read_text()), str(saved.parent))
    spec = config.data.tokenizer.to_dict()
    kind = spec.pop("kind")
    corpus = None
    if kind in ("char", "word", "sentencepiece") and not spec.get("path"):
        run_splits.update(objective.read(config))
        corpus = objective.corpus(run_splits["train"]) + objective.corpus(run_splits["validation"])
    tokenizer = tokenizers.build_tokenizer(kind, corpus=corpus, **spec)
    if stage is not None:
        folder = stage.path("tokenizer")
        folder.mkdir()
        (folder / "spec.json").write_text(json.dumps(tokenizer.save(str(folder))))
    return tokenizer


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
    """Devices a batch is split over: the mesh's data x fsdp axes."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def build(config: ml_collections.ConfigDict, workdir: str, stage: workdir_lib.StagedRunState | None = None, *,
          batches: bool = True) -> Run:  # fmt: skip
    """Validated config, objective, tokenizer, model, compiled trainer and checkpointer for a workdir.

    stage: where a training run stages a newly built tokenizer (None: a new tokenizer is not saved).
    batches: check that batch sizes split over the mesh (False for a run opened only to restore params).
    """
    config = config_lib.validate(config)
    try:
        mesh = sharding.make_mesh(tuple(config.sharding.mesh_shape))
    except ValueError as e:
        raise ValueError(f"config.sharding.mesh_shape={tuple(config.sharding.mesh_shape)}: {e}") from None
    config_lib.check_values(config, data_parallel_size=data_parallel_size(mesh), batches=batches)
    workdir_path = pathlib.Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    rules = sharding.axis_rules(tuple(tuple(r) for r in config.sharding.rules))
    objective = objectives.get(config.objective.name)
    splits: dict[str, Any] = {}
    tokenizer = _tokenizer(config, splits, objective, workdir_path, stage)
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); set --config.model.vocab_size={tokenizer.vocab_size} (or larger)"
        )
    model = objective.model(config)
    compiled = trainer_lib.compile_trainer(
        objective.trainer(config, model), mesh=mesh, rules=rules, seed=config.train.seed
    )
    checkpointer = checkpoint.Checkpointer(
        str(workdir_path / "checkpoints"),
        max_to_keep=config.train.keep_checkpoints,
        async_save=config.train.async_checkpoints,
    )
    return Run(config=config, workdir=workdir_path, objective=objective, tokenizer=tokenizer, model=model,
               compiled=compiled, checkpointer=checkpointer, splits=splits)  # fmt: skip


def load_frozen(run: Run) -> Any:
    """The frozen parameters, read from the paths the config names, sharded like the state's."""
    if not jax.tree.leaves(run.compiled.abstract_state.frozen):
        return run.compiled.abstract_state.frozen
    with run.context():
        fresh = jax.device_get(run.compiled.init(jax.random.key(run.config.train.seed)).frozen)
    return jax.device_put(run.objective.load_frozen(run.config, fresh), run.compiled.state_shardings.frozen)


def restore_or_init(run: Run) -> tuple[Any, dict]:
    """The latest good checkpoint (with frozen parameters read again), or a fresh state whose frozen
    parameters are read, whose params the objective may adjust, and which takes config.init_from's weights."""
    restored = run.checkpointer.restore_latest(run.abstract_state)
    if restored is not None:
        step, state, data_state = restored
        if jax.process_index() == 0:
            print(f"resumed from {run.checkpointer.directory / str(step)}")
        return state.replace(frozen=load_frozen(run)), data_state
    cfg = run.config
    with run.context():
        state = run.compiled.init(jax.random.key(cfg.train.seed))
    frozen = load_frozen(run)
    fresh = jax.device_get(state.params)
    params = run.objective.init_params(cfg, fresh, jax.device_get(frozen))
    if cfg.get("init_from"):
        from lmzoo.train import restore

        params = restore.merge_pretrained(
            params, cfg.init_from, cfg.model_name, cfg.model.to_dict(), allow_partial=cfg.init_from_partial
        )
    state = state.replace(frozen=frozen)
    if params is not fresh:
        with run.context():
            state = run.compiled.with_params(state, jax.device_put(params, run.compiled.state_shardings.params))
    return state, {"step": 0}


def host_params(run: Run, state: Any):
    """Params as host numpy arrays; every process must call this (it gathers across hosts)."""
    with run.context():
        gathered = jax.jit(lambda p: p, out_shardings=sharding.replicated(run.compiled.mesh))(state.params)
    return jax.device_get(gathered)


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
    """Training stopped early after saving a checkpoint; `exit_code` tells a scheduler why."""

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


def _count(tree: Any) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def start_summary(run: Run, loader: Any, start: int) -> str:
    """Parameter count, dataset size, tokens per step and the device mesh, printed when training starts."""
    cfg, compiled = run.config, run.compiled
    frozen = _count(compiled.abstract_state.frozen)
    mesh = ", ".join(f"{name}={size}" for name, size in compiled.mesh.shape.items())
    lines = [
        f"workdir {run.workdir.absolute()}: {'resuming at step ' + str(start) if start else 'new run'} of {cfg.train.steps} steps",
        f"model {cfg.model_name}: {_count(compiled.abstract_state.params):,} trained parameters"
        + (f" (+ {frozen:,} frozen)" if frozen else ""),
        f"data {cfg.data.source}: training split of {getattr(loader, 'dataset_size', 'unreported size')}; "
        f"tokenizer {cfg.data.tokenizer.kind} ({run.tokenizer.vocab_size} ids)",
        f"per step: {run.objective.step_summary(cfg)}",
        f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} in {jax.process_count()} process(es); mesh {mesh}",
    ]
    if cfg.optim.decay_steps > cfg.train.steps:
        lines.append(
            f"note: optim.decay_steps={cfg.optim.decay_steps} > train.steps={cfg.train.steps}: the run ends before the "
            f"learning rate decays to optim.min_learning_rate; pass --config.optim.decay_steps={cfg.train.steps} to decay fully"
        )
    return "\n".join(lines)


def end_summary(run: Run, seconds: float, done: int) -> str:
    """Total time, where the outputs are, and how to evaluate and resume, printed when training ends."""
    workdir = run.workdir.absolute()
    lines = [
        f"trained to step {done} in {seconds / 60:.1f} min",
        f"checkpoints: {run.checkpointer.directory} (steps {run.checkpointer.steps()})",
        f"metrics: {workdir / 'metrics.jsonl'}; TensorBoard events: {workdir / 'tb'} "
        "(view: pip install tensorboard && tensorboard --logdir " + str(workdir / "tb") + ")",
    ]
    if (workdir / "sample.txt").exists():
        lines.append(f"sample: {workdir / 'sample.txt'}")
    lines += [
        f"evaluate: python eval.py --workdir={workdir}",
        f"resume or extend: python train.py <same flags> --workdir={workdir} --config.train.steps=N (N > {done})",
    ]
    return "\n".join(lines)


def _start(config: ml_collections.ConfigDict, workdir: str, stage: workdir_lib.StagedRunState | None):
    """Everything a training run checks before its first step: build, restore (the config must match the
    checkpoint's), the training data; stages the config to be committed once all passed."""
    run = build(config, workdir, stage)
    saved_config = run.workdir / "config.json"
    resumable = has_checkpoints(run.workdir) and saved_config.exists()
    try:
        state, data_state = restore_or_init(run)
        if resumable and data_state["step"] > 0:
            saved = json.loads(saved_config.read_text())
            config_lib.check_resume(saved, run.config, int(data_state["step"]), run.workdir)
        loader = run.train_loader()
    except BaseException:
        run.checkpointer.close()
        raise
    if stage is not None:
        stage.write_text("config.json", run.config.to_json_best_effort(indent=2))
    return run, state, data_state, loader


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Trains to `config.train.steps`; returns the final validation metrics.

    Process 0 holds the workdir's lock for the whole run (a second run on it stops, naming this one).
    Nothing in the workdir changes until the config, data, tokenizer and checkpoint all passed their
    checks: config.json and tokenizer/ are staged and committed together before the first step.
    Raises TrainingStopped (after saving a checkpoint) on SIGTERM, preemption or Ctrl-C.
    """
    began = time.time()
    is_main = jax.process_index() == 0
    lock = workdir_lib.lock(workdir) if is_main else None
    started = False
    try:
        if is_main:
            for name in workdir_lib.remove_leftovers(workdir):
                log.warning("removed %s, left in %s by a run that crashed while starting", name, workdir)
            with workdir_lib.StagedRunState(workdir) as stage:
                run, state, data_state, loader = _start(config, workdir, stage)
                stage.commit()
        else:
            run, state, data_state, loader = _start(config, workdir, None)
        started = True
        return _train(run, state, data_state, loader, began)
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


def _train(run: Run, state: Any, data_state: dict, loader: Any, began: float) -> dict[str, float]:
    """The steps from the restored `state` to config.train.steps, then evaluation, a sample and the end summary."""
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
        total=config.train.steps, initial=start, disable=not is_main, desc="train",
        mininterval=0.5 if sys.stderr.isatty() else 30.0,
    )  # fmt: skip
    final = None
    try:
        for step in range(start, config.train.steps):
            host_batch = loader.batch(step)
            window_tokens += run.objective.real_tokens(host_batch)
            with run.context():
                device_batch = sharding.put_batch(host_batch, compiled.batch_sharding)
                if compiled.phases:
                    state, step_metrics = run_timed_phases(compiled.phases, state, device_batch)
                else:
                    state, step_metrics = compiled.step(state, device_batch)
                    if step == start:
                        host_memory.keep_step_buffers_mapped(compiled.step, state, device_batch)
            run.checkpointer.check_for_errors()
            total = metrics_lib.accumulate(total, step_metrics)
            done = step + 1
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
                progress.set_postfix({k: f"{summary[k]:.4g}" for k in ("loss", "learning_rate") if k in summary})
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
                host_memory.release_freed_memory()  # the step's buffers, kept mapped between steps
                final = evaluate(run, state)
                host_memory.release_freed_memory()
                writer.write(done, final, "validation")
                headline = ", ".join(f"{k} {final[k]:.4g}" for k in HEADLINE_METRICS if k in final)
                progress.write(f"step {done}: validation {headline}")
            progress.update(1)
        progress.close()
        run.checkpointer.wait()
        host_memory.release_freed_memory()
        if final is None:
            final = evaluate(run, state)
        params = host_params(run, state) if config.train.sample_tokens > 0 else None
        if is_main and params is not None:
            text = sample_text(run, params, config.train.sample_prompt, max_new_tokens=config.train.sample_tokens,
                                          temperature=0.8, top_k=0, top_p=0.95, seed=config.train.seed, fit_to_model=True)  # fmt: skip
            (run.workdir / "sample.txt").write_text(config.train.sample_prompt + text)
            print(f"--- sample (step {int(state.step)}) ---\n{config.train.sample_prompt}{text}\n---")
        if is_main:
            print(end_summary(run, time.time() - began, max(start, config.train.steps)))
        return final
    finally:
        progress.close()
        stop_signals.close()
        writer.close()
        run.checkpointer.close()
