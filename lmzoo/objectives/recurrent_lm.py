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

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lmzoo.data import readers
from lmzoo.data.loaders import StreamLoader, stream_eval_batches
from lmzoo.objectives import base, losses
from lmzoo.trainers import supervised
from lmzoo.trainers.state import Task


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


class RecurrentLM(base.Objective):
    """An LSTM LM trained by truncated BPTT over contiguous row streams with SGD (config.optim.name "sgd")."""

    name = "recurrent_lm"
    lora_base = None  # its SGD trainer of truncated BPTT trains every weight
    Config = RecurrentLMConfig
    evaluators = ("loss", "recurrent_samples")
    reader = readers.TEXT_FILES

    def check(self):
        super().check()
        if self.config.optim.name != "sgd":
            raise ValueError(
                f"objective 'recurrent_lm' trains with SGD: set config.optim.name='sgd' (got {self.config.optim.name!r})"
            )

    def task(self, model):
        return recurrent_lm_task(model, sum_over_time=self.fields.sum_over_time)

    def trainer(self, model):
        fields = self.fields
        schedule = epoch_decay_schedule(
            self.config.optim.learning_rate, fields.epoch_steps, fields.decay_start_epoch, fields.lr_decay
        )
        clip = (
            optax.clip_by_global_norm(self.config.optim.grad_clip)
            if self.config.optim.grad_clip > 0
            else optax.identity()
        )
        tx = optax.chain(clip, optax.sgd(schedule))
        return supervised.SupervisedTrainer(
            self.task(model), tx, schedule, self.input_shapes(self.config.train.batch_size)
        )

    def train_loader(self, tokenizer, raw, shard):
        loader = StreamLoader(
            readers.text_file_tokens(raw, tokenizer, self.config.model.vocab_size, "train split"),
            self.config.train.batch_size,
            self.config.data.seq_len,
            **dataclasses.asdict(shard),
        )
        epoch_steps = self.fields.epoch_steps
        if epoch_steps and epoch_steps != loader.windows_per_epoch:
            raise ValueError(
                f"config.objective.epoch_steps={epoch_steps}, but an epoch of this data is "
                f"{loader.windows_per_epoch} steps; set --config.objective.epoch_steps={loader.windows_per_epoch}"
            )
        return loader

    def eval_batches(self, tokenizer, raw, shard):
        tokens = readers.text_file_tokens(raw, tokenizer, self.config.model.vocab_size, "evaluation split")
        return stream_eval_batches(tokens, self.config.eval.batch_size, self.config.data.seq_len, shard)
