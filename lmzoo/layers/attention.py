"""Multi-head attention: masks, the attention function chosen by the platform seam, and `Attention`."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import kernels, sharding
from lmzoo.kernels import explicit, tpu
from lmzoo.layers.embeddings import Rotary
from lmzoo.layers.linears import Einsum, Initializer
from lmzoo.layers.norms import LayerNorm


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The fields of one multi-head attention, declared once: `Attention` and the blocks that build it take this.

    Attributes:
        num_heads: N.
        head_dim: H.
        num_kv_heads: K key/value heads (None: N); K < N is grouped-query attention (K = 1: multi-query), and the
            KV cache holds K heads. Their kernels' heads axis is "kv_heads", a sharding rule of its own.
        use_bias: biases on the q/k/v/out projections.
        qkv_bias: biases on q/k/v only (None: use_bias), e.g. Qwen2's q/k/v biases without an output bias.
        rotary: rotate queries and keys by their positions (Llama); None for families with other positions.
        qk_norm: RMS-normalise each head's queries and keys over H, each with a learned [H] scale ("query_norm",
            "key_norm"), after the projections and before the rotation (Qwen3).
        qk_norm_epsilon: the epsilon of those norms.
        sliding_window: each query attends to its last `sliding_window` positions (Mistral); None: all.
        scale: logit scale; None means H ** -0.5 (T5 uses 1.0).
        dropout_rate: dropout on the attention probabilities.
        sinks: a learned logit per query head ("sinks" [N]) joins each query's softmax denominator, its probability
            then dropped, so a query may give its keys less than 1 in all (gpt-oss's attention sinks).
        output_gate: each head's output times sigmoid of a projection of x ("gate" (D, N, H), biased as q/k/v are)
            before the output projection (Qwen3-Next and Qwen3.5's gated attention).
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    use_bias: bool = True
    qkv_bias: bool | None = None
    rotary: Rotary | None = None
    qk_norm: bool = False
    qk_norm_epsilon: float = 1e-6
    sliding_window: int | None = None
    scale: float | None = None
    dropout_rate: float = 0.0
    sinks: bool = False
    output_gate: bool = False

    def for_cross_attention(self) -> "AttentionConfig":
        """The same heads attending to a context: no grouped heads, rotation or window (encoder-decoder models)."""
        return dataclasses.replace(
            self, num_kv_heads=None, qkv_bias=None, rotary=None, sliding_window=None, sinks=False
        )


def sliding_window_mask(query_positions: jax.Array, key_positions: jax.Array, window: int | jax.Array) -> jax.Array:
    """[B, 1, T, S]: key within the last `window` positions of its query (itself included), as HF's Mistral.

    window: a positive int, or a traced scalar (a layer of a scanned stack whose layers differ) where 0 is no window.
    """
    within = key_positions[:, None, :] > query_positions[:, :, None] - window
    if isinstance(window, jax.Array):
        within = within | (window <= 0)
    return within[:, None]


def attention_mask(
    query_segment_ids: jax.Array | None,
    key_segment_ids: jax.Array | None,
    *,
    causal: bool,
    query_positions: jax.Array | None = None,
    key_positions: jax.Array | None = None,
) -> jax.Array | None:
    """Boolean mask [B, 1, T, S]: keys in the same non-zero segment (and not in the future if causal).

    Segment id 0 marks padding. A padding query attends to every non-padding key of its row, as HF's
    models do (they mask keys only), so its output is the same as theirs. Returns None when there is
    nothing to mask beyond a plain causal mask, which the attention kernel then applies without
    materialising it.
    """
    if query_segment_ids is None and key_segment_ids is None and query_positions is None:
        return None
    mask = None
    if query_segment_ids is not None:
        same_segment = (query_segment_ids[:, :, None] == key_segment_ids[:, None, :]) | (
            query_segment_ids[:, :, None] == 0
        )
        mask = same_segment & (key_segment_ids[:, None, :] != 0)
    elif key_segment_ids is not None:
        mask = jnp.broadcast_to(
            key_segment_ids[:, None, :] != 0, key_segment_ids.shape[:1] + (1,) + key_segment_ids.shape[1:]
        )
    if causal and query_positions is not None:
        future = key_positions[:, None, :] <= query_positions[:, :, None]
        mask = future if mask is None else mask & future
    return mask[:, None]


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
    segment_ids: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [B, T, N, H], k/v [B, S, K, H] (K divides N: grouped-query attention when K < N) -> [B, T, N, H].

    `jax.nn.dot_product_attention`, in the form `kernels.attention_form` chooses for the platform and the call:
    cuDNN's fused kernel on GPUs where it applies (JAX's default, `implementation=None`, is its XLA form, which
    materialises the [B, N, T, S] scores), XLA's form elsewhere, `kernels.explicit.dot_product_attention` where
    the probabilities are needed (attention dropout) or XLA:CPU is faster with it, and `kernels.tpu`'s splash
    attention on TPUs where it applies. segment_ids [B, T]: given only when `mask` is exactly
    `attention_mask(segment_ids, segment_ids, causal=False)`, for the splash form, which reads them instead of the
    mask (its rows of padding queries differ: `kernels.tpu.dot_product_attention`); every other form reads `mask`.
    sinks [N]: each query head's sink logit (`AttentionConfig.sinks`), which only the explicit form takes.
    """
    form = kernels.attention_form(
        query,
        key,
        mask=mask,
        bias=bias,
        dropout=dropout_rng is not None and dropout_rate > 0,
        segment_ids=segment_ids,
        sinks=sinks is not None,
    )
    if form == "splash":
        return tpu.dot_product_attention(query, key, value, segment_ids=segment_ids, causal=is_causal, scale=scale)
    if form == "explicit":
        return explicit.dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            is_causal=is_causal,
            scale=scale,
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
            sinks=sinks,
        )
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        scale=scale,
        is_causal=is_causal,
        implementation="cudnn" if form == "cudnn" else None,
    )


