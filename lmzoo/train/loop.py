"""`train_and_evaluate(config, workdir)`: data -> sharded jitted steps -> metrics -> checkpoints -> sample.

A run restarted with the same workdir restores the latest good checkpoint (params, optimizer
state, step, rng, loader position) and continues exactly where it stopped.
"""

import dataclasses
import json
import logging
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax
from flax import traverse_util
from tqdm import tqdm

from lmzoo import checkpoint, decoding, sharding, tokenizers
from lmzoo import config as config_lib
from lmzoo.data import pipeline
from lmzoo.models import bert, gpt2, seq2seq
from lmzoo.train import metrics as metrics_lib
from lmzoo.train import optim, tasks
from lmzoo.train import step as step_lib
from lmzoo.train.state import Task, TrainState

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    pass


@dataclasses.dataclass
class Setup:
    """What both training and evaluation build from a config and a workdir."""

    config: ml_collections.ConfigDict
    tokenizer: tokenizers.Tokenizer
    loader: Any
    eval_batches: Callable[[str], Any]
    model: nn.Module
    task: Task
    compiled: step_lib.CompiledTask
    checkpointer: checkpoint.Checkpointer
    tx: optax.GradientTransformation

    @property
    def abstract_state(self) -> TrainState:
        return self.compiled.abstract_state

    def context(self):
        """Mesh and rules context under which every jitted function of the run is traced and called."""
        return self.compiled.context()


def _tokenizer(config: ml_collections.ConfigDict, documents: dict[str, list[str]], workdir: pathlib.Path) -> tokenizers.Tokenizer:
    """The run's tokenizer: reloaded from the workdir when it exists so a resumed run keeps its ids."""
    saved = workdir / "tokenizer" / "spec.json"
    if saved.exists():
        return tokenizers.from_spec(json.loads(saved.read_text()), str(saved.parent))
    spec = config.data.tokenizer.to_dict()
    kind = spec.pop("kind")
    corpus = documents["train"] + documents["validation"] if kind in ("char", "sentencepiece") and not spec.get("path") else None
    tokenizer = tokenizers.build_tokenizer(kind, corpus=corpus, **spec)
    if jax.process_index() == 0:
        staging = workdir / "tokenizer.tmp"
        staging.mkdir(parents=True, exist_ok=True)
        (staging / "spec.json").write_text(json.dumps(tokenizer.save(str(staging))))
        staging.rename(saved.parent)
    return tokenizer


def build(config: ml_collections.ConfigDict, workdir: str) -> Setup:
    """Tokenizer, data loaders, model, task, abstract sharded state and checkpointer for a config."""
    workdir_path = pathlib.Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    mesh = sharding.make_mesh(tuple(config.sharding.mesh_shape))
    rules = sharding.axis_rules(tuple(tuple(r) for r in config.sharding.rules))
    documents = pipeline.load_documents(config.data)
    tokenizer = _tokenizer(config, documents, workdir_path)
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); set --config.model.vocab_size={tokenizer.vocab_size} (or larger)"
        )
    max_len, offset = config.model.get("max_len"), config.model.get("position_offset", 0)
    lengths = {"seq_len": config.data.seq_len}
    if config.objective.name == "text_to_text":
        lengths["target_seq_len"] = config.data.target_seq_len
    for name, length in lengths.items():
        if max_len is not None and length + offset > max_len:
            raise ValueError(
                f"config.data.{name}={length} (+ position_offset {offset}) is longer than the model's "
                f"positions (config.model.max_len={max_len}); shorten {name} or raise max_len"
            )
    loader, eval_batches = pipeline.make_loaders(config, documents, tokenizer, jax.process_index(), jax.process_count())
    local = loader.batch(0)
    sample_batch = {k: np.zeros((config.train.batch_size,) + v.shape[1:], v.dtype) for k, v in local.items()}
    model = tasks.build_model(config)
    task = tasks.build_task(config, model)
    tx, schedule = optim.make_optimizer(config.optim)
    compiled = step_lib.compile_task(
        task, tx, schedule, sample_batch, mesh=mesh, rules=rules, seed=config.train.seed,
        grad_accum_steps=config.train.grad_accum_steps,
    )  # fmt: skip
    checkpointer = checkpoint.Checkpointer(
        str(workdir_path / "checkpoints"), max_to_keep=config.train.keep_checkpoints, async_save=config.train.async_checkpoints
    )
    return Setup(
        config=config, tokenizer=tokenizer, loader=loader, eval_batches=eval_batches, model=model, task=task,
        compiled=compiled, checkpointer=checkpointer, tx=tx,
    )  # fmt: skip


