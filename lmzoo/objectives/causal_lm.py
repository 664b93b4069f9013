"""Causal language modelling: next-token prediction for decoders, with the head and loss fused.

The fused head + cross-entropy (`fused_head_loss`) never stores the [B, T, V] logits; the recipe
(`CausalLM`) trains on packed windows of the run's documents.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lmzoo import layers
from lmzoo.data import pipeline
from lmzoo.objectives import base
from lmzoo.objectives.losses import Metrics, cross_entropy, top1_correct
from lmzoo.trainers.state import Task

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
    return layers.project("BCD,VD->BCV", hidden_chunk, embedding, preferred_element_type=jnp.float32)


def _logits_grad(logits: jax.Array, log_z: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """d(sum of weighted token losses)/d logits [B, C, V]: (softmax(logits) - one_hot(targets)) * weights."""
    probs = jnp.exp(logits - log_z[..., None])
    return (probs - jax.nn.one_hot(targets, logits.shape[-1], dtype=probs.dtype)) * weights[..., None]


def _head_loss_and_grads(
    hidden, embedding, targets, weights, chunk_len, with_hidden_grad: bool, with_embedding_grad: bool
):
    """Summed weighted loss and correct count over `chunk_len`-position chunks, and, when asked, their loss
    sum's gradients: hidden [B, T, D] (in hidden's dtype) and embedding [V, D] (float32), else None."""

    def chunk(embedding_grad_sum, xs):
        h, h_t, t, w = xs
        logits = _chunk_logits(h, embedding)
        loss_sum, _ = cross_entropy(logits, t, w)
        correct = jnp.sum(top1_correct(logits, t) * w)
        chunk_hidden_grad = None
        if with_hidden_grad or with_embedding_grad:  # the logsumexp is cross_entropy's: XLA computes it once
            logits_grad = _logits_grad(logits, jax.nn.logsumexp(logits, axis=-1), t, w).astype(hidden.dtype)
            if with_hidden_grad:
                chunk_hidden_grad = layers.project("BCV,VD->BCD", logits_grad, embedding.astype(hidden.dtype))
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
        None if grad is None else (grad * loss_cotangent).astype(dtype) for grad, dtype in zip(residuals, grad_dtypes)
    )
    return hidden_grad, embedding_grad, None, None


_fused_head_loss.defvjp(_fused_head_loss_fwd, _fused_head_loss_bwd, symbolic_zeros=True)


def head_loss_chunk_len(batch: int, length: int, vocab: int, budget_bytes: int = 8 << 20) -> int:
    """Largest divisor of `length` whose float32 logits chunk [batch, chunk, vocab] fits `budget_bytes`."""
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


def causal_lm_task(model) -> Task:
    """Next-token prediction for a decoder taking (tokens, positions, segment_ids) with `return_hidden` and
    `output_embedding` (GPT-2): the head and loss are fused so the [B, T, V] logits are never stored."""

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], positions=batch.get("positions"))["params"]
        return params, {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        _, hidden = model.apply(
            {"params": params}, batch["inputs"], positions=batch.get("positions"), segment_ids=batch.get("segment_ids"),
            deterministic=not train, return_hidden=True, rngs={"dropout": rng},
        )  # fmt: skip
        embedding = model.apply({"params": params}, method=model.output_embedding)
        value, metrics = fused_head_loss(hidden, embedding, batch)
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


class CausalLM(base.Objective):
    """Decoders on packed windows of the run's documents (nanoGPT's random windows or shuffled sequential ones)."""

    name = "causal_lm"

    def task(self, config, model):
        return causal_lm_task(model)

    def train_loader(self, config, tokenizer, raw, shard):
        stream = pipeline.token_stream(raw, tokenizer, config.model.vocab_size, "train split")
        return pipeline.LMLoader(stream, config.train.batch_size, config.data.seq_len, seed=config.train.seed,
                                 sampler=config.data.sampler, **dataclasses.asdict(shard))  # fmt: skip

    def eval_batches(self, config, tokenizer, raw, shard):
        stream = pipeline.token_stream(raw, tokenizer, config.model.vocab_size, "evaluation split")
        return pipeline.eval_batches(stream, config.eval.batch_size, config.data.seq_len, **dataclasses.asdict(shard))
