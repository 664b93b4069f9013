"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values through a low-rank latent, a compressed cache.

Each position's keys and values come from one latent c [A] (kv_lora_rank, RMS-normalised) and one rotary key [P]
(qk_rope_head_dim) shared by every head; queries optionally through a latent of their own [Q] (q_lora_rank, normalised
too). Head n's key is [k_nope_n(c), k_rope] of H = Hn + P and its value v_n(c) of G (v_head_dim), both from c by one
kernel ("kv_up" [A, N, Hn + G]). Training attends with the expanded keys and values, as HF does. Decoding caches only
c and k_rope: A + P numbers a position per layer instead of N (H + G), and attends in the latent space with the
up-projection absorbed into the query and the output (q_n . k_nope_n(c) = (W_k,n q_n) . c; sum_s p_s v_n(c_s) =
W_v,n sum_s p_s c_s), so the cache is read as it is stored: one key/value head of A + P / A against N query heads.

The rotation is HF's: rotate-half, or (`rope_interleave`, DeepSeek-V3's checkpoints) on interleaved pairs (x0, x1),
(x2, x3), ... whose rotated halves come out as [evens, odds]; YaRN's frequencies and scales when the context is
stretched (`layers.embeddings.Yarn`).

Einsum letters besides the shared ones (B, T, S, D, N, H): Q the query latent, A the key/value latent, P the rotary
key, G the value head.
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import sharding
from lmzoo.layers.attention import attention_mask, dot_product_attention
from lmzoo.layers.embeddings import Rotary, Yarn
from lmzoo.layers.linears import Einsum, Initializer, project
from lmzoo.layers.norms import LayerNorm


@dataclasses.dataclass(frozen=True)
class LatentAttentionConfig:
    """The fields of one multi-head latent attention.

    Attributes:
        num_heads: N.
        kv_lora_rank: A, the key/value latent.
        qk_nope_head_dim: Hn, the part of a query/key head without rotation.
        qk_rope_head_dim: P, the rotated part (one key of P per position, shared by the heads).
        v_head_dim: G.
        q_lora_rank: Q, the query latent; 0: queries projected from x directly (DeepSeek-V2-Lite).
        rope_theta: the rotation's base.
        yarn: YaRN's stretching, or None.
        rope_interleave: rotate interleaved pairs (DeepSeek-V3's checkpoints), else halves.
        norm_epsilon: of the latents' RMS norms.
        dropout_rate: on the attention probabilities.
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    rope_theta: float = 10_000.0
    yarn: Yarn | None = None
    rope_interleave: bool = True
    norm_epsilon: float = 1e-6
    dropout_rate: float = 0.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """The logit scale: H ** -0.5, times YaRN's mscale_all_dim factor (`Yarn.logit_scale`)."""
        return self.qk_head_dim**-0.5 * (self.yarn.logit_scale if self.yarn else 1.0)

    def inverse_frequencies(self) -> np.ndarray:
        """[P / 2] float32."""
        if self.yarn is None:
            return Rotary(self.rope_theta).inverse_frequencies(self.qk_rope_head_dim)
        return self.yarn.inverse_frequencies(self.rope_theta, self.qk_rope_head_dim)

    def cache_width(self) -> int:
        """Numbers the decode cache holds per position and layer: A + P."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def rotate(x: jax.Array, rotation: tuple[jax.Array, jax.Array], *, interleave: bool) -> jax.Array:
    """x [B, T, N, P] rotated by `Rotary.rotation` tables [B|1, T, 1, P] (whose halves are equal), in x's dtype.

    interleave: pairs (x0, x1), (x2, x3), ... rotate together and come out as [rotated evens, rotated odds] (HF's
    apply_rotary_pos_emb_interleave); else HF's rotate-half."""
    cos, sin = (table.astype(x.dtype) for table in rotation)
    if not interleave:
        first, second = jnp.split(x, 2, axis=-1)
        return x * cos + jnp.concatenate([-second, first], axis=-1) * sin
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    evens, odds = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([evens * cos - odds * sin, odds * cos + evens * sin], axis=-1)


