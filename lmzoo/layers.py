"""Building blocks shared by every family: projections, embeddings, norms, attention, MLP, stacking.

Einsum letters: B batch, T query length, S key length, D emb_dim, N heads, H head_dim, F mlp_dim,
V vocab. Every parameter declares logical axes (see `lmzoo.sharding`); activations are
constrained at block boundaries.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import kernels, sharding
from lmzoo.kernels import cpu

Initializer = Callable[..., jax.Array]


def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, x * Phi(x) (`kernels.cpu.gelu` on the CPU)."""
    if kernels.on_cpu():
        return cpu.gelu(x)
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "linear": lambda x: x,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def check_fields(
    config: Any,
    *,
    sizes: Sequence[str] = (),
    counts: Sequence[str] = (),
    positive: Sequence[str] = (),
    rates: Sequence[str] = (),
) -> None:
    """Raises one ValueError naming every out-of-range field of a family config dataclass as `config.model.FIELD`
    with its fix (called from each family's `__post_init__`, so `models.make_config` checks them all before any
    model is built): sizes >= 1, counts >= 0, positive (epsilons, scales) > 0, rates (dropout) in [0, 1)."""
    rules = [
        *((f, lambda v: v >= 1, "must be a positive integer; set --config.model.{f}=N with N >= 1") for f in sizes),
        *((f, lambda v: v >= 0, "must be >= 0; set --config.model.{f}=0 or more") for f in counts),
        *((f, lambda v: v > 0, "must be > 0; set --config.model.{f} to a positive value") for f in positive),
        *(
            (f, lambda v: 0 <= v < 1, "must be in [0, 1); set e.g. --config.model.{f}=0.1 (0 turns it off)")
            for f in rates
        ),
    ]
    problems = [
        f"config.model.{f}={getattr(config, f)!r}: {why.format(f=f)}"
        for f, ok, why in rules
        if not ok(getattr(config, f))
    ]
    if problems:
        raise ValueError("; ".join(problems))


def project(eqn: str, x: jax.Array, kernel: jax.Array, **dot_kwargs: Any) -> jax.Array:
    """`jnp.einsum(eqn, x, kernel)` for a projection (`kernels.cpu.project`, one 2-D matmul, on the CPU).
    dot_kwargs: e.g. preferred_element_type."""
    if kernels.on_cpu():
        return cpu.project(eqn, x, kernel, **dot_kwargs)
    return jnp.einsum(eqn, x, kernel, **dot_kwargs)


class Einsum(nn.Module):
    """A projection `einsum(eqn, x, kernel) (+ bias)` whose kernel carries logical axis names.

    Attributes:
        shape: kernel shape, e.g. (D, N, H).
        axes: one logical name per kernel dimension, e.g. ("embed", "heads", "kv").
        use_bias: add a bias over the kernel dimensions that appear in the output.
    """

    shape: Sequence[int]
    axes: Sequence[str]
    use_bias: bool = False
    kernel_init: Initializer = nn.initializers.normal(0.02)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, eqn: str, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(self.kernel_init, tuple(self.axes)),
            tuple(self.shape),
            self.param_dtype,
        )
        y = project(eqn, x.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            in_spec, out_spec = eqn.replace(" ", "").split("->")
            kernel_spec = in_spec.split(",")[1]
            keep = [i for i, letter in enumerate(kernel_spec) if letter in out_spec]
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, tuple(self.axes[i] for i in keep)),
                tuple(self.shape[i] for i in keep),
                self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        return y


def embed_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of `table` [V, D] for `ids` [...] -> [..., D]. Ids outside [0, V) are a ValueError when they are
    concrete (an eager `model.apply`); traced (under jit) they give NaN rows, which JAX's gather would otherwise
    clamp (ids >= V) or wrap (negative ids) into another token's row without a word."""
    if not isinstance(ids, jax.core.Tracer) and np.size(ids):
        host = np.asarray(ids)  # on the host: a concrete array's own min() would be staged into an enclosing trace
        low, high = int(host.min()), int(host.max())
        if low < 0 or high >= table.shape[0]:
            raise ValueError(
                f"token ids span [{low}, {high}] but the embedding table has {table.shape[0]} rows: encode with "
                "the model's tokenizer (config.model.vocab_size must cover its ids)"
            )
    x = jnp.take(table, ids, axis=0, mode="clip")
    in_range = (ids >= 0) & (ids < table.shape[0])
    return jnp.where(in_range[..., None], x, jnp.nan)


