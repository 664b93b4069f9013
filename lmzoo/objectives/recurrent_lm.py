"""Recurrent LM on word streams (Zaremba et al. 2014): truncated BPTT with the state carried across batches.

The training split is one token stream cut into `batch_size` contiguous rows; step k of an epoch reads
window k of every row, so the carry a step leaves behind is exactly the state the next window starts
from. The carry is zeroed at the first window of every epoch (batch["reset"]). Evaluation reads its
split the same way (eval.batch_size rows, padding weighted 0) with its own carry from zero, so every
target is scored once with its whole history in its row. The optimizer is SGD with gradient clipping
and the classic schedule: `learning_rate` for `decay_start_epoch` epochs, then times `lr_decay` each
epoch (an epoch is `epoch_steps` steps, checked against the data).

Data (`read`): config.data.train_path and config.data.validation_path, plain text with one sentence a
line (Mikolov's PTB files); `eval.py --data=FILE` scores another such file (the test split).
"""

import dataclasses
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lmzoo.data import transforms
from lmzoo.objectives import base, losses
from lmzoo.trainers import supervised
from lmzoo.trainers.state import Task


class TextFiles(base.Objective):
    """Language modelling on whole text files: train and validation are config.data.{train,validation}_path."""

    def check(self, config):
        super().check(config)
        for field in ("train_path", "validation_path"):
            path = config.data[field]
            if not path or not pathlib.Path(path).is_file():
                raise ValueError(f"config.data.{field}={path!r} is not a file; objective {self.name!r} reads "
                                 "one text file per split (e.g. ptb.train.txt and ptb.valid.txt)")  # fmt: skip

    def read(self, config):
        return {split: self.read_file(config, config.data[f"{split}_path"]) for split in ("train", "validation")}

    def read_file(self, config, path):
        return [pathlib.Path(path).read_text(encoding="utf-8")]

    def token_ids(self, config, tokenizer, raw, where: str) -> np.ndarray:
        """The split's files as one [N] int32 stream (a word tokenizer ends every line with <eos>)."""
        ids = np.concatenate([np.asarray(tokenizer.encode(text), dtype=np.int32) for text in raw])
        transforms.check_token_ids(ids, config.model.vocab_size, where=where)
        return ids


def stream_rows(tokens: np.ndarray, rows: int, *, pad: bool) -> tuple[np.ndarray, np.ndarray]:
    """[N] stream -> (ids [rows, R + 1], weights [rows, R]): row r continues where row r - 1 stops.

    pad=False drops the tail that does not fill every row (training, as Zaremba et al.); pad=True keeps
    every target (R = ceil((N - 1) / rows), padded targets weighted 0). Consecutive rows share one
    token, the last input of one being the first of the next.
    """
    targets = len(tokens) - 1
    length = -(-targets // rows) if pad else targets // rows
    if length < 1:
        raise ValueError(f"a stream of {len(tokens)} tokens is too short for {rows} rows")
    padded = np.concatenate([tokens, np.zeros(max(rows * length + 1 - len(tokens), 0), tokens.dtype)])
    starts = np.arange(rows)[:, None] * length
    ids = padded[starts + np.arange(length + 1)]
    weights = (starts + np.arange(length) < targets).astype(np.float32)
    return ids, weights


def window(ids: np.ndarray, weights: np.ndarray, index: int, seq_len: int) -> dict[str, np.ndarray]:
    """Window `index` of every row: inputs, targets, weights [B, T] (padded with weight 0), reset [B]."""
    start = index * seq_len
    pad = lambda x: np.pad(x, ((0, 0), (0, seq_len - x.shape[1])))  # noqa: E731
    inputs = pad(ids[:, start : start + seq_len])
    targets = pad(ids[:, start + 1 : start + seq_len + 1])
    w = pad(weights[:, start : start + seq_len])
    reset = np.full(ids.shape[0], float(index == 0), np.float32)
    return {"inputs": inputs, "targets": targets, "weights": w, "reset": reset}


@dataclasses.dataclass(frozen=True)
class StreamLoader:
    """Training batches: step s reads window s mod windows_per_epoch of every contiguous row.

    Each process holds its own rows of the global batch (rows stay whole streams)."""

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self):
        ids, weights = stream_rows(self.tokens, self.batch_size, pad=False)
        if self.batch_size % self.process_count:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by {self.process_count} processes")
        local = self.batch_size // self.process_count
        mine = slice(self.process_index * local, (self.process_index + 1) * local)
        object.__setattr__(self, "_ids", ids[mine])
        object.__setattr__(self, "_weights", weights[mine])

    @property
    def windows_per_epoch(self) -> int:
        """Whole windows of every row (Zaremba's epoch_size = (row_len - 1) // num_steps)."""
        return (self._ids.shape[1] - 1) // self.seq_len

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return window(self._ids, self._weights, step % self.windows_per_epoch, self.seq_len)


