"""Loss maths shared by the objectives: weighted cross-entropy over tokens or labels, top-1 accuracy, the
fused LM head + cross-entropy (`fused_head_loss`) that never stores the [B, T, V] logits. (The auxiliary losses of
mixture-of-experts layers: `lmzoo.models.experts`.)

Every loss returns its scalar mean with metrics as (sum, count) pairs, so metrics average exactly
over microbatches, steps and hosts.
"""

import functools

import jax
import jax.numpy as jnp

from lmzoo import kernels
from lmzoo.layers import linears

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


def weighted_loss(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, prefix: str = ""
) -> tuple[jax.Array, Metrics]:
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


SymbolicZero = jax.custom_derivatives.SymbolicZero


def _chunks(x: jax.Array, chunk_len: int) -> jax.Array:
    """[B, T, ...] -> [T // chunk_len, B, chunk_len, ...]."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape((b, t // chunk_len, chunk_len) + x.shape[2:]), 1, 0)


def _unchunk(x: jax.Array) -> jax.Array:
    """[T // c, B, c, ...] -> [B, T, ...]."""
    n, b, c = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape((b, n * c) + x.shape[3:])


def _chunk_logits(hidden_chunk: jax.Array, embedding: jax.Array) -> jax.Array:
    return linears.project("BCD,VD->BCV", hidden_chunk, embedding, preferred_element_type=jnp.float32)


def _logits_grad(logits: jax.Array, log_z: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """d(sum of weighted token losses)/d logits [B, C, V]: (softmax(logits) - one_hot(targets)) * weights."""
    probs = jnp.exp(logits - log_z[..., None])
    return (probs - jax.nn.one_hot(targets, logits.shape[-1], dtype=probs.dtype)) * weights[..., None]


def _head_loss_and_grads(
    hidden, embedding, targets, weights, chunk_len, with_hidden_grad: bool, with_embedding_grad: bool
):
    """Summed weighted loss and correct count over `chunk_len`-position chunks, and, when asked, their loss
    sum's gradients: hidden [B, T, D] (in hidden's dtype) and embedding [V, D] (float32), else None. The logits are
    computed in hidden's dtype with float32 accumulation, as `Embed.attend` computes them (bf16 compute with float32
    parameters: the head's matmuls run on the bf16 units)."""
    compute_embedding = embedding.astype(hidden.dtype)

    def chunk(embedding_grad_sum, xs):
        h, h_t, t, w = xs
        logits = _chunk_logits(h, compute_embedding)
        loss_sum, _ = cross_entropy(logits, t, w)
        correct = jnp.sum(top1_correct(logits, t) * w)
        chunk_hidden_grad = None
        if with_hidden_grad or with_embedding_grad:  # the logsumexp is cross_entropy's: XLA computes it once
            logits_grad = _logits_grad(logits, jax.nn.logsumexp(logits, axis=-1), t, w).astype(hidden.dtype)
            if with_hidden_grad:
                chunk_hidden_grad = linears.project("BCV,VD->BCD", logits_grad, compute_embedding)
            if with_embedding_grad:
                flat_logits_grad = logits_grad.reshape(-1, logits_grad.shape[-1])
                embedding_grad_sum += jnp.matmul(h_t, flat_logits_grad, preferred_element_type=jnp.float32)
        return embedding_grad_sum, (loss_sum, correct, chunk_hidden_grad)

    hidden_chunks = _chunks(hidden, chunk_len)  # [T // C, B, C, D]
    n, b, c, d = hidden_chunks.shape
    hidden_t = jnp.swapaxes(hidden_chunks.reshape(n, b * c, d), 1, 2) if with_embedding_grad else None
    xs = (hidden_chunks, hidden_t, _chunks(targets, chunk_len), _chunks(weights, chunk_len))
    init = jnp.zeros(embedding.shape[::-1], jnp.float32) if with_embedding_grad else None  # [D, V]: hidden^T @ grad
    embedding_grad_sum, (loss_sums, correct_sums, hidden_grads) = jax.lax.scan(chunk, init, xs)
    hidden_grads = None if hidden_grads is None else _unchunk(hidden_grads)
    embedding_grad_sum = None if embedding_grad_sum is None else embedding_grad_sum.T
    return jnp.sum(loss_sums), jnp.sum(correct_sums), hidden_grads, embedding_grad_sum


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_head_loss(hidden, embedding, targets, weights, chunk_len, grad_dtypes):
    """grad_dtypes: (hidden's, embedding's) dtype, which the backward pass gives their gradients."""
    return _head_loss_and_grads(hidden, embedding, targets, weights, chunk_len, False, False)[:2]


def _fused_head_loss_fwd(hidden, embedding, targets, weights, chunk_len, grad_dtypes):
    """Computes the gradients with the loss, chunk by chunk, while each chunk's logits are at hand: the backward
    pass only scales them by the cotangent. Nothing of size [B, T, V] is kept or recomputed, and the gradient of
    an input that is not differentiated (`perturbed` False, e.g. a frozen embedding) is not computed."""
    total, correct, hidden_grad, embedding_grad = _head_loss_and_grads(
        hidden.value, embedding.value, targets.value, weights.value, chunk_len, hidden.perturbed, embedding.perturbed
    )
    return (total, correct), (hidden_grad, embedding_grad)


def _fused_head_loss_bwd(chunk_len, grad_dtypes, residuals, cotangents):
    loss_cotangent = cotangents[0]  # the accuracy count has no gradient
    if type(loss_cotangent) is SymbolicZero:
        return None, None, None, None
    hidden_grad, embedding_grad = (
        None if grad is None else (grad * loss_cotangent).astype(dtype)
        for grad, dtype in zip(residuals, grad_dtypes, strict=True)
    )
    return hidden_grad, embedding_grad, None, None


_fused_head_loss.defvjp(_fused_head_loss_fwd, _fused_head_loss_bwd, symbolic_zeros=True)


def head_loss_chunk_len(batch: int, length: int, vocab: int, budget_bytes: int | None = None) -> int:
    """Largest divisor of `length` whose float32 logits chunk [batch, chunk, vocab] fits `budget_bytes` (default: the
    platform's, `kernels.head_chunk_bytes`)."""
    budget_bytes = kernels.head_chunk_bytes() if budget_bytes is None else budget_bytes
    fitting = [c for c in range(1, length + 1) if length % c == 0 and batch * c * vocab * 4 <= budget_bytes]
    return max(fitting, default=1)


def fused_head_loss(
    hidden: jax.Array,
    embedding: jax.Array,
    batch: dict[str, jax.Array],
    *,
    chunk_len: int | None = None,
) -> tuple[jax.Array, Metrics]:
    """`loss(hidden @ embedding.T, batch)` without materialising the [B, T, V] logits.

    hidden [B, T, D] final hidden states, embedding [V, D] the output projection (the tied token
    table). Logits are computed `chunk_len` positions at a time (default: `head_loss_chunk_len`). Under
    differentiation the gradients are computed in the same pass, from each chunk's logits while they are at
    hand (3 matmuls a chunk, as few as a backward pass can take), and the backward pass scales them.
    """
    b, t, _ = hidden.shape
    vocab = embedding.shape[0]
    chunk_len = chunk_len or head_loss_chunk_len(b, t, vocab)
    if t % chunk_len:
        raise ValueError(f"chunk_len {chunk_len} must divide the sequence length {t}")
    weights = batch["weights"].astype(jnp.float32)
    total, correct = _fused_head_loss(
        hidden, embedding, batch["targets"], weights, chunk_len, (hidden.dtype, embedding.dtype)
    )
    count = jnp.sum(weights)
    return total / jnp.maximum(count, 1.0), {"loss": (total, count), "accuracy": (correct, count)}
