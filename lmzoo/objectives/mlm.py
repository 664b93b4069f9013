"""Masked-LM loss and the sentence-level (NSP / SOP) classification loss."""

import jax
import jax.numpy as jnp

from lmzoo.objectives.causal_lm import Metrics, cross_entropy, top1_correct


def loss(logits: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, Metrics]:
    """logits [B, T, V]; batch["targets"], batch["weights"] [B, T] (1 at masked positions only)."""
    total, count = cross_entropy(logits, batch["targets"], batch["weights"])
    correct = jnp.sum(top1_correct(logits, batch["targets"]) * batch["weights"])
    return total / jnp.maximum(count, 1.0), {"loss": (total, count), "accuracy": (correct.astype(jnp.float32), count)}


def sentence_loss(logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """NSP / SOP cross-entropy. logits [B, 2], labels [B] int, weights [B] (None = all 1)."""
    weights = jnp.ones(labels.shape, jnp.float32) if weights is None else weights
    total, count = cross_entropy(logits, labels, weights)
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == labels) * weights).astype(jnp.float32)
    return total / jnp.maximum(count, 1.0), {"sentence_loss": (total, count), "sentence_accuracy": (correct, count)}
