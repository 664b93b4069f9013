"""Token embeddings and positions: `Embed` (with `attend` for tied heads), learned-table length checks,
sinusoidal positions and rotary embeddings.
"""

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Rotary:
    """Rotary position embeddings (Su et al.) in HF's rotate-half layout: dims i and i + H/2 rotate together.

    theta: the base (`rope_theta`). scaling: Llama 3's "llama3" frequency scaling as (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings), or None. linear_factor: HF's "linear" scaling (Gemma 3's
    global layers): every frequency divided by it, so positions advance that many times slower; 1 is none.
    """

    theta: float = 10_000.0
    scaling: tuple[float, float, float, int] | None = None
    linear_factor: float = 1.0

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        """[H / 2] float32 angular speeds, as HF's rope initialisation computes them."""
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
        layers of one stack rotate differently (Gemma 3's local and global layers); traced in a scanned stack."""
        if frequencies is None:
            frequencies = self.inverse_frequencies(head_dim)
        if positions is None:
            if kernels.on_cpu() and isinstance(frequencies, np.ndarray):
                return cpu.rotation_tables(tuple(frequencies.tolist()), length)
            positions = jnp.arange(length)[None]
        angles = positions[..., None].astype(jnp.float32) * frequencies  # [B, T, H/2]
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
