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
import pathlib
import signal
import sys
import threading
import time
from typing import Any

import flax.linen as nn
import jax
import ml_collections
from tqdm import tqdm

from lmzoo import checkpoint, objectives, sharding, tokenizers
from lmzoo import config as config_lib
from lmzoo.objectives import base
from lmzoo.train import metrics as metrics_lib
from lmzoo.train import trainer as trainer_lib

log = logging.getLogger(__name__)


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
                raise ValueError(f"unknown split {split!r}; choose one of {sorted({'train', 'validation', *self.splits})}")
            self.splits.update(self.objective.read(self.config))
        return self.splits[split]

    def add_split(self, name: str, path: str) -> None:
        """Makes the examples of a file (in the objective's format) evaluable as split `name`."""
        self.splits[name] = self.objective.read_file(self.config, path)

    def train_loader(self):
        return self.objective.train_loader(self.config, self.tokenizer, self.raw("train"), self.shard)

    def eval_batches(self, split: str):
        return self.objective.eval_batches(self.config, self.tokenizer, self.raw(split), self.shard)


def _tokenizer(config: ml_collections.ConfigDict, run_splits: dict, objective: base.Objective,
               workdir: pathlib.Path) -> tokenizers.Tokenizer:  # fmt: skip
    """The run's tokenizer: reloaded from the workdir when it exists so a resumed run keeps its ids; else
    built (from the run's data for kinds learnt from a corpus) and saved there."""
    saved = workdir / "tokenizer" / "spec.json"
    if saved.exists():
        return tokenizers.from_spec(json.loads(saved.read_text()), str(saved.parent))
    spec = config.data.tokenizer.to_dict()
    kind = spec.pop("kind")
    corpus = None
    if kind in ("char", "sentencepiece") and not spec.get("path"):
        run_splits.update(objective.read(config))
        corpus = objective.corpus(run_splits["train"]) + objective.corpus(run_splits["validation"])
    tokenizer = tokenizers.build_tokenizer(kind, corpus=corpus, **spec)
    if jax.process_index() == 0:
        staging = workdir / "tokenizer.tmp"
        staging.mkdir(parents=True, exist_ok=True)
        (staging / "spec.json").write_text(json.dumps(tokenizer.save(str(staging))))
        staging.rename(saved.parent)
    return tokenizer


def build(config: ml_collections.ConfigDict, workdir: str) -> Run:
    """Validated config, objective, tokenizer, model, compiled trainer and checkpointer for a workdir."""
    config = config_lib.validate(config)
    workdir_path = pathlib.Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    mesh = sharding.make_mesh(tuple(config.sharding.mesh_shape))
    rules = sharding.axis_rules(tuple(tuple(r) for r in config.sharding.rules))
    objective = objectives.get(config.objective.name)
    splits: dict[str, Any] = {}
    tokenizer = _tokenizer(config, splits, objective, workdir_path)
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); set --config.model.vocab_size={tokenizer.vocab_size} (or larger)"
        )
    model = objective.model(config)
    compiled = trainer_lib.compile_trainer(objective.trainer(config, model), mesh=mesh, rules=rules, seed=config.train.seed)
    checkpointer = checkpoint.Checkpointer(
        str(workdir_path / "checkpoints"), max_to_keep=config.train.keep_checkpoints, async_save=config.train.async_checkpoints
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


class PreemptionWatch:
    """True once the run should checkpoint and stop: SIGTERM (single process), or JAX's
    multi-host preemption sync point, which every process reaches at the same step."""

    def __init__(self):
        self.signalled = False
        self.multi_host = jax.process_count() > 1
        if not self.multi_host and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.signalled = True

    def __call__(self, step: int) -> bool:
        if self.multi_host:
            return checkpoint.reached_preemption(step)
        return self.signalled

    def close(self):
        if hasattr(self, "previous"):
            signal.signal(signal.SIGTERM, self.previous)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float] | None:
    """Trains to `config.train.steps`; returns the final validation metrics (None if preempted)."""
    from lmzoo.evaluation.generation import sample_text

    run = build(config, workdir)
    config = run.config
    is_main = jax.process_index() == 0
    if is_main:
        (run.workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    state, data_state = restore_or_init(run)
    loader = run.train_loader()
    compiled = run.compiled
    writer = metrics_lib.MetricWriter(workdir, enabled=is_main)
    preempted = PreemptionWatch()
    start = int(data_state["step"])
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
                state, step_metrics = compiled.step(state, sharding.put_batch(host_batch, compiled.batch_sharding))
            total = metrics_lib.accumulate(total, step_metrics)
            done = step + 1
            at_log = done % config.train.log_every == 0 or done == config.train.steps
            at_ckpt = done % config.train.checkpoint_every == 0 or done == config.train.steps
            stop = preempted(done)
            if at_log or at_ckpt or stop:
                summary = metrics_lib.summarize(total)
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
                run.checkpointer.save(done, state.replace(frozen={}), {"step": done}, force=stop)
                last_good = done
            if done % config.train.eval_every == 0 or done == config.train.steps:
                final = evaluate(run, state)
                writer.write(done, final, "validation")
                progress.write(f"step {done}: validation loss {final['loss']:.4f} ppl {final['perplexity']:.2f}")
            progress.update(1)
            if stop:
                run.checkpointer.wait()
                progress.write(f"preempted: saved checkpoint {done} in {run.checkpointer.directory}; rerun the same command to resume")
                return None
        progress.close()
        run.checkpointer.wait()
        if final is None:
            final = evaluate(run, state)
        params = host_params(run, state) if config.train.sample_tokens > 0 else None
        if is_main and params is not None:
            text = sample_text(run, params, config.train.sample_prompt, max_new_tokens=config.train.sample_tokens,
                                          temperature=0.8, top_k=0, top_p=0.95, seed=config.train.seed, fit_to_model=True)  # fmt: skip
            (run.workdir / "sample.txt").write_text(config.train.sample_prompt + text)
            print(f"--- sample (step {int(state.step)}) ---\n{config.train.sample_prompt}{text}\n---")
        return final
    finally:
        run.checkpointer.wait()
        preempted.close()
        writer.close()
        run.checkpointer.close()