class Embed(nn.Module):
    """Token embedding table [V, D] with `attend` for tied output heads.

    Out-of-range ids give NaN embeddings (`embed_lookup`), so a bad id can never train quietly; data
    pipelines also check ids on the host with a clear error.
    """

    num_embeddings: int
    features: int
    embedding_init: Initializer = nn.initializers.normal(0.02)
    axes: tuple[str, str] = ("vocab", "embed")
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, self.axes),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids: [B, T] int -> [B, T, D]."""
        return embed_lookup(self.embedding, ids).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """x: [B, T, D] -> logits [B, T, V]."""
        return project("BTD,VD->BTV", x.astype(self.dtype), self.embedding.astype(self.dtype))


def normalize(x: jax.Array, scale: jax.Array, epsilon: float, use_mean: bool) -> jax.Array:
    """(x - mean) / sqrt(var + epsilon) * scale over the last axis, in float32 (RMS norm without the mean).

    x [..., D], scale [D] -> float32 [..., D] (`kernels.cpu.normalize`, with its derivative written out, on the CPU).
    """
    if kernels.on_cpu():
        return cpu.normalize(x, scale, epsilon, use_mean)
    x32 = x.astype(jnp.float32)
    if use_mean:
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon) * scale.astype(jnp.float32)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis (`use_bias=False, use_mean=False` gives T5's RMS norm)."""

    epsilon: float = 1e-5
    use_bias: bool = True
    use_mean: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in dtype; the statistics are computed in float32."""
        d = x.shape[-1]
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (d,), self.param_dtype
        )
        y = normalize(x, scale, self.epsilon, self.use_mean)
        if self.use_bias:
            y = y + self.param(
                "bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), (d,), self.param_dtype
            )
        return y.astype(self.dtype)


def check_length(length: int, max_len: int, *, offset: int = 0, what: str = "sequence") -> None:
    """Raises a clear error when `length` positions, numbered from `offset`, overrun a learned table of max_len rows.

    A static check on shapes (so it also runs under jit); an out-of-table id that only shows up in the
    values of explicit positions gives NaN embeddings instead (see `Embed`).
    """
    if length + offset > max_len:
        start = f" starting at position_offset {offset}" if offset else ""
        raise ValueError(
            f"{what} length {length}{start} does not fit the learned position table (max_len={max_len}); "
            f"shorten the input to at most {max_len - offset} tokens or raise max_len"
        )


def sinusoidal_positions(positions: jax.Array, features: int, max_timescale: float = 10_000.0) -> jax.Array:
    """Vaswani et al. positions: [..., T] -> [..., T, D], sin in the first half, cos in the second."""
    half = features // 2
    inv_freq = jnp.exp(-np.log(max_timescale) * jnp.arange(half, dtype=jnp.float32) / max(half - 1, 1))
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


@dataclasses.dataclass(frozen=True)
class Rotary:
    """Rotary position embeddings (Su et al.) in HF's rotate-half layout: dims i and i + H/2 rotate together.

    theta: the base (`rope_theta`). scaling: Llama 3's "llama3" frequency scaling as (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings), or None.
    """

    theta: float = 10_000.0
    scaling: tuple[float, float, float, int] | None = None

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        """[H / 2] float32 angular speeds, as HF's rope initialisation computes them."""
        inv_freq = 1.0 / self.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
        if self.scaling is None:
            return inv_freq.astype(np.float32)
        factor, low_freq_factor, high_freq_factor, original_len = self.scaling
        low_freq_wavelen, high_freq_wavelen = original_len / low_freq_factor, original_len / high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def rotation(
        self, positions: jax.Array | None, head_dim: int, length: int | None = None
    ) -> tuple[jax.Array | np.ndarray, jax.Array | np.ndarray]:
        """positions [B, T], or None for 0..length-1 -> (cos, sin), each [B or 1, T, 1, H] float32."""
        if positions is None:
            if kernels.on_cpu():
                return cpu.rotation_tables(tuple(self.inverse_frequencies(head_dim).tolist()), length)
            positions = jnp.arange(length)[None]
        angles = positions[..., None].astype(jnp.float32) * self.inverse_frequencies(head_dim)  # [B, T, H/2]
        angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
        return jnp.cos(angles), jnp.sin(angles)

    def __call__(self, x: jax.Array, rotation: tuple[jax.Array, jax.Array]) -> jax.Array:
        """x [B, T, N, H] rotated by `rotation(positions, H)`; applied in x's dtype (as HF)."""
        cos, sin = (table.astype(x.dtype) for table in rotation)
        first, second = jnp.split(x, 2, axis=-1)
        return x * cos + jnp.concatenate([-second, first], axis=-1) * sin


