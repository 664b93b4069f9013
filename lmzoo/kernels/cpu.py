"""CPU forms of the building blocks: the same maths as the plain forms in `lmzoo.layers`, written for XLA:CPU.

Each exists because XLA:CPU was measurably slow at the plain form (docs/notes/cpu-speed.md); `lmzoo.kernels`
chooses them only when the mesh's platform is the CPU, so a GPU/TPU program is plain Flax, `jnp.einsum` and
`jax.nn.dot_product_attention`.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

UNROLLED_THREEFRY_MIN_SIZE = 1 << 16  # draws of this many numbers or more are hashed unrolled on the CPU


def lower_threefry_unrolled() -> None:
    """Lowers JAX's threefry2x32 hash (every `jax.random` draw: parameter init, dropout, sampling) of
    UNROLLED_THREEFRY_MIN_SIZE numbers or more on the CPU as it is lowered on GPUs and TPUs: its 20 rounds unrolled
    into one elementwise program. JAX's CPU lowering rolls them into a loop of 5 iterations (for compile time), which
    writes and reads both 32-bit words of every draw at each iteration: several times slower for a large draw, with
    the same bits. Smaller draws keep the loop, where unrolling each call site would cost more compile time than it
    saves (docs/notes/cpu-speed.md). A JAX without these internals keeps its own lowering."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32
    except ImportError:
        return
    unrolled = getattr(threefry2x32, "_threefry2x32_lowering_rule", None)
    rolled = getattr(threefry2x32, "_threefry2x32_cpu_lowering_rule", None)
    if unrolled is None or rolled is None:
        return

    def rule(ctx, *operands):
        shape = ctx.avals_out[0].shape  # (a symbolic dimension: the loop)
        large = all(isinstance(d, int) for d in shape) and math.prod(shape) >= UNROLLED_THREEFRY_MIN_SIZE
        return (unrolled if large else rolled)(ctx, *operands)

    mlir.register_lowering(threefry2x32.threefry2x32_p, rule, platform="cpu")


@jax.custom_jvp
def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, x * Phi(x), written with erf and a hand-written derivative (same values as
    `jax.nn.gelu(approximate=False)` to float32 rounding).

    jax.nn.gelu's exact form goes through erfc, whose XLA:CPU expansion (two polynomial branches and
    a select) is recomputed in each fusion that needs it; with its automatic derivative the GELU of
    one MLP took three loop fusions (~17% of the op time of the Shakespeare-char forward+backward,
    docs/notes/cpu-speed.md). erf is a single rational polynomial, and the derivative
    Phi(x) + x phi(x) shares it.
    """
    return x * _normal_cdf(x)


def _normal_cdf(x: jax.Array) -> jax.Array:
    return 0.5 + 0.5 * jax.lax.erf(x * np.asarray(0.5**0.5, x.dtype))


@gelu.defjvp
def _gelu_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[jax.Array, jax.Array]:
    (x,), (x_dot,) = primals, tangents
    cdf = _normal_cdf(x)
    pdf = jnp.exp(-0.5 * jnp.square(x)) * np.asarray((2 * np.pi) ** -0.5, x.dtype)
    return x * cdf, (cdf + x * pdf) * x_dot


def project(eqn: str, x: jax.Array, kernel: jax.Array, **dot_kwargs: Any) -> jax.Array:
    """`jnp.einsum(eqn, x, kernel)` for a projection, computed as one 2-D matmul.

    A projection contracts the trailing letters of x with the leading (or trailing) letters of the
    kernel and keeps the rest in order: "BTD,DNH->BTNH", "BTNH,NHD->BTD", "BTD,VD->BTV". Flattening
    to [B*T, D] x [D, N*H] matters on CPU: for the 3-D einsum, XLA computes the kernel gradient
    (a dot contracting B and T) by transposing the activation gradient inside the elementwise
    fusion that produces it (e.g. the GELU backward), a strided loop that made backward ~4.5x
    forward. Other equations go to `jnp.einsum`. dot_kwargs: e.g. preferred_element_type.
    """
    in_spec, out_spec = eqn.replace(" ", "").split("->")
    x_spec, kernel_spec = in_spec.split(",")
    contracted = "".join(c for c in x_spec if c in kernel_spec and c not in out_spec)
    x_free, kernel_free = x_spec[: len(x_spec) - len(contracted)], kernel_spec.replace(contracted, "", 1)
    kernel_axis = {contracted + kernel_free: 0, kernel_free + contracted: 1}.get(kernel_spec)
    if not contracted or kernel_axis is None or x_spec != x_free + contracted or out_spec != x_free + kernel_free:
        return jnp.einsum(eqn, x, kernel, **dot_kwargs)
    depth = int(np.prod(x.shape[len(x_free) :]))
    kernel_free_shape = tuple(n for n, c in zip(kernel.shape, kernel_spec, strict=True) if c in kernel_free)
    kernel = kernel.reshape((depth, -1) if kernel_axis == 0 else (-1, depth))  # [D, N*H] or [V, D]
    y = jax.lax.dot_general(x.reshape(-1, depth), kernel, (((1,), (kernel_axis,)), ((), ())), **dot_kwargs)
    return y.reshape(x.shape[: len(x_free)] + kernel_free_shape)  # [B*T, N*H] -> [B, T, N, H]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def normalize(x: jax.Array, scale: jax.Array, epsilon: float, use_mean: bool) -> jax.Array:
    """(x - mean) / sqrt(var + epsilon) * scale over the last axis, in float32 (RMS norm without the mean).

    x [..., D], scale [D] -> float32 [..., D]. The derivative is written out (`_normalize_jvp`: two row
    means for the input, the normalised input for the scale) and its transpose is the backward pass: the
    automatic one took several more reductions and elementwise passes, 1.6x slower fwd+bwd for a stack
    of 8 norms at [12, 64, 128] on CPU. Forward and reverse mode both work (a custom JVP).
    """
    x_hat, _ = _standardize(x, epsilon, use_mean)
    return x_hat * scale.astype(jnp.float32)


def _standardize(x: jax.Array, epsilon: float, use_mean: bool) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (x_hat [..., D] float32, inv_std [..., 1])."""
    x32 = x.astype(jnp.float32)
    if use_mean:
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    inv_std = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon)
    return x32 * inv_std, inv_std


