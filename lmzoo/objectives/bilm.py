"""Bidirectional LM pretraining for ELMo (lmzoo.models.elmo): forward and backward next-token losses on sentences.

Rows are sentences of word-level text files framed by `<eos>` on both sides ("tokens" [B, S + 1]: `<eos>`, the
words, `<eos>`); the forward direction predicts tokens 1.. from their left context, the backward direction
tokens ..S - 1 from their right context. The loss is the mean of the two directions' per-token losses.
Training batches are shuffled sentences of similar length (`lmzoo.data.loaders.ShuffledSentences`), evaluation batches
the split sorted by length; each is cut to its longest sentence rounded up to `length_multiple`.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from lmzoo.data import readers
from lmzoo.data.loaders import SentenceLoader, ShuffledSentences, length_sorted_batches, sentence_rows
from lmzoo.objectives import base, losses
from lmzoo.trainers.state import Task


def framed(batch: dict[str, np.ndarray], eos_id: int) -> dict[str, np.ndarray]:
    """Sentence rows (targets, weights [B, S], each ending in eos) -> tokens, weights [B, S + 1] with a leading eos."""
    real = batch["weights"][:, :1]
    tokens = np.concatenate([np.where(real > 0, eos_id, 0).astype(batch["targets"].dtype), batch["targets"]], axis=1)
    return {"tokens": tokens, "weights": np.concatenate([real, batch["weights"]], axis=1)}


def bilm_task(model) -> Task:
    def init(rng, batch):
        return model.init({"params": rng, "dropout": rng}, batch["tokens"], batch["weights"])["params"], {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        tokens, weights = batch["tokens"], batch["weights"]
        forward_logits, backward_logits, _ = model.apply(
            {"params": params}, tokens, weights, deterministic=not train, rngs={"dropout": rng}
        )
        forward, count = losses.cross_entropy(forward_logits[:, :-1], tokens[:, 1:], weights[:, 1:])
        backward, _ = losses.cross_entropy(backward_logits[:, 1:], tokens[:, :-1], weights[:, 1:])
        metrics = {
            "loss": (forward + backward, 2 * count),
            "forward_loss": (forward, count),
            "backward_loss": (backward, count),
        }
        return (forward + backward) / jnp.maximum(2 * count, 1.0), (metrics, carry)

    return Task(init=init, loss=loss)


@dataclasses.dataclass(frozen=True)
class BiLMConfig:
    length_multiple: int = 16  # batches are padded to their longest sentence rounded up to this (0: to data.seq_len)
    length_pool: int = 64  # training batches are drawn from pools of this many batches sorted by length (1: no sorting)

    def __post_init__(self):
        if self.length_multiple < 0 or self.length_pool < 1:
            raise ValueError("config.objective needs length_multiple >= 0 and length_pool >= 1")


class BiLMObjective(base.Objective):
    """ELMo's biLM on word-level text files (model_name "elmo")."""

    name = "bilm"
    Config = BiLMConfig
    reader = readers.TEXT_FILES

    def task(self, model):
        return bilm_task(model)

    def step_summary(self):
        return base.sentence_step_summary(self.config, self.fields.length_multiple)

    def input_shapes(self, batch_size):
        shape = (batch_size, self.config.data.seq_len + 1)
        return {"tokens": base.int_inputs(shape), "weights": base.float_inputs(shape)}

    def _sentences(self, tokenizer, raw, batch_size: int, where: str, shard) -> SentenceLoader:
        ids, weights = sentence_rows(
            readers.text_file_tokens(raw, tokenizer, self.config.model.vocab_size, where),
            tokenizer.eos_id,
            self.config.data.seq_len,
        )
        return SentenceLoader(
            ids, weights, batch_size, **dataclasses.asdict(shard), length_multiple=self.fields.length_multiple
        )

    def train_loader(self, tokenizer, raw, shard):
        sentences = self._sentences(tokenizer, raw, self.config.train.batch_size, "train split", shard)
        return ShuffledSentences(
            sentences,
            self.config.train.seed,
            self.fields.length_pool,
            lambda batch, rng: framed(batch, tokenizer.eos_id),
        )

    def eval_batches(self, tokenizer, raw, shard):
        sentences = self._sentences(tokenizer, raw, self.config.eval.batch_size, "evaluation split", shard)
        return (framed(batch, tokenizer.eos_id) for batch in length_sorted_batches(sentences))

    def real_tokens(self, batch):
        return int(np.sum(batch["weights"]))
