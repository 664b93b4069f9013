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
from lmzoo.train.state import Task


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_head_loss(hidden, embedding, targets, weights, chunk_len, save_logits_grad):
    return _fused_head_loss_fwd(hidden, embedding, targets, weights, chunk_len, False)[0]


def _fused_head_loss_fwd(hidden, embedding, targets, weights, chunk_len, save_logits_grad):
    def chunk_stats(_, xs):
        h, t, w = xs
        logits = _chunk_logits(h, embedding)
        loss_sum, _ = cross_entropy(logits, t, w)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        logits_grad = _logits_grad(logits, log_z, t, w).astype(hidden.dtype) if save_logits_grad else None
        return None, (loss_sum, jnp.sum(top1_correct(logits, t) * w), log_z, logits_grad)

    xs = (_chunks(hidden, chunk_len), _chunks(targets, chunk_len), _chunks(weights, chunk_len))
    _, (loss_sums, correct_sums, log_z, logits_grads) = jax.lax.scan(chunk_stats, None, xs)
    return (jnp.sum(loss_sums), jnp.sum(correct_sums)), (hidden, embedding, targets, weights, log_z, logits_grads)


def _fused_head_loss_bwd(chunk_len, save_logits_grad, residuals, cotangents):
    hidden, embedding, targets, weights, log_z, logits_grads = residuals
    loss_cotangent = cotangents[0]  # the accuracy count has no gradient

    def chunk_grads(embedding_grad, xs):
        h, t, w, z, logits_grad = xs
        if logits_grad is None:  # recomputed: the forward did not keep it
            logits_grad = _logits_grad(_chunk_logits(h, embedding), z, t, w).astype(hidden.dtype)
        hidden_grad = layers.project("BCV,VD->BCD", logits_grad, embedding.astype(hidden.dtype))
        # [V, B*C] @ [B*C, D]: one contracted axis, as in `layers.project`.
        flat_logits_grad, flat_hidden = logits_grad.reshape(-1, logits_grad.shape[-1]), h.reshape(-1, h.shape[-1])
        embedding_grad += jnp.matmul(flat_logits_grad.T, flat_hidden, preferred_element_type=jnp.float32)
        return embedding_grad, hidden_grad

    xs = (_chunks(hidden, chunk_len), _chunks(targets, chunk_len), _chunks(weights, chunk_len), log_z, logits_grads)
    embedding_grad, hidden_grads = jax.lax.scan(chunk_grads, jnp.zeros(embedding.shape, jnp.float32), xs)
    hidden_grad = (_unchunk(hidden_grads) * loss_cotangent).astype(hidden.dtype)
    return hidden_grad, (embedding_grad * loss_cotangent).astype(embedding.dtype), None, None


_fused_head_loss.defvjp(_fused_head_loss_fwd, _fused_head_loss_bwd)


SAVED_LOGITS_GRAD_BYTES = 256 << 20  # the logits' gradient is kept from the forward pass up to this size


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
    save_logits_grad: bool | None = None,
) -> tuple[jax.Array, Metrics]:
    """`loss(hidden @ embedding.T, batch)` without materialising the [B, T, V] logits.

    hidden [B, T, D] final hidden states, embedding [V, D] the output projection (the tied token
    table). Logits are computed `chunk_len` positions at a time (default: `head_loss_chunk_len`). Their
    gradient [B, T, V] is either kept from the forward pass (`save_logits_grad`; by default when it
    fits SAVED_LOGITS_GRAD_BYTES) or recomputed in the backward pass, which trades a third more head
    FLOPs for never writing it to memory.
    """
    b, t, _ = hidden.shape
    vocab = embedding.shape[0]
    chunk_len = chunk_len or head_loss_chunk_len(b, t, vocab)
    if t % chunk_len:
        raise ValueError(f"chunk_len {chunk_len} must divide the sequence length {t}")
    if save_logits_grad is None:
        save_logits_grad = b * t * vocab * jnp.dtype(hidden.dtype).itemsize <= SAVED_LOGITS_GRAD_BYTES
    weights = batch["weights"].astype(jnp.float32)
    total, correct = _fused_head_loss(hidden, embedding, batch["targets"], weights, chunk_len, save_logits_grad)
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