def check_rope_scaling(scaling: tuple | None) -> None:
    """Raises unless `scaling` is None or a valid llama3 (factor, low_freq_factor, high_freq_factor, original_len)."""
    if scaling is None:
        return
    if len(scaling) != 4:
        raise ValueError(
            f"rope scaling {scaling!r} must be llama3's (factor, low_freq_factor, high_freq_factor, "
            "original_max_position_embeddings)"
        )
    factor, low, high, original = scaling
    if factor <= 0 or low <= 0 or high <= low or original <= 0:
        raise ValueError(
            f"rope scaling {scaling!r}: llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
            "original_max_position_embeddings > 0"
        )


def sliding_window_mask(query_positions: jax.Array, key_positions: jax.Array, window: int) -> jax.Array:
    """[B, 1, T, S]: key within the last `window` positions of its query (itself included), as HF's Mistral."""
    return (key_positions[:, None, :] > query_positions[:, :, None] - window)[:, None]


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
) -> jax.Array:
    """q [B, T, N, H], k/v [B, S, K, H] (K divides N: grouped-query attention when K < N) -> [B, T, N, H].

    On GPUs, cuDNN's fused flash attention where it applies (bf16/fp16, head size a multiple of 8 up to 128, no
    additive bias, and a boolean mask [B, 1, T, S] only over a whole sequence: packed documents, padding): JAX's
    default (`implementation=None`) is its XLA form, which materialises the [B, N, T, S] scores. A decoding step's
    few queries against the cache keep the XLA form. Elsewhere `jax.nn.dot_product_attention`'s XLA form, except
    on the CPU and when attention dropout needs the probabilities: then `kernels.cpu.dot_product_attention`, the
    explicit form.
    """
    if kernels.on_cpu() or (dropout_rng is not None and dropout_rate > 0.0):
        groups = query.shape[2] // key.shape[2]
        if groups > 1:  # grouped-query attention: query head n reads kv head n // groups
            key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
        return cpu.dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            is_causal=is_causal,
            scale=scale,
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
        )
    fused = (
        kernels.platform() == "gpu"
        and jax.default_backend() == "gpu"  # the GPU forms traced on a CPU (tests) have no cuDNN to call
        and (mask is None or query.shape[1] == key.shape[1])
        and bias is None
        and query.dtype in (jnp.bfloat16, jnp.float16)
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 128
    )
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        scale=scale,
        is_causal=is_causal,
        implementation="cudnn" if fused else None,
    )


