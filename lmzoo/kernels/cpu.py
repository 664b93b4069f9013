"""CPU forms of the building blocks: the same maths as the plain forms in `lmzoo.layers`, written for XLA:CPU.

Each exists because XLA:CPU was measurably slow at the plain form (docs/notes/cpu-speed.md); `lmzoo.kernels`
chooses them only when the mesh's platform is the CPU, so a GPU/TPU program is plain Flax, `jnp.einsum` and
`jax.nn.dot_product_attention`.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.custom_jvp
def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, x * Phi(x), written with erf and a hand-written derivative (same values as
    `jax.nn.gelu(approximate=False)` to float32 rounding).

    jax.nn.gelu's exact form goes through erfc, whose XLA:CPU expansion (two polynomial branches and
    a select) is recomputed in each fusion that needs it; with its automatic derivative the GELU of
    one MLP took three loop fusions (~17% of the op time of the Shakespeare-char forward+backward,
    docs/RESULTS.md "Speed on CPU"). erf is a single rational polynomial, and the derivative
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
    """Rotary (cos, sin) of positions 0..length-1, each [1, T, 1, H] float32 (`layers.Rotary.rotation`), as numpy
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


CAUSAL_SPLIT_MIN_LEN = 256  # CPU: causal self-attention this long skips its masked upper-right quarter


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
    """q [B, T, N, H], k/v [B, S, N, H] -> [B, T, N, H], computed explicitly with the heads before the positions.

    The form for the CPU, and wherever attention dropout needs the probabilities. XLA:CPU lowers the
    [B, T, N, H] einsums with transposes inside fusions; this form's forward+backward measured ~1.9x faster at
    B 12, T 64, N 4, H 32. Causal self-attention of CAUSAL_SPLIT_MIN_LEN positions or more is computed in two
    query halves, the first against the first half of the keys only: a quarter of the scores, all masked, are
    never computed.
    """
    use_dropout = dropout_rng is not None and dropout_rate > 0.0
    length = query.shape[1]
    plain_causal = is_causal and mask is None and bias is None and not use_dropout and length == key.shape[1]
    if plain_causal and length >= CAUSAL_SPLIT_MIN_LEN and length % 2 == 0:
        half = length // 2  # the first half's queries see only the first half of the keys
        kwargs = dict(mask=None, bias=None, is_causal=True, scale=scale, dropout_rate=0.0, dropout_rng=None)
        first = dot_product_attention(query[:, :half], key[:, :half], value[:, :half], **kwargs)
        second = dot_product_attention(query[:, half:], key, value, **kwargs)
        return jnp.concatenate([first, second], axis=1)
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
    probs = jax.nn.softmax(logits, axis=-1)
    if use_dropout:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    return jnp.swapaxes(jnp.einsum("BNTS,BNSH->BNTH", probs.astype(value.dtype), value), 1, 2)  # [B, T, N, H]
