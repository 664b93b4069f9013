"""The explicit attention form: scores and probabilities materialised, heads before positions.

`jax.nn.dot_product_attention` computes the same function, but neither of its forms exposes the probabilities that
attention dropout needs, and XLA:CPU runs this form faster (docs/notes/cpu-speed.md). `lmzoo.kernels.attention_form`
chooses it: on the CPU, and on every platform when attention dropout is on.
"""

import jax
import jax.numpy as jnp

CAUSAL_SPLIT_MIN_LEN = 128  # causal self-attention this long is computed in query blocks, skipping masked scores
CAUSAL_BLOCK_MIN = 64  # positions a query block holds at least ...
CAUSAL_BLOCKS_MAX = 8  # ... and blocks at most (so a block grows past 64 positions beyond 512)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mask: jax.Array | None,
    bias: jax.Array | None,
    is_causal: bool,
    scale: float | None,
    dropout_rate: float,
    dropout_rng: jax.Array | None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [B, T, N, H], k/v [B, S, K, H] (K divides N) -> [B, T, N, H], computed explicitly with the heads before the
    positions: the scores and probabilities [B, N, T, S] are materialised.

    The form for the CPU, and wherever attention dropout needs the probabilities. XLA:CPU lowers the
    [B, T, N, H] einsums with transposes inside fusions; this form's forward+backward measured ~1.9x faster at
    B 12, T 64, N 4, H 32. Causal self-attention of CAUSAL_SPLIT_MIN_LEN positions or more (with or without a mask
    [B, 1, T, S], e.g. padding) is computed in blocks of consecutive queries (`causal_blocks`), each against the keys
    up to its last query only: of the scores above the diagonal, all masked, only the blocks' own corners are
    computed (T 256: 62.5% of the scores, in 4 blocks).

    sinks [N]: a logit per query head joined to each row's softmax as one more column, whose probability is then
    dropped (gpt-oss's attention sinks: a row's probabilities sum to less than 1).
    """
    groups = query.shape[2] // key.shape[2]
    if groups > 1:  # grouped-query attention: query head n reads kv head n // groups
        key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
    use_dropout = dropout_rng is not None and dropout_rate > 0.0
    length = query.shape[1]
    causal_self = is_causal and bias is None and not use_dropout and length == key.shape[1]
    if causal_self and length >= CAUSAL_SPLIT_MIN_LEN:
        parts = []
        for queries in causal_blocks(length):
            keys = slice(0, queries.stop)  # a block's queries see no key past its last
            rows = mask if mask is None or mask.shape[-2] == 1 else mask[..., queries, :]
            block_mask = None if rows is None else rows[..., keys]
            block = (query[:, queries], key[:, keys], value[:, keys])
            parts.append(_materialised(*block, mask=block_mask, scale=scale, sinks=sinks, is_causal=True))
        return jnp.concatenate(parts, axis=1)
    return _materialised(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        sinks=sinks,
        is_causal=is_causal,
        bias=bias,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
    )


def _materialised(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mask: jax.Array | None,
    scale: float | None,
    sinks: jax.Array | None,
    is_causal: bool,
    bias: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """`dot_product_attention` in one piece: q [B, T, N, H], k/v [B, S, N, H] (heads already repeated); a causal
    mask lets query t see keys up to S - T + t (a block of the last T queries)."""
    use_dropout = dropout_rng is not None and dropout_rate > 0.0
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    query, key, value = (jnp.swapaxes(a, 1, 2) for a in (query, key, value))  # [B, N, T|S, H]
    logits = jnp.einsum("BNTH,BNSH->BNTS", query, key).astype(jnp.float32) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if is_causal:
        t, s = logits.shape[-2:]
        causal = jnp.tril(jnp.ones((t, s), bool), k=s - t)
        mask = causal if mask is None else mask & causal
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = probabilities(logits, None if sinks is None else sinks[None, :, None, None])  # [B, N, T, S]
    if use_dropout:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    return jnp.swapaxes(jnp.einsum("BNTS,BNSH->BNTH", probs.astype(value.dtype), value), 1, 2)  # [B, T, N, H]


def causal_blocks(length: int) -> list[slice]:
    """The query blocks of causal self-attention over `length` positions: CAUSAL_BLOCK_MIN positions each, or more
    where that makes over CAUSAL_BLOCKS_MAX blocks (the last may be shorter). Fewer, larger blocks computed more
    masked scores; more, smaller ones ran slower on XLA:CPU (each block's softmax and matmuls are ops of their own)."""
    size = max(CAUSAL_BLOCK_MIN, -(-length // CAUSAL_BLOCKS_MAX))
    return [slice(start, min(start + size, length)) for start in range(0, length, size)]


def probabilities(logits: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """Attention probabilities: the softmax of float32 logits [..., S] over keys. sinks (broadcastable to
    [..., 1]): a logit per row joined to its softmax as one more key whose probability is then dropped (gpt-oss's
    attention sinks: a row's probabilities sum to less than 1)."""
    if sinks is None:
        return jax.nn.softmax(logits, axis=-1)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32), (*logits.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