class Attention(nn.Module):
    """Multi-head attention: self or cross, causal or bidirectional, optional additive bias, KV cache.

    Attributes:
        num_heads: N.
        head_dim: H.
        cross: attend to a `context` (encoder output) instead of x.
        causal: mask future keys (decoder self-attention).
        use_bias: biases on the q/k/v/out projections.
        scale: logit scale; None means H ** -0.5 (T5 uses 1.0).
        query_init: initializer of the query projection (None: kernel_init).
        out_init: initializer of the output projection (GPT-2 scales it by 1/sqrt(2 L)).
        num_kv_heads: K key/value heads (None: N); K < N is grouped-query attention (K = 1: multi-query), and the
            KV cache holds K heads. Their kernels' heads axis is "kv_heads", a sharding rule of its own.
        qkv_bias: biases on q/k/v only (None: use_bias), e.g. Qwen2's q/k/v biases without an output bias.
        rotary: rotate queries and keys by their positions (Llama); None for families with other positions.
        sliding_window: each query attends to its last `sliding_window` positions (Mistral); None: all.
    """

    num_heads: int
    head_dim: int
    cross: bool = False
    causal: bool = False
    use_bias: bool = True
    num_kv_heads: int | None = None
    qkv_bias: bool | None = None
    rotary: Rotary | None = None
    sliding_window: int | None = None
    scale: float | None = None
    dropout_rate: float = 0.0
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
    ) -> jax.Array:
        """x: [B, T, D]; context: [B, S, D] for cross-attention -> [B, T, D].

        segment_ids [B, T] / context_segment_ids [B, S]: document ids, 0 = padding. positions [B, T]: of the
        queries (and self-attention keys), for rotary embeddings and the sliding window (default 0..T-1). In
        decode mode x is the next chunk of the sequence and self-attention keys/values accumulate in the "cache"
        collection; cross-attention projects the context once (the call that passes it) and later
        calls, with context None, read its keys/values from the cache.
        """
        d = x.shape[-1]
        kv_heads = self.num_kv_heads or self.num_heads
        if self.num_heads % kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={kv_heads}")
        qkv_bias = self.use_bias if self.qkv_bias is None else self.qkv_bias
        proj = functools.partial(
            Einsum, use_bias=qkv_bias, kernel_init=self.kernel_init, dtype=self.dtype, param_dtype=self.param_dtype
        )
        query = proj(
            (d, self.num_heads, self.head_dim),
            ("embed", "heads", "kv"),
            kernel_init=self.query_init or self.kernel_init,
            name="query",
        )("BTD,DNH->BTNH", x)
        query = sharding.constrain(query, ("act_batch", "act_len", "act_heads", "act_kv"))
        rotation = None if self.rotary is None else self.rotary.rotation(positions, self.head_dim, x.shape[1])
        if positions is None and self.sliding_window:
            positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        if rotation is not None:
            query = self.rotary(query, rotation)
        grouped = kv_heads < self.num_heads  # fewer kv heads than the tensor axis: they get a rule of their own
        kv_axes = ("embed", "kv_heads" if grouped else "heads", "kv")
        kv_act_axes = ("act_batch", "act_len", "act_kv_heads" if grouped else "act_heads", "act_kv")

        def project_keys_values(source, rotate):
            key = proj((d, kv_heads, self.head_dim), kv_axes, name="key")("BSD,DNH->BSNH", source)
            value = proj((d, kv_heads, self.head_dim), kv_axes, name="value")("BSD,DNH->BSNH", source)
            if rotate and rotation is not None:
                key = self.rotary(key, rotation)
            return sharding.constrain(key, kv_act_axes), sharding.constrain(value, kv_act_axes)

        is_causal = self.causal
        if self.cross:
            project_context = functools.partial(project_keys_values, rotate=False)
            key, value = self._context_keys_values(context, project_context) if decode else project_context(context)
            mask = attention_mask(segment_ids, context_segment_ids, causal=False)
        elif decode:
            update = self._update_rolling_cache if self.sliding_window else self._update_cache
            key, value, mask = update(*project_keys_values(x, rotate=True), segment_ids, positions)
            is_causal = False
        else:
            key, value = project_keys_values(x, rotate=True)
            mask = attention_mask(segment_ids, segment_ids, causal=False)
            if self.sliding_window:
                window = sliding_window_mask(positions, positions, self.sliding_window)
                mask = window if mask is None else mask & window

        dropout_rng = None if deterministic or self.dropout_rate == 0.0 else self.make_rng("dropout")
        out = dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            is_causal=is_causal,
            scale=self.scale,
            dropout_rate=self.dropout_rate,
            dropout_rng=dropout_rng,
        )
        out = sharding.constrain(out, ("act_batch", "act_len", "act_heads", "act_kv"))
        return Einsum(
            (self.num_heads, self.head_dim, d),
            ("heads", "kv", "embed"),
            use_bias=self.use_bias,
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
        self, key: jax.Array, value: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None
    ):
        """Writes a [B, T] chunk at the cache index; returns full-length keys, values [B, S, K, H] and the mask.

        The first call (at init) sizes the cache from the chunk it sees: call `init` with a
        [B, max_decode_len] batch. Later chunks attend to every earlier valid key and causally
        within themselves.
        """
        del positions  # the cache index orders the keys
        batch, chunk = key.shape[:2]
        initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        cached_valid = self.variable("cache", "cached_valid", jnp.zeros, key.shape[:2], jnp.bool_)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
        valid = jnp.ones((batch, chunk), jnp.bool_) if segment_ids is None else segment_ids != 0
        if not initialized:
            return key, value, attention_mask(None, None, causal=False)
        index = cache_index.value
        length = cached_key.value.shape[1]
        cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, key, (0, index, 0, 0))
        cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, value, (0, index, 0, 0))
        cached_valid.value = jax.lax.dynamic_update_slice(cached_valid.value, valid, (0, index))
        cache_index.value = index + chunk
        query_pos = index + jnp.arange(chunk)
        causal = jnp.arange(length)[None, :] <= query_pos[:, None]
        mask = causal[None, None] & cached_valid.value[:, None, None, :]
        return cached_key.value, cached_value.value, mask

    def _update_rolling_cache(
        self, key: jax.Array, value: jax.Array, segment_ids: jax.Array | None, positions: jax.Array
    ):
        """Sliding-window decoding: the cache holds only the last W = sliding_window keys/values [B, W, K, H] (with
        their positions and validity), W positions of memory rather than max_decode_len. A [B, T] chunk attends to
        the cached keys and itself, by positions: causal and within the window; the newest W then stay cached."""
        batch, chunk = key.shape[:2]
        initialized = self.has_variable("cache", "cached_key")
        window = min(self.sliding_window, chunk)  # at init the chunk is [B, max_decode_len]
        cached_key = self.variable("cache", "cached_key", jnp.zeros, (batch, window) + key.shape[2:], key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, (batch, window) + key.shape[2:], value.dtype)
        cached_valid = self.variable("cache", "cached_valid", jnp.zeros, (batch, window), jnp.bool_)
        cached_positions = self.variable("cache", "cached_positions", jnp.zeros, (batch, window), jnp.int32)
        valid = jnp.ones((batch, chunk), jnp.bool_) if segment_ids is None else segment_ids != 0
        if not initialized:
            return key, value, attention_mask(None, None, causal=False)
        keys = jnp.concatenate([cached_key.value, key], axis=1)
        values = jnp.concatenate([cached_value.value, value], axis=1)
        key_valid = jnp.concatenate([cached_valid.value, valid], axis=1)
        key_positions = jnp.concatenate([cached_positions.value, positions.astype(jnp.int32)], axis=1)
        kept = cached_key.value.shape[1]
        cached_key.value, cached_value.value = keys[:, -kept:], values[:, -kept:]
        cached_valid.value, cached_positions.value = key_valid[:, -kept:], key_positions[:, -kept:]
        causal = (key_positions[:, None, :] <= positions[:, :, None])[:, None]
        in_window = sliding_window_mask(positions, key_positions, self.sliding_window)
        return keys, values, causal & in_window & key_valid[:, None, None, :]