def attend(query: jax.Array, key: jax.Array, value: jax.Array, **kwargs: Any) -> jax.Array:
    """`attention.dot_product_attention` of query [B, T, N, H], key [B, S, K, H] and value [B, S, K, G] -> [B, T, N, G]
    for any G: the smaller of H and G is padded with zeros (jax.nn.dot_product_attention wants keys and values
    alike; zeros add nothing to the logits or the outputs), as HF pads for flash attention. Pass `scale`."""
    h, g = key.shape[-1], value.shape[-1]
    pad = lambda a, width: jnp.pad(a, [(0, 0)] * 3 + [(0, width - a.shape[-1])])  # noqa: E731
    if g < h:
        value = pad(value, h)
    elif h < g:
        query, key = pad(query, g), pad(key, g)
    return dot_product_attention(query, key, value, **kwargs)[..., :g]


class Kernel(nn.Module):
    """A kernel with logical axes, returned as it is, for a projection applied in more than one way (`kv_up`)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    kernel_init: Initializer = nn.initializers.normal(0.02)
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        init = nn.with_logical_partitioning(self.kernel_init, self.axes)
        return self.param("kernel", init, self.shape, self.param_dtype)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention with a compressed KV cache.

    Params: "query_latent" [D, Q] and "query_latent_norm" [Q] with "query" [Q, N, H] (or "query" [D, N, H] when
    q_lora_rank is 0); "kv_latent" [D, A + P] (the latent and the rotary key), "kv_latent_norm" [A], "kv_up"
    [A, N, Hn + G] (each head's unrotated key and its value), "out" [N, G, D]. The latents are inputs of the
    up-projections ("query", "kv_up") as the embedding is of the others, and take its logical axis ("embed": FSDP);
    as outputs of "query_latent" and "kv_latent" they are not sharded ("kv").

    Attributes:
        config: LatentAttentionConfig.
    """

    config: LatentAttentionConfig
    kernel_init: Initializer = nn.initializers.normal(0.02)
    out_init: Initializer = nn.initializers.normal(0.02)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        deterministic: bool,
        decode: bool = False,
    ) -> jax.Array:
        """x: [B, T, D] -> [B, T, D].

        segment_ids [B, T]: document ids, 0 = padding. positions [B, T]: of the tokens, for the rotation (default
        0..T-1). In decode mode x is the next chunk of the sequence, and its latents and rotary keys join the "cache"
        collection at each row's cache_index (the protocol of `attention.Attention`'s cache: `lmzoo.serving.slots`).
        """
        cfg = self.config
        d, n, hn, g = x.shape[-1], cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        a, p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        proj = functools.partial(Einsum, kernel_init=self.kernel_init, dtype=self.dtype, param_dtype=self.param_dtype)
        norm = functools.partial(
            LayerNorm,
            epsilon=cfg.norm_epsilon,
            use_bias=False,
            use_mean=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        if cfg.q_lora_rank:
            q_latent = proj((d, cfg.q_lora_rank), ("embed", "kv"), name="query_latent")("BTD,DQ->BTQ", x)
            q_latent = norm(name="query_latent_norm")(q_latent)
            query = proj((cfg.q_lora_rank, n, cfg.qk_head_dim), ("embed", "heads", "kv"), name="query")(
                "BTQ,QNH->BTNH", q_latent
            )
        else:
            query = proj((d, n, cfg.qk_head_dim), ("embed", "heads", "kv"), name="query")("BTD,DNH->BTNH", x)
        query = sharding.constrain(query, ("act_batch", "act_len", "act_heads", "act_kv"))
        kv = proj((d, a + p), ("embed", "kv"), name="kv_latent")("BTD,DA->BTA", x)
        latent = norm(name="kv_latent_norm")(kv[..., :a])  # [B, T, A]
        latent = sharding.constrain(latent, ("act_batch", "act_len", "act_kv"))

        rotation = Rotary(cfg.rope_theta).rotation(positions, p, x.shape[1], frequencies=cfg.inverse_frequencies())
        if cfg.yarn is not None and cfg.yarn.table_scale != 1.0:
            rotation = tuple(table * np.float32(cfg.yarn.table_scale) for table in rotation)
        rotated = functools.partial(rotate, rotation=rotation, interleave=cfg.rope_interleave)
        query_nope, query_rope = query[..., :hn], rotated(query[..., hn:])
        rope_key = rotated(kv[..., None, a:])[:, :, 0]  # [B, T, P]: one key for every head
        up = Kernel((a, n, hn + g), ("embed", "heads", "kv"), self.kernel_init, self.param_dtype, name="kv_up")()
        up = up.astype(self.dtype)
        dropout_rng = None if deterministic or cfg.dropout_rate == 0.0 else self.make_rng("dropout")
        attend_with = functools.partial(
            attend, bias=None, scale=cfg.scale, dropout_rate=cfg.dropout_rate, dropout_rng=dropout_rng
        )

        if decode:
            latents, rope_keys, mask = self._update_cache(latent, rope_key, segment_ids)
            # The up-projection absorbed: queries meet the cached latents, one key/value head for all N.
            query_latent = project("BTNH,ANH->BTNA", query_nope, up[..., :hn])
            query = jnp.concatenate([query_latent, query_rope], axis=-1)  # [B, T, N, A + P]
            key = jnp.concatenate([latents, rope_keys], axis=-1)[:, :, None]  # [B, S, 1, A + P]
            out = attend_with(query, key, latents[:, :, None], mask=mask, is_causal=False)  # [B, T, N, A]
            out = project("BTNA,ANG->BTNG", out, up[..., hn:])
        else:
            kv_heads = project("BSA,ANH->BSNH", latent, up)  # [B, S, N, Hn + G]
            key_rope = jnp.broadcast_to(rope_key[:, :, None], rope_key.shape[:2] + (n, p))
            key = jnp.concatenate([kv_heads[..., :hn], key_rope], axis=-1)  # [B, S, N, H]
            query = jnp.concatenate([query_nope, query_rope], axis=-1)
            out = attend_with(
                query,
                key,
                kv_heads[..., hn:],
                mask=attention_mask(segment_ids, segment_ids, causal=False),
                is_causal=True,
                segment_ids=segment_ids,
            )
        out = sharding.constrain(out, ("act_batch", "act_len", "act_heads", "act_kv"))
        return Einsum(
            (n, g, d),
            ("heads", "kv", "embed"),
            kernel_init=self.out_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="out",
        )("BTNG,NGD->BTD", out)

    def _update_cache(self, latent: jax.Array, rope_key: jax.Array, segment_ids: jax.Array | None):
        """Writes a [B, T] chunk's latents [B, T, A] and rotary keys [B, T, P] at each row's cache index; returns the
        cached ones [B, S, A], [B, S, P] and the mask [B, 1, T, S].

        `attention.Attention`'s protocol: the first call (at init) sizes the cache from the chunk it sees (call `init`
        with a [B, max_decode_len] batch); each row keeps its own index (cache_index [B]), so rows filled at different
        times share one cache; a chunk attends to every earlier valid position of its row and causally within itself.
        """
        batch, chunk = latent.shape[:2]
        initialized = self.has_variable("cache", "cached_latent")
        cached_latent = self.variable("cache", "cached_latent", jnp.zeros, latent.shape, latent.dtype)
        cached_rope_key = self.variable("cache", "cached_rope_key", jnp.zeros, rope_key.shape, rope_key.dtype)
        cached_valid = self.variable("cache", "cached_valid", jnp.zeros, latent.shape[:2], jnp.bool_)
        cache_index = self.variable("cache", "cache_index", jnp.zeros, (batch,), jnp.int32)
        if not initialized:
            return latent, rope_key, None
        valid = jnp.ones((batch, chunk), jnp.bool_) if segment_ids is None else segment_ids != 0
        index = cache_index.value
        write = jax.vmap(functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=0))
        cached_latent.value = write(cached_latent.value, latent.astype(cached_latent.value.dtype), index)
        cached_rope_key.value = write(cached_rope_key.value, rope_key.astype(cached_rope_key.value.dtype), index)
        cached_valid.value = write(cached_valid.value, valid, index)
        cache_index.value = index + chunk
        length = cached_latent.value.shape[1]
        query_positions = index[:, None] + jnp.arange(chunk)  # [B, T]
        causal = jnp.arange(length)[None, None, :] <= query_positions[:, :, None]
        mask = causal[:, None] & cached_valid.value[:, None, None, :]
        return cached_latent.value, cached_rope_key.value, mask
