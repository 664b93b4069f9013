"""Loss maths shared by the objectives: weighted cross-entropy over tokens or labels, top-1 accuracy.

Every loss returns its scalar mean with metrics as (sum, count) pairs, so metrics average exactly
over microbatches, steps and hosts.
"""

import jax
import jax.numpy as jnp

Metrics = dict[str, tuple[jax.Array, jax.Array]]


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weighted cross-entropy in float32.

    logits [..., V], targets [...] int, weights [...] -> (summed loss, summed weights) scalars.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    weights = weights.astype(jnp.float32)
    return jnp.sum((log_z - target_logit) * weights), jnp.sum(weights)


def top1_correct(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """[..., V], [...] -> float [...]: 1 where the target has the highest logit (ties count as correct).

    Comparing with the max instead of an argmax lets XLA share the reduction with logsumexp; a
    separate argmax over a large vocabulary cost ~8% of a GPT-2 train step on CPU."""
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)


def weighted_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array, prefix: str = "") -> tuple[jax.Array, Metrics]:
    """Mean cross-entropy and top-1 accuracy at weighted positions or examples.

    logits [..., V]; targets, weights [...]. Metrics `{prefix}loss` and `{prefix}accuracy`.
    """
    total, count = cross_entropy(logits, targets, weights)
    correct = jnp.sum(top1_correct(logits, targets) * weights.astype(jnp.float32))
    mean = total / jnp.maximum(count, 1.0)
    return mean, {f"{prefix}loss": (total, count), f"{prefix}accuracy": (correct, count)}


def token_loss(logits: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, Metrics]:
    """Next-token (or masked-token) loss: logits [B, T, V]; batch["targets"], batch["weights"] [B, T]."""
    return weighted_loss(logits, batch["targets"], batch["weights"])