def cached_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mask: jax.Array | None,
    bias: jax.Array | None,
    scale: float | None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decoding's queries against the KV cache: q [B, T, N, H], cached keys [B, K, H, S] and values [B, K, S, H]
    (K divides N) -> [B, T, N, H]; mask [B | 1, 1, T, S] bool, bias [B | 1, N, T, S], sinks [N] as
    `dot_product_attention` takes them.

    The cache is head-major so that each (row, kv head) reads its keys and values where they lie (with [B, S, K, H]
    every step copied the whole cache before its few queries' dots), and its keys are stored transposed, [H, S], so
    that queries @ keys is a plain matmul: over [S, H] keys XLA's CPU dot transposed the whole cache every step. A kv
    head's G query heads and T queries are one [G * T, H] matrix, one batched matmul over (B, K) (a separate G axis
    ran ~4x slower). One einsum form on every platform (a step's few queries are not what the fused kernels are for);
    query head n reads kv head n // (N / K), as in `dot_product_attention`. No attention dropout: decoding is
    deterministic."""
    batch, length, heads, size = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = size**-0.5 if scale is None else scale
    grouped = query.reshape(batch, length, kv_heads, groups, size).transpose(0, 2, 3, 1, 4)
    grouped = grouped.reshape(batch, kv_heads, groups * length, size)  # [B, K, G * T, H]
    logits = jnp.einsum("BKQH,BKHS->BKQS", grouped, key).astype(jnp.float32) * scale
    logits = logits.reshape(batch, kv_heads, groups, length, key.shape[3])
    if bias is not None:
        logits = logits + bias.astype(jnp.float32).reshape(bias.shape[0], kv_heads, groups, *bias.shape[2:])
    if mask is not None:
        logits = jnp.where(mask[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = explicit.probabilities(logits, None if sinks is None else sinks.reshape(1, kv_heads, groups, 1, 1))
    probs = probs.reshape(batch, kv_heads, groups * length, probs.shape[-1]).astype(value.dtype)
    out = jnp.einsum("BKQS,BKSH->BKQH", probs, value).reshape(batch, kv_heads, groups, length, size)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, size)


class Attention(nn.Module):
    """Multi-head attention: self or cross, causal or bidirectional, optional additive bias, KV cache.

    Attributes:
        config: the heads, biases, positions and dropout (`AttentionConfig`).
        cross: attend to a `context` (encoder output) instead of x.
        causal: mask future keys (decoder self-attention).
        query_init: initializer of the query projection (None: kernel_init).
        out_init: initializer of the output projection (GPT-2 scales it by 1/sqrt(2 L)).
    """

    config: AttentionConfig
    cross: bool = False
    causal: bool = False
    kernel_init: Initializer = nn.initializers.normal(0.02)
    query_init: Initializer | None = None
    out_init: Initializer = nn.initializers.normal(0.02)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        context: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        context_segment_ids: jax.Array | None = None,
        bias: jax.Array | None = None,
        positions: jax.Array | None = None,
        deterministic: bool,
        decode: bool = False,
        sliding_window: int | jax.Array | None = None,
        rotary_frequencies: np.ndarray | jax.Array | None = None,
    ) -> jax.Array:
        """x: [B, T, D]; context: [B, S, D] for cross-attention -> [B, T, D].

        segment_ids [B, T] / context_segment_ids [B, S]: document ids, 0 = padding. positions [B, T]: of the
        queries (and self-attention keys), for rotary embeddings and the sliding window (default 0..T-1). In
        decode mode x is the next chunk of the sequence and self-attention keys/values accumulate in the "cache"
        collection; cross-attention projects the context once (the call that passes it) and later
        calls, with context None, read its keys/values from the cache.

        sliding_window (0: none) and rotary_frequencies [H / 2] override the config's window and rotation for this
        layer, in a stack whose layers differ (`BlockStack.per_layer`): Python values in a looped stack, as the
        config's; traced scalars and arrays in a scanned one, where the window is a mask over a full-length cache.
        """
        cfg = self.config
        window = cfg.sliding_window if sliding_window is None else sliding_window
        if not isinstance(window, jax.Array):
            window = window or None  # a looped full-attention layer's 0
        d = x.shape[-1]
        kv_heads = cfg.num_kv_heads or cfg.num_heads
        if cfg.num_heads % kv_heads:
            raise ValueError(f"num_heads={cfg.num_heads} must be a multiple of num_kv_heads={kv_heads}")
        qkv_bias = cfg.use_bias if cfg.qkv_bias is None else cfg.qkv_bias
        proj = functools.partial(
            Einsum, use_bias=qkv_bias, kernel_init=self.kernel_init, dtype=self.dtype, param_dtype=self.param_dtype
        )
        head_norm = functools.partial(
            LayerNorm,
            epsilon=cfg.qk_norm_epsilon,
            use_bias=False,
            use_mean=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        query = proj(
            (d, cfg.num_heads, cfg.head_dim),
            ("embed", "heads", "kv"),
            kernel_init=self.query_init or self.kernel_init,
            name="query",
        )("BTD,DNH->BTNH", x)
        if cfg.qk_norm:
            query = head_norm(name="query_norm")(query)
        query = sharding.constrain(query, ("act_batch", "act_len", "act_heads", "act_kv"))
        rotation = (
            None
            if cfg.rotary is None
            else cfg.rotary.rotation(positions, cfg.head_dim, x.shape[1], frequencies=rotary_frequencies)
        )
        if positions is None and window is not None:
            positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        if rotation is not None:
            query = cfg.rotary(query, rotation)
        grouped = kv_heads < cfg.num_heads  # fewer kv heads than the tensor axis: they get a rule of their own
        kv_axes = ("embed", "kv_heads" if grouped else "heads", "kv")
        kv_act_axes = ("act_batch", "act_len", "act_kv_heads" if grouped else "act_heads", "act_kv")

        def project_keys_values(source, rotate):
            key = proj((d, kv_heads, cfg.head_dim), kv_axes, name="key")("BSD,DNH->BSNH", source)
            value = proj((d, kv_heads, cfg.head_dim), kv_axes, name="value")("BSD,DNH->BSNH", source)
            if cfg.qk_norm:
                key = head_norm(name="key_norm")(key)
            if rotate and rotation is not None:
                key = cfg.rotary(key, rotation)
            return sharding.constrain(key, kv_act_axes), sharding.constrain(value, kv_act_axes)

        is_causal = self.causal
        mask_segment_ids = None  # the segment ids the mask is exactly made of, for the splash form
        if self.cross:
            project_context = functools.partial(project_keys_values, rotate=False)
            key, value = self._context_keys_values(context, project_context) if decode else project_context(context)
            mask = attention_mask(segment_ids, context_segment_ids, causal=False)
        elif decode:
            keys_values = project_keys_values(x, rotate=True)
            if window is None or isinstance(window, jax.Array):
                key, value, mask = self._update_cache(*keys_values, segment_ids, window)
            else:
                key, value, mask = self._update_rolling_cache(*keys_values, segment_ids, positions, window)
            is_causal = False
        else:
            key, value = project_keys_values(x, rotate=True)
            mask = attention_mask(segment_ids, segment_ids, causal=False)
            if window is not None:
                in_window = sliding_window_mask(positions, positions, window)
                mask = in_window if mask is None else mask & in_window
            else:
                mask_segment_ids = segment_ids

        dropout_rng = None if deterministic or cfg.dropout_rate == 0.0 else self.make_rng("dropout")
        sinks = None
        if cfg.sinks:
            sinks = self.param(
                "sinks",
                nn.with_logical_partitioning(self.kernel_init, ("heads",)),
                (cfg.num_heads,),
                self.param_dtype,
            )
        if decode and not self.cross:  # keys and values are the head-major cache's
            out = cached_attention(query, key, value, mask=mask, bias=bias, scale=cfg.scale, sinks=sinks)
        else:
            out = dot_product_attention(
                query,
                key,
                value,
                mask=mask,
                bias=bias,
                is_causal=is_causal,
                scale=cfg.scale,
                dropout_rate=cfg.dropout_rate,
                dropout_rng=dropout_rng,
                segment_ids=mask_segment_ids,
                sinks=sinks,
            )
        if cfg.output_gate:
            gate = proj((d, cfg.num_heads, cfg.head_dim), ("embed", "heads", "kv"), name="gate")("BTD,DNH->BTNH", x)
            out = out * jax.nn.sigmoid(gate).astype(out.dtype)
        out = sharding.constrain(out, ("act_batch", "act_len", "act_heads", "act_kv"))
        return Einsum(
            (cfg.num_heads, cfg.head_dim, d),
            ("heads", "kv", "embed"),
            use_bias=cfg.use_bias,
            kernel_init=self.out_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="out",
        )("BTNH,NHD->BTD", out)

    def _context_keys_values(self, context: jax.Array | None, project: Callable) -> tuple[jax.Array, jax.Array]:
        """Cross-attention keys/values [B, S, N, H] while decoding: projected from `context` [B, S, D] when it
        is given (init, first step) and stored in the cache; read from the cache when context is None."""
        if context is not None:
            key, value = project(context)
            if self.is_mutable_collection("cache"):
                self.put_variable("cache", "cached_context_key", key)
                self.put_variable("cache", "cached_context_value", value)
            return key, value
        if not self.has_variable("cache", "cached_context_key"):
            raise ValueError(
                "cross-attention decoding without a context needs a cache filled by an earlier step with the context"
            )
        return self.get_variable("cache", "cached_context_key"), self.get_variable("cache", "cached_context_value")

    def _update_cache(
        self, key: jax.Array, value: jax.Array, segment_ids: jax.Array | None, window: jax.Array | None = None
    ):
        """Writes a [B, T] chunk (keys, values [B, T, K, H]) at each row's cache index; returns the whole head-major
        cache's keys [B, K, H, S] and values [B, K, S, H] (`cached_attention`) and the mask [B, 1, T, S].

        The first call (at init) sizes the cache from the chunk it sees: call `init` with a
        [B, max_decode_len] batch. Each row keeps its own index (cache_index [B]), so rows filled at different
        times (the generation engine's slots) share one cache; later chunks attend to every earlier valid key
        of their row and causally within themselves, and with a traced `window` (a scanned layer's, 0: none) only
        to the keys within it: the cache index orders the keys, and a row's padding is never attended to, so
        index differences are the position differences HF's window counts.
        """
        batch, chunk = key.shape[:2]
        key, value = key.transpose(0, 2, 3, 1), jnp.swapaxes(value, 1, 2)  # [B, K, H, T], [B, K, T, H]
        initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        cached_valid = self.variable("cache", "cached_valid", jnp.zeros, (batch, chunk), jnp.bool_)
        cache_index = self.variable("cache", "cache_index", jnp.zeros, (batch,), jnp.int32)
        valid = jnp.ones((batch, chunk), jnp.bool_) if segment_ids is None else segment_ids != 0
        if not initialized:
            return key, value, attention_mask(None, None, causal=False)
        index = cache_index.value
        length = cached_value.value.shape[2]

        def write(cached, chunk_values, axis):  # each row's chunk at that row's index
            return jax.vmap(functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=axis))(
                cached, chunk_values, index
            )

        cached_key.value = write(cached_key.value, key, 2)
        cached_value.value = write(cached_value.value, value, 1)
        cached_valid.value = write(cached_valid.value, valid, 0)
        cache_index.value = index + chunk
        query_positions = index[:, None] + jnp.arange(chunk)  # [B, T]
        causal = jnp.arange(length)[None, None, :] <= query_positions[:, :, None]
        mask = causal[:, None] & cached_valid.value[:, None, None, :]
        if window is not None:
            mask = mask & sliding_window_mask(query_positions, jnp.arange(length)[None], window)
        return cached_key.value, cached_value.value, mask

    def _update_rolling_cache(
        self, key: jax.Array, value: jax.Array, segment_ids: jax.Array | None, positions: jax.Array, window: int
    ):
        """Sliding-window decoding: the cache holds only the last W = `window` keys and values, head-major as
        `_update_cache`'s (keys [B, K, H, W], values [B, K, W, H], with their positions and validity [B, W]), W positions
        of memory rather than max_decode_len. A [B, T] chunk attends to the cached keys and itself, by positions: causal
        and within the window; the newest W then stay cached. Returns keys [B, K, H, W + T], values [B, K, W + T, H]
        and the mask [B, 1, T, W + T]."""
        batch, chunk = key.shape[:2]
        key, value = key.transpose(0, 2, 3, 1), jnp.swapaxes(value, 1, 2)  # [B, K, H, T], [B, K, T, H]
        initialized = self.has_variable("cache", "cached_key")
        size = min(window, chunk)  # at init the chunk is [B, max_decode_len]
        kv_heads, head_dim = value.shape[1], value.shape[3]
        cached_key = self.variable("cache", "cached_key", jnp.zeros, (batch, kv_heads, head_dim, size), key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, (batch, kv_heads, size, head_dim), value.dtype)
        cached_valid = self.variable("cache", "cached_valid", jnp.zeros, (batch, size), jnp.bool_)
        cached_positions = self.variable("cache", "cached_positions", jnp.zeros, (batch, size), jnp.int32)
        valid = jnp.ones((batch, chunk), jnp.bool_) if segment_ids is None else segment_ids != 0
        if not initialized:
            return key, value, attention_mask(None, None, causal=False)
        keys = jnp.concatenate([cached_key.value, key], axis=3)
        values = jnp.concatenate([cached_value.value, value], axis=2)
        key_valid = jnp.concatenate([cached_valid.value, valid], axis=1)
        key_positions = jnp.concatenate([cached_positions.value, positions.astype(jnp.int32)], axis=1)
        kept = cached_valid.value.shape[1]
        cached_key.value, cached_value.value = keys[..., -kept:], values[:, :, -kept:]
        cached_valid.value, cached_positions.value = key_valid[:, -kept:], key_positions[:, -kept:]
        causal = (key_positions[:, None, :] <= positions[:, :, None])[:, None]
        in_window = sliding_window_mask(positions, key_positions, window)
        return keys, values, causal & in_window & key_valid[:, None, None, :]
