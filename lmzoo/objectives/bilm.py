"""Bidirectional LM pretraining for ELMo (lmzoo.models.elmo): forward and backward next-token losses on sentences.

Rows are sentences of word-level text files framed by `<eos>` on both sides ("tokens" [B, S + 1]: `<eos>`, the
words, `<eos>`); the forward direction predicts tokens 1.. from their left context, the backward direction
tokens ..S - 1 from their right context. The loss is the mean of the two directions' per-token losses.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from lmzoo.objectives import base, losses
from lmzoo.objectives.ngram_lm import SentenceLoader, sentence_rows
from lmzoo.objectives.recurrent_lm import TextFiles
from lmzoo.train.state import Task


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
class FramedSentences:
    """Sentence batches in file order (repeating every epoch), framed for the biLM."""

    sentences: SentenceLoader
    eos_id: int

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return framed(self.sentences.batch(step % self.sentences.num_batches), self.eos_id)


class BiLMObjective(TextFiles):
    """ELMo's biLM on word-level text files (model_name "elmo")."""

    name = "bilm"

    def task(self, config, model):
        return bilm_task(model)

    def input_shapes(self, config, batch_size):
        shape = (batch_size, config.data.seq_len + 1)
        return {"tokens": base.int_inputs(shape), "weights": base.float_inputs(shape)}

    def _loader(self, config, tokenizer, raw, shard, batch_size: int, where: str) -> FramedSentences:
        ids, weights = sentence_rows(
            self.token_ids(config, tokenizer, raw, where), tokenizer.eos_id, config.data.seq_len
        )
        return FramedSentences(SentenceLoader(ids, weights, batch_size, **dataclasses.asdict(shard)), tokenizer.eos_id)

    def train_loader(self, config, tokenizer, raw, shard):
        return self._loader(config, tokenizer, raw, shard, config.train.batch_size, "train split")

    def eval_batches(self, config, tokenizer, raw, shard):
        loader = self._loader(config, tokenizer, raw, shard, config.eval.batch_size, "evaluation split")
        return (loader.batch(step) for step in range(loader.sentences.num_batches))

    def real_tokens(self, batch):
        return int(np.sum(batch["weights"]))