class MlpBlock(nn.Module):
    """Position-wise feed-forward, D -> F -> D. Several activations give a gated unit (T5 v1.1).

    Attributes:
        mlp_dim: F.
        activations: one name per input projection, multiplied together (("gelu", "linear") = GeGLU).
    """

    mlp_dim: int
    activations: Sequence[str] = ("gelu",)
    use_bias: bool = True
    dropout_rate: float = 0.0
    kernel_init: Initializer = nn.initializers.normal(0.02)
    out_init: Initializer = nn.initializers.normal(0.02)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool) -> jax.Array:
        """x: [B, T, D] -> [B, T, D]."""
        d = x.shape[-1]
        proj = functools.partial(Einsum, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype)
        h = None
        for i, name in enumerate(self.activations):
            wi_name = "wi" if len(self.activations) == 1 else f"wi_{i}"
            a = activation(name)(
                proj((d, self.mlp_dim), ("embed", "mlp"), kernel_init=self.kernel_init, name=wi_name)("BTD,DF->BTF", x)
            )
            h = a if h is None else h * a
        h = sharding.constrain(h, ("act_batch", "act_len", "act_mlp"))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        return proj((self.mlp_dim, d), ("mlp", "embed"), kernel_init=self.out_init, name="wo")("BTF,FD->BTD", h)


