"""Token embeddings and positions: `Embed` (with `attend` for tied heads), learned-table length checks,
sinusoidal positions and rotary embeddings (with Llama 3's, linear or YaRN's scaling: `Yarn`, which DeepSeek's latent
attention uses too).
"""

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import kernels, sharding
from lmzoo.kernels import cpu
from lmzoo.layers.linears import Einsum, Initializer, project


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


def output_logits(
    x: jax.Array,
    table: Embed,
    *,
    tied: bool,
    kernel_init: Initializer | None = None,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
) -> jax.Array:
    """A decoder's logits [B, T, V] from its final hidden states x [B, T, D]: the token table read backwards when
    `tied`, else an "lm_head" projection [D, V] of the calling module (kernel_init: normal(0.02) when None). Call it
    inside a model's compact method."""
    if tied:
        logits = table.attend(x)
    else:
        logits = Einsum(
            (table.features, table.num_embeddings),
            ("embed", "vocab"),
            kernel_init=kernel_init or nn.initializers.normal(0.02),
            dtype=dtype,
            param_dtype=param_dtype,
            name="lm_head",
        )("BTD,DV->BTV", x)
    return sharding.constrain(logits, ("act_batch", "act_len", "act_vocab"))


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN context stretching (Peng et al. 2023) as HF computes it ("yarn" rope_parameters).

    Attributes:
        factor: how many times longer than original_max_len the context is.
        original_max_len: the pretraining context.
        beta_fast, beta_slow: the rotations bounding the ramp between extrapolated and interpolated frequencies.
        mscale, mscale_all_dim: the rotation tables are scaled by yarn_mscale(factor, mscale) /
            yarn_mscale(factor, mscale_all_dim) (both given) or yarn_mscale(factor); 0 means not given.
            mscale_all_dim also scales the logits by yarn_mscale(factor, mscale_all_dim) ** 2 (DeepSeek's softmax
            scale).
        attention_factor: the tables' scale as given (0: derived from the mscales).
        truncate: round the ramp's bounds to whole dimensions.
    """

    factor: float
    original_max_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0
    truncate: bool = True

    def inverse_frequencies(self, theta: float, head_dim: int) -> np.ndarray:
        """[head_dim / 2] float32: interpolated (divided by factor) below the ramp, extrapolated above it."""
        exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
        extrapolated = 1.0 / np.float32(theta) ** exponents
        interpolated = 1.0 / (np.float32(self.factor) * np.float32(theta) ** exponents)

        def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
            return head_dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extrapolation = 1 - ramp
        return (interpolated * (1 - extrapolation) + extrapolated * extrapolation).astype(np.float32)

    @property
    def table_scale(self) -> float:
        if self.attention_factor:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def logit_scale(self) -> float:
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


@dataclasses.dataclass(frozen=True)
class Rotary:
    """Rotary position embeddings (Su et al.) in HF's rotate-half layout: dims i and i + H/2 rotate together.

    theta: the base (`rope_theta`). scaling: Llama 3's "llama3" frequency scaling as (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings), or None. linear_factor: HF's "linear" scaling (Gemma 3's
    global layers): every frequency divided by it, so positions advance that many times slower; 1 is none.
    yarn: YaRN's frequencies and its scale of the cos/sin tables (`Yarn.table_scale`, which scales queries and keys
    alike: the logits by its square), in place of the others (gpt-oss); None: none.
    fraction: the leading int(H * fraction) dimensions of each head rotate (rotate-half among themselves), the rest
    pass unchanged (HF's partial_rotary_factor: Qwen3-Next and Qwen3.5 rotate a quarter); 1 rotates all.
    """

    theta: float = 10_000.0
    scaling: tuple[float, float, float, int] | None = None
    linear_factor: float = 1.0
    yarn: Yarn | None = None
    fraction: float = 1.0

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        """[H / 2] float32 angular speeds, as HF's rope initialisation computes them."""
        if self.yarn is not None:
            return self.yarn.inverse_frequencies(self.theta, head_dim)
        inv_freq = 1.0 / self.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
        if self.linear_factor != 1.0:
            inv_freq = inv_freq / np.float32(self.linear_factor)
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
        self,
        positions: jax.Array | None,
        head_dim: int,
        length: int | None = None,
        frequencies: np.ndarray | jax.Array | None = None,
    ) -> tuple[jax.Array | np.ndarray, jax.Array | np.ndarray]:
        """positions [B, T], or None for 0..length-1 -> (cos, sin), each [B or 1, T, 1, H] float32.

        frequencies [H / 2]: a layer's own inverse frequencies in place of `inverse_frequencies(head_dim)`, where the
        layers of one stack rotate differently (Gemma 3's local and global layers); traced in a scanned stack. YaRN's
        table scale applies to every layer's tables."""
        if frequencies is None:
            frequencies = self.inverse_frequencies(int(head_dim * self.fraction))
        if positions is None and kernels.on_cpu() and isinstance(frequencies, np.ndarray):
            tables = cpu.rotation_tables(tuple(frequencies.tolist()), length)
        else:
            if positions is None:
                positions = jnp.arange(length)[None]
            angles = positions[..., None].astype(jnp.float32) * frequencies  # [B, T, H/2]
            angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
            tables = jnp.cos(angles), jnp.sin(angles)
        if self.yarn is None or self.yarn.table_scale == 1.0:
            return tables
        return tuple(table * np.float32(self.yarn.table_scale) for table in tables)

    def __call__(self, x: jax.Array, rotation: tuple[jax.Array, jax.Array]) -> jax.Array:
        """x [B, T, N, H] rotated by `rotation(positions, H)`; applied in x's dtype (as HF)."""
        cos, sin = (table.astype(x.dtype) for table in rotation)
        if cos.shape[-1] < x.shape[-1]:  # a partial rotation: the tables cover the leading dimensions
            rotated = cos.shape[-1]
            return jnp.concatenate([self(x[..., :rotated], rotation), x[..., rotated:]], axis=-1)
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