def restore_or_init(setup: Setup) -> tuple[TrainState, dict]:
    """The latest good checkpoint, or a fresh state: weights from config.init_from, and for
    distillation the teacher from config.objective.teacher (the student from its every other layer)."""
    restored = setup.checkpointer.restore_latest(setup.abstract_state)
    if restored is not None:
        step, state, data_state = restored
        if jax.process_index() == 0:
            print(f"resumed from {setup.checkpointer.directory / str(step)}")
        return state, data_state
    cfg = setup.config
    with setup.context():
        state = setup.compiled.init(jax.random.key(cfg.train.seed))
    params = jax.device_get(state.params)
    if cfg.objective.name == "distill":
        teacher = merge_pretrained(jax.device_get(state.frozen["teacher"]), cfg.objective.teacher, cfg.model_name)
        state = state.replace(frozen=jax.device_put({"teacher": teacher}, setup.compiled.state_shardings.frozen))
        if cfg.objective.init_student_from_teacher:
            student = bert.distilbert_student_params(teacher, cfg.objective.teacher_model.num_layers)
            params = merge_pretrained(params, student, cfg.model_name, name="teacher layers")
    if cfg.get("init_from"):
        params = merge_pretrained(params, cfg.init_from, cfg.model_name)
    if cfg.get("init_from") or cfg.objective.name == "distill":
        state = state.replace(params=jax.device_put(params, setup.compiled.state_shardings.params))
        state = state.replace(opt_state=jax.jit(setup.tx.init, out_shardings=setup.compiled.state_shardings.opt_state)(state.params))
    return state, {"step": 0}


def read_params(spec: str, model_name: str, target):
    """Params from "hf:PATH" (HuggingFace safetensors folder) or "ckpt:WORKDIR" (another lmzoo run's
    latest checkpoint; a classifier run gives its backbone)."""
    if spec.startswith("hf:"):
        from lmzoo.convert import hf

        return hf.convert_pretrained(spec, model_name, target)
    if spec.startswith("ckpt:"):
        workdir = spec.removeprefix("ckpt:")
        other = build(config_lib.load_saved(workdir), workdir)
        restored = other.checkpointer.restore_latest(other.abstract_state)
        other.checkpointer.close()
        if restored is None:
            raise FileNotFoundError(f"{spec!r}: no checkpoint in {other.checkpointer.directory}")
        source = jax.device_get(restored[1].params)
        return source.get("backbone", source)
    raise ValueError(f"pretrained weights spec {spec!r} must be 'hf:PATH' or 'ckpt:WORKDIR'")


def merge_pretrained(fresh, source, model_name: str, *, name: str | None = None):
    """`fresh` params with every parameter `source` (params, or a read_params spec) provides replaced.

    A classifier takes the weights into its backbone and keeps its new head; pretraining heads the
    target lacks are dropped. A shape mismatch is an error.
    """
    name = name or str(source)
    target = fresh["backbone"] if "backbone" in fresh else fresh
    if isinstance(source, str):
        source = read_params(source, model_name, target)
    flat_target, flat_source = traverse_util.flatten_dict(target, sep="/"), traverse_util.flatten_dict(source, sep="/")
    mismatched = [f"{k}: {flat_source[k].shape} vs model {v.shape}" for k, v in flat_target.items()
                  if k in flat_source and flat_source[k].shape != v.shape]  # fmt: skip
    if mismatched:
        raise ValueError(f"weights from {name} do not fit the configured model:\n  " + "\n  ".join(mismatched))
    loaded = {k: np.asarray(flat_source[k], dtype=v.dtype) if k in flat_source else v for k, v in flat_target.items()}
    fresh_keys = sorted(set(flat_target) - set(flat_source))
    if jax.process_index() == 0:
        print(f"{name}: loaded {len(flat_target) - len(fresh_keys)} parameters; newly initialised: {fresh_keys or 'none'}")
    merged = traverse_util.unflatten_dict(loaded, sep="/")
    return {**fresh, "backbone": merged} if "backbone" in fresh else merged


def evaluate(setup: Setup, state: TrainState, split: str = "validation", max_batches: int | None = None) -> dict[str, float]:
    """Metrics over a whole split (each target once); token-level objectives add perplexity, bits per
    token and per character."""
    char_lengths = setup.tokenizer.token_char_lengths()
    total, num_chars = None, 0.0
    for i, batch in enumerate(setup.eval_batches(split)):
        if max_batches is not None and i >= max_batches:
            break
        if "targets" in batch:
            num_chars += float(np.sum(char_lengths[batch["targets"]] * batch["weights"]))
        with setup.context():
            total = metrics_lib.accumulate(total, setup.compiled.eval_step(state, sharding.put_batch(batch, setup.compiled.batch_sharding)))
    if total is None:
        raise ValueError(f"the {split} split produced no evaluation batches; check config.data and config.eval")
    summary = metrics_lib.summarize(total)
    summary["examples" if "targets" not in batch else "tokens"] = float(jax.device_get(total["loss"][1]))
    if "targets" in batch:
        num_chars = float(np.sum(jax.device_get(_allsum(num_chars))))
        summary["bits_per_char"] = float(jax.device_get(total["loss"][0])) / np.log(2) / max(num_chars, 1.0)
    return summary