@normalize.defjvp
def _normalize_jvp(epsilon, use_mean, primals, tangents):
    (x, scale), (x_dot, scale_dot) = primals, tangents
    x_hat, inv_std = _standardize(x, epsilon, use_mean)
    scale32 = scale.astype(jnp.float32)
    centred_dot = x_dot.astype(jnp.float32)
    if use_mean:
        centred_dot = centred_dot - jnp.mean(centred_dot, axis=-1, keepdims=True)
    x_hat_dot = inv_std * (centred_dot - x_hat * jnp.mean(x_hat * centred_dot, axis=-1, keepdims=True))
    return x_hat * scale32, x_hat_dot * scale32 + x_hat * scale_dot.astype(jnp.float32)


@functools.lru_cache(maxsize=32)
def rotation_tables(inverse_frequencies: tuple[float, ...], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Rotary (cos, sin) of positions 0..length-1, each [1, T, 1, H] float32 (`layers.embeddings.Rotary.rotation`), as numpy
    constants: one read-only object per argument, which every layer's program shares.

    Computed with jnp, XLA fuses the cos and sin into each consumer and evaluates them once per head and again in the
    backward pass: ~5% of a Llama train step. inverse_frequencies: the H / 2 float32 speeds (exact as floats).
    """
    angles = np.arange(length, dtype=np.float32)[None, :, None] * np.asarray(inverse_frequencies, np.float32)
    angles = np.concatenate([angles, angles], axis=-1)[:, :, None, :]
    tables = np.cos(angles), np.sin(angles)
    for table in tables:
        table.setflags(write=False)
    return tables


GROUP_BLOCK = 128  # rows per block of `grouped_matmul`: fewest padding rows and kernel copies at M = 4096, E = 8


def grouped_matmul(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, D] with rows sorted by group, kernel [E, D, F], group_sizes [E] summing to M -> [M, F], as
    `jax.lax.ragged_dot`: each row times its group's kernel.

    XLA:CPU computes ragged_dot as one dense product of every row with every group's kernel, masked ([E, M, D]
    operands, E times the work: 21x a dense matmul of the same rows at M = 4,096, D = 256, F = 512, E = 8). Here each
    group's rows are padded to whole blocks of GROUP_BLOCK rows, so that a block belongs to one group, and the blocks
    are multiplied by their group's kernel in one batched matmul ([G, GROUP_BLOCK, D] x [G, D, F], G = M // block + E
    blocks, a static bound): at most E * (block - 1) padding rows, and one copy of a kernel per block. With no more
    rows than groups (decoding a few tokens) each row is multiplied by its own group's kernel, gathered: E blocks of
    padding would be most of the work."""
    m, d = x.shape
    e, _, f = kernel.shape
    if m <= e:
        row_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right"), e - 1)
        return jnp.einsum("MD,MDF->MF", x, jnp.take(kernel, row_group, axis=0))
    blocks = m // GROUP_BLOCK + e
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded_sizes = (group_sizes + GROUP_BLOCK - 1) // GROUP_BLOCK * GROUP_BLOCK
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes
    place = jnp.arange(blocks * GROUP_BLOCK)  # a row of the padded blocks, its group and its source row
    group = jnp.minimum(jnp.searchsorted(padded_ends, place, side="right"), e - 1)
    offset = place - padded_starts[group]
    filled = (offset < group_sizes[group]) & (place < padded_ends[-1])
    padded = jnp.where(filled[:, None], jnp.take(x, jnp.where(filled, starts[group] + offset, 0), axis=0), 0)
    out = jnp.einsum(
        "GMD,GDF->GMF", padded.reshape(blocks, GROUP_BLOCK, d), jnp.take(kernel, group[::GROUP_BLOCK], axis=0)
    )  # M: a block's rows
    row = jnp.arange(m)
    row_group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), e - 1)
    return jnp.take(out.reshape(-1, f), padded_starts[row_group] + row - starts[row_group], axis=0)