class TransformerBlock(nn.Module):
    """Self-attention (+ cross-attention) + MLP with residuals; pre-norm (GPT-2, T5) or post-norm (GPT,
    BERT, BART). [B, T, D] -> [B, T, D].

    Attributes:
        causal: decoder self-attention.
        cross_attention: attend to `context` (encoder-decoder decoders).
        pre_norm: x + f(N(x)) if True, else N(x + f(x)).
        norm: "layer" (LayerNorm) or "rms" (T5: no mean, no bias).
        activations: of the MLP; two give a gated unit (T5 v1.1 gated GELU).
        attention_scale: logit scale (None: head_dim ** -0.5; T5 uses 1.0).
        residual_init_std: std of the output projections (GPT-2 scales it by 1/sqrt(2 L)).
        fan_in_init: T5's initialisation instead of init_std / residual_init_std: every kernel normal with
            std fan_in ** -0.5, queries (D H) ** -0.5 (T5 leaves the 1/sqrt(H) logit scale to the init).
        num_kv_heads, qkv_bias, rotary, sliding_window: of the self-attention (`Attention`).
    """

    num_heads: int
    head_dim: int
    mlp_dim: int
    causal: bool = False
    cross_attention: bool = False
    pre_norm: bool = True
    norm: str = "layer"
    activations: Sequence[str] = ("gelu",)
    use_bias: bool = True
    attention_scale: float | None = None
    layer_norm_epsilon: float = 1e-5
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    init_std: float = 0.02
    residual_init_std: float = 0.02
    fan_in_init: bool = False
    num_kv_heads: int | None = None
    qkv_bias: bool | None = None
    rotary: Rotary | None = None
    sliding_window: int | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array | None = None,
        bias: jax.Array | None = None,
        context: jax.Array | None = None,
        context_segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        *,
        deterministic: bool,
        decode: bool = False,
    ) -> jax.Array:
        """x [B, T, D]; bias [1|B, N, T, T] added to self-attention logits (T5 relative positions);
        context [B, S, D] with context_segment_ids [B, S] for cross-attention (decode steps after the first
        may pass context None: its keys/values are cached); positions [B, T] for rotary embeddings and the
        sliding window."""
        if self.norm not in ("layer", "rms"):
            raise ValueError(f"unknown norm {self.norm!r}; choose 'layer' or 'rms'")
        rms = self.norm == "rms"
        norm = functools.partial(
            LayerNorm,
            epsilon=self.layer_norm_epsilon,
            use_bias=self.use_bias and not rms,
            use_mean=not rms,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        d, heads_width = x.shape[-1], self.num_heads * self.head_dim
        if self.fan_in_init:
            std = {
                "kernel": d**-0.5,
                "query": (d * self.head_dim) ** -0.5,
                "attn_out": heads_width**-0.5,
                "mlp_out": self.mlp_dim**-0.5,
            }
        else:
            std = {
                "kernel": self.init_std,
                "query": self.init_std,
                "attn_out": self.residual_init_std,
                "mlp_out": self.residual_init_std,
            }
        normal = nn.initializers.normal
        attention = functools.partial(
            Attention,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            use_bias=self.use_bias,
            scale=self.attention_scale,
            dropout_rate=self.attention_dropout_rate,
            kernel_init=normal(std["kernel"]),
            query_init=normal(std["query"]),
            out_init=normal(std["attn_out"]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        mlp = MlpBlock(
            mlp_dim=self.mlp_dim,
            activations=tuple(self.activations),
            use_bias=self.use_bias,
            kernel_init=normal(std["kernel"]),
            out_init=normal(std["mlp_out"]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="mlp",
        )
        dropout = nn.Dropout(self.dropout_rate)

        def residual(x, norm_name, fn):
            if self.pre_norm:
                return x + dropout(fn(norm(name=norm_name)(x)), deterministic=deterministic)
            return norm(name=norm_name)(x + dropout(fn(x), deterministic=deterministic))

        x = sharding.constrain(x, ("act_batch", "act_len", "act_embed"))
        self_attention = attention(
            causal=self.causal,
            num_kv_heads=self.num_kv_heads,
            qkv_bias=self.qkv_bias,
            rotary=self.rotary,
            sliding_window=self.sliding_window,
            name="attn",
        )
        x = residual(
            x,
            "ln_attn",
            lambda h: self_attention(
                h, segment_ids=segment_ids, bias=bias, positions=positions, deterministic=deterministic, decode=decode
            ),
        )
        if self.cross_attention:
            cross = attention(cross=True, name="cross_attn")
            x = residual(
                x,
                "ln_cross",
                lambda h: cross(
                    h,
                    context,
                    segment_ids=segment_ids,
                    context_segment_ids=context_segment_ids,
                    deterministic=deterministic,
                    decode=decode,
                ),
            )
        return residual(x, "ln_mlp", lambda h: mlp(h, deterministic=deterministic))


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class BlockStack(nn.Module):
    """`num_layers` copies of `block`, looped in Python or with `nn.scan`, optionally rematerialised.

    The block is called as `block(x, *args, deterministic=..., decode=...)` and returns x. With
    `scan`, parameters gain a leading "layers" axis and compile time no longer grows with depth.
    With `share_params` (ALBERT) one block's parameters are applied num_layers times.

    Attributes:
        block: a module instance used as a template (cloned per layer).
        remat_policy: one of REMAT_POLICIES ("none" keeps every activation).
    """

    block: nn.Module
    num_layers: int
    scan: bool = False
    remat_policy: str = "none"
    share_params: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any, deterministic: bool, decode: bool = False) -> jax.Array:
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"unknown remat_policy {self.remat_policy!r}; choose one of {sorted(REMAT_POLICIES)}")
        block_cls = type(self.block)
        attrs = {f.name: getattr(self.block, f.name) for f in self.block.__dataclass_fields__.values() if f.init}
        attrs.pop("parent", None)
        attrs.pop("name", None)

        def apply(module, carry, *call_args):
            return module(carry, *call_args, deterministic=deterministic, decode=decode)

        body = nn.remat(apply, policy=REMAT_POLICIES[self.remat_policy]) if self.remat_policy != "none" else apply
        if self.share_params:
            shared = block_cls(**attrs, name="shared")
            for _ in range(self.num_layers):
                x = body(shared, x, *args)
            return x
        if not self.scan:
            for i in range(self.num_layers):
                x = body(block_cls(**attrs, name=f"layer_{i}"), x, *args)
            return x

        def scan_body(module, carry, _):
            return body(module, carry, *args), None

        scanned = nn.scan(
            scan_body,
            variable_axes={"params": 0, "cache": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = scanned(block_cls(**attrs, name="layers"), x, None)
        return x