def _allsum(value: float):
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return np.sum(multihost_utils.process_allgather(np.asarray(value)))


def host_params(setup: Setup, state: TrainState):
    """Params as host numpy arrays; every process must call this (it gathers across hosts)."""
    with setup.context():
        gathered = jax.jit(lambda p: p, out_shardings=sharding.replicated(setup.compiled.mesh))(state.params)
    return jax.device_get(gathered)


def sample_text(setup: Setup, params, prompt: str, *, max_new_tokens: int, temperature: float,
                top_k: int, top_p: float, seed: int) -> str:  # fmt: skip
    """Decodes a continuation of `prompt` with the KV cache; params from `host_params`.

    Encoder-decoders read the prompt (plus EOS) with the encoder and write a new sequence."""
    tokenizer, model = setup.tokenizer, setup.model
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id or 0)
    if isinstance(model, seq2seq.Seq2Seq):
        inputs = np.asarray([tokenizer.encode(prompt) + [tokenizer.eos_id]])
        new = decoding.generate_seq2seq(model, params, inputs, rng=jax.random.key(seed), max_new_tokens=max_new_tokens, **sampling)
    elif isinstance(model, gpt2.GPT2):
        ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
        max_new_tokens = min(max_new_tokens, model.config.max_len - len(ids))
        if max_new_tokens <= 0:
            raise ValueError(f"the prompt is {len(ids)} tokens, the model's max_len is {model.config.max_len}; shorten the prompt")
        new = decoding.generate(model, params, np.asarray([ids]), rng=jax.random.key(seed), max_new_tokens=max_new_tokens, **sampling)
    else:
        raise ValueError(f"{type(model).__name__} is not generative; --generate needs a decoder (gpt2) or an encoder-decoder (seq2seq)")
    out = [int(t) for t in np.asarray(new[0])]
    if tokenizer.eos_id in out:
        out = out[: out.index(tokenizer.eos_id)]
    return tokenizer.decode(out)


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
    setup = build(config, workdir)
    is_main = jax.process_index() == 0
    if is_main:
        (pathlib.Path(workdir) / "config.json").write_text(config.to_json_best_effort(indent=2))
    state, data_state = restore_or_init(setup)
    loader = setup.loader
    train_step = setup.compiled.train_step
    writer = metrics_lib.MetricWriter(workdir, enabled=is_main)
    preempted = PreemptionWatch()
    start = int(data_state["step"])
    last_good = start
    total, window_start, window_step = None, time.time(), start
    tokens_per_step = config.train.batch_size * config.data.seq_len
    progress = tqdm(
        total=config.train.steps, initial=start, disable=not is_main, desc="train",
        mininterval=0.5 if sys.stderr.isatty() else 30.0,
    )  # fmt: skip
    final = None
    try:
        for step in range(start, config.train.steps):
            batch = sharding.put_batch(loader.batch(step), setup.compiled.batch_sharding)
            with setup.context():
                state, step_metrics = train_step(state, batch)
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
                summary["tokens_per_sec"] = tokens_per_step * (done - window_step) / max(time.time() - window_start, 1e-9)
                writer.write(done, summary, "train")
                progress.set_postfix(loss=f"{summary['loss']:.4f}", lr=f"{summary['learning_rate']:.2e}")
                total, window_start, window_step = None, time.time(), done
            if done % config.train.eval_every == 0 or done == config.train.steps:
                final = evaluate(setup, state, max_batches=config.eval.max_batches)
                writer.write(done, final, "validation")
                progress.write(f"step {done}: validation loss {final['loss']:.4f} ppl {final['perplexity']:.2f}")
            if at_ckpt or stop:
                setup.checkpointer.save(done, state, {"step": done}, force=stop)
                last_good = done
            progress.update(1)
            if stop:
                setup.checkpointer.wait()
                progress.write(f"preempted: saved checkpoint {done} in {setup.checkpointer.directory}; rerun the same command to resume")
                return None
        progress.close()
        setup.checkpointer.wait()
        if final is None:
            final = evaluate(setup, state, max_batches=config.eval.max_batches)
        params = host_params(setup, state) if config.train.sample_tokens > 0 else None
        if is_main and params is not None:
            text = sample_text(setup, params, config.train.sample_prompt, max_new_tokens=config.train.sample_tokens,
                               temperature=0.8, top_k=0, top_p=0.95, seed=config.train.seed)  # fmt: skip
            (pathlib.Path(workdir) / "sample.txt").write_text(config.train.sample_prompt + text)
            print(f"--- sample (step {int(state.step)}) ---\n{config.train.sample_prompt}{text}\n---")
        return final
    finally:
        setup.checkpointer.wait()
        preempted.close()
        writer.close()
        setup.checkpointer.close()