def stream_eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, shard: base.Shard):
    """Every target of a split once: consecutive windows of `batch_size` contiguous rows (this process's rows)."""
    ids, weights = stream_rows(tokens, batch_size, pad=True)
    local = batch_size // shard.process_count
    mine = slice(shard.process_index * local, (shard.process_index + 1) * local)
    for index in range(math.ceil(weights.shape[1] / seq_len)):
        yield window(ids[mine], weights[mine], index, seq_len)


def recurrent_lm_task(model: nn.Module, *, sum_over_time: bool) -> Task:
    """Next-token loss of a model called as `model(tokens, carry, deterministic=...) -> (logits, carry)`.

    The carry is zeroed on rows whose batch["reset"] is 1. With `sum_over_time`, the loss optimised is the
    per-token mean times the window length (Zaremba et al.: summed over time, averaged over rows)."""

    def init(rng, batch):
        carry = model.initial_carry(batch["inputs"].shape[0])
        return model.init({"params": rng, "dropout": rng}, batch["inputs"], carry)["params"], {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        keep = 1.0 - batch["reset"][:, None, None]
        carry = jax.tree.map(lambda c: c * keep, carry)
        logits, carry = model.apply(
            {"params": params}, batch["inputs"], carry, deterministic=not train, rngs={"dropout": rng}
        )
        value, metrics = losses.token_loss(logits, batch)
        if sum_over_time:
            value = value * batch["inputs"].shape[1]
        return value, (metrics, carry)

    def initial_carry(batch_size):
        return jax.tree.map(
            lambda x: nn.LogicallyPartitioned(x, ("act_batch", None, None)), model.initial_carry(batch_size)
        )

    return Task(init=init, loss=loss, initial_carry=initial_carry)


def epoch_decay_schedule(
    learning_rate: float, epoch_steps: int, decay_start_epoch: int, lr_decay: float
) -> optax.Schedule:
    """learning_rate through epoch `decay_start_epoch` (1-based), then times lr_decay each epoch; constant
    when epoch_steps is 0."""

    def schedule(step):
        if not epoch_steps:
            return jnp.asarray(learning_rate, jnp.float32)
        epoch = step // epoch_steps + 1
        return learning_rate * lr_decay ** jnp.maximum(epoch - decay_start_epoch, 0).astype(jnp.float32)

    return schedule


@dataclasses.dataclass(frozen=True)
class RecurrentLMConfig:
    epoch_steps: int = 0  # training windows per epoch (the loader checks it); 0 = no decay
    decay_start_epoch: int = 4  # the last epoch at the full learning rate
    lr_decay: float = 0.5
    sum_over_time: bool = True  # loss summed over the window, averaged over rows (Zaremba et al.)

    def __post_init__(self):
        if self.epoch_steps < 0 or self.decay_start_epoch < 0:
            raise ValueError("config.objective.epoch_steps and decay_start_epoch must be >= 0")
        if not 0.0 < self.lr_decay <= 1.0:
            raise ValueError(f"config.objective.lr_decay={self.lr_decay} must lie in (0, 1]")


class RecurrentLM(TextFiles):
    """An LSTM LM trained by truncated BPTT over contiguous row streams with SGD (config.optim.name "sgd")."""

    name = "recurrent_lm"
    Config = RecurrentLMConfig
    evaluators = ("loss", "recurrent_samples")

    def check(self, config):
        super().check(config)
        if config.optim.name != "sgd":
            raise ValueError(
                f"objective 'recurrent_lm' trains with SGD: set config.optim.name='sgd' (got {config.optim.name!r})"
            )

    def task(self, config, model):
        return recurrent_lm_task(model, sum_over_time=self.fields(config).sum_over_time)

    def trainer(self, config, model):
        fields = self.fields(config)
        schedule = epoch_decay_schedule(
            config.optim.learning_rate, fields.epoch_steps, fields.decay_start_epoch, fields.lr_decay
        )
        clip = optax.clip_by_global_norm(config.optim.grad_clip) if config.optim.grad_clip > 0 else optax.identity()
        tx = optax.chain(clip, optax.sgd(schedule))
        return supervised.SupervisedTrainer(
            self.task(config, model), tx, schedule, self.input_shapes(config, config.train.batch_size)
        )

    def train_loader(self, config, tokenizer, raw, shard):
        loader = StreamLoader(self.token_ids(config, tokenizer, raw, "train split"), config.train.batch_size,
                              config.data.seq_len, **dataclasses.asdict(shard))  # fmt: skip
        epoch_steps = self.fields(config).epoch_steps
        if epoch_steps and epoch_steps != loader.windows_per_epoch:
            raise ValueError(f"config.objective.epoch_steps={epoch_steps}, but an epoch of this data is "
                             f"{loader.windows_per_epoch} steps; set --config.objective.epoch_steps={loader.windows_per_epoch}")  # fmt: skip
        return loader

    def eval_batches(self, config, tokenizer, raw, shard):
        tokens = self.token_ids(config, tokenizer, raw, "evaluation split")
        return stream_eval_batches(tokens, config.eval.batch_size, config.data.seq_len, shard)
