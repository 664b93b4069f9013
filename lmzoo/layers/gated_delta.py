"""Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024), the linear attention of Qwen3-Next and Qwen3.5.

Each value head n keeps a state S [H, P] (key width H, value width P) that every token t first decays and then
corrects towards its value by the delta rule, and reads with its query:

    S = exp(g_t) S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

with g_t = -exp(decay_rate) * softplus(a_t + decay_bias) <= 0 and beta_t = sigmoid(b_t) from projections of the token,
q and k L2-normalised (q also scaled by H ** -0.5), and q, k, v each passed through a causal depthwise convolution of
`conv_width` taps and a SiLU first. The output is RMS-normalised per head, gated by SiLU(z) (another projection) and
projected back to D. Key heads G may be fewer than value heads N: each key head serves N / G consecutive value heads.

`gated_delta_rule` computes the recurrence a chunk of positions at a time (the WY form of DeltaNet's chunkwise
training algorithm): within a chunk the corrections are one unit-lower-triangular solve, and a `lax.scan` carries the
state from chunk to chunk, so a length-T sequence costs T / C sequential steps. Decoding runs the same function on
chunks of one token, carrying (the last conv_width - 1 inputs of the convolution, S) in the "cache" collection.

Einsum letters here: B batch, T length, D emb_dim, G key heads, N value heads, H key width, P value width, C the
positions of a chunk (I and J two of them), M the chunks, W the convolution's taps, F the convolved channels
(2 G H + N P).
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import sharding
from lmzoo.layers.linears import Einsum, Initializer
from lmzoo.layers.norms import normalize

# The epsilon of the queries' and keys' L2 norms (the flash-linear-attention kernels' and HF's, not configurable).
L2_EPSILON = 1e-6


@dataclasses.dataclass(frozen=True)
class GatedDeltaConfig:
    """The fields of one Gated DeltaNet layer.

    Attributes:
        num_key_heads: G query/key heads.
        num_value_heads: N value heads (a multiple of G).
        key_dim: H, the width of a query/key head.
        value_dim: P, the width of a value head.
        conv_width: W taps of the causal depthwise convolution.
        norm_epsilon: of the output's per-head RMS norm.
        chunk_size: positions per step of the chunked recurrence (it changes rounding, not the result).
    """

    num_key_heads: int
    num_value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int = 4
    norm_epsilon: float = 1e-6
    chunk_size: int = 64

    def __post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"num_value_heads={self.num_value_heads} must be a multiple of num_key_heads={self.num_key_heads}"
            )
        if self.conv_width < 1 or self.chunk_size < 1:
            raise ValueError(f"conv_width={self.conv_width} and chunk_size={self.chunk_size} must be >= 1")


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / sqrt(|x|^2 + L2_EPSILON) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPSILON)


def document_starts(segment_ids: jax.Array | None) -> jax.Array | None:
    """[B, T] bool: the positions whose segment id differs from the previous position's (packed documents restart the
    recurrence there); None without segment ids."""
    if segment_ids is None:
        return None
    return jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))


def causal_conv(
    x: jax.Array, kernel: jax.Array, state: jax.Array | None = None, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Depthwise causal convolution: x [B, T, F], kernel [W, F] -> [B, T, F], out_t = sum_w kernel[w] x_{t-W+1+w}.

    state [B, W-1, F]: the inputs before x (decoding), else zeros. With segment_ids [B, T] a tap reads only positions of
    its own document (packed sequences); the state counts as the first position's document.
    """
    width, length = kernel.shape[0], x.shape[1]
    if state is None:
        state = jnp.zeros((x.shape[0], width - 1, x.shape[2]), x.dtype)
    padded = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, W-1+T, F]
    if segment_ids is not None:
        ids = jnp.concatenate([jnp.repeat(segment_ids[:, :1], width - 1, axis=1), segment_ids], axis=1)
    out = jnp.zeros(x.shape, jnp.float32)
    for w in range(width):
        tap = padded[:, w : w + length].astype(jnp.float32)
        if segment_ids is not None:
            tap = tap * (ids[:, w : w + length] == segment_ids)[..., None]
        out = out + tap * kernel[w].astype(jnp.float32)
    return out.astype(x.dtype)


def unit_lower_solve(system: jax.Array, rhs: jax.Array) -> jax.Array:
    """u with system u = rhs for unit-lower-triangular system [..., C, C] (what lies above its diagonal is ignored)
    and rhs [..., C, P], by matmuls alone: with X = -(system's strictly lower part), nilpotent (X^C = 0),
    system^-1 = sum_k X^k = (1 + X)(1 + X^2)(1 + X^4)..., ceil(log2 C) factors.

    Not `lax.linalg.triangular_solve`: XLA:CPU runs it as a LAPACK call, and the backward pass of this rule with it
    deadlocked on the default CPU pipeline (every thread idle, the step never finishing: a 16 x 64 Qwen3.5 train
    step's second call, a 1 x 256 one's first)."""
    x, u = -jnp.tril(system, -1), rhs
    factors = (system.shape[-1] - 1).bit_length()  # X^(2^i) for i < factors: every power below C
    for i in range(factors):
        u = u + x @ u
        if i + 1 < factors:
            x = x @ x
    return u


def gated_delta_rule(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    *,
    state: jax.Array | None = None,
    starts: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a sequence, chunk by chunk, in float32 (or the inputs' wider dtype).

    query, key [B, T, N, H] (normalised and scaled already, one per value head), value [B, T, N, P], decay g and beta
    [B, T, N]; state [B, N, H, P] before the first position (zeros if None); starts [B, T] bool: positions where the
    state is reset to zero before the update (document starts). Returns (outputs [B, T, N, P], final state).
    """
    batch, length, heads, key_dim = key.shape
    value_dim = value.shape[-1]
    size = min(chunk_size, length)
    pad = -length % size
    chunks = (length + pad) // size
    dtype = jnp.promote_types(jnp.float32, query.dtype)  # float32 at least
    query, key, value, decay, beta = (jnp.asarray(t, dtype) for t in (query, key, value, decay, beta))
    if starts is None:
        starts = jnp.zeros((batch, length), bool)

    def to_chunks(x):  # [B, T, N, ...] -> [B, N, M, C, ...] ([B, T] -> [B, M, C]); padding changes nothing
        heads_axis = x.ndim >= 3
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        x = x.reshape(batch, chunks, size, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1) if heads_axis else x

    # q, k [B, N, M, C, H], v [B, N, M, C, P], g, b [B, N, M, C]
    q, k, v, g, b = (to_chunks(t) for t in (query, key, value, decay, beta))
    reset = to_chunks(starts)[:, None]  # [B, 1, M, C]
    cum = jnp.cumsum(g, axis=-1)  # log of the decay from the chunk's start to each position, inclusive
    # Resets split a chunk into pieces: decays, reads and corrections never cross a reset.
    piece = jnp.cumsum(reset, axis=-1)  # [B, 1, M, C]
    same = piece[..., :, None] == piece[..., None, :]  # [.., I, J]
    causal = jnp.tril(jnp.ones((size, size), bool))
    pairwise = jnp.exp(jnp.where(causal & same, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [B, N, M, I, J]
    from_start = piece == 0  # the position still reads the state the chunk began with
    to_end = piece == piece[..., -1:]  # the position's update reaches the chunk's final state
    # The corrections of a chunk solve (1 + A) u = beta v, A[i, j] = beta_i (k_i . k_j) decay(j -> i) for j < i.
    eye = jnp.eye(size, dtype=dtype)
    system = b[..., None] * jnp.einsum("BNMIH,BNMJH->BNMIJ", k, k) * pairwise * (1.0 - eye) + eye
    corrections = unit_lower_solve(system, v * b[..., None])  # [B, N, M, C, P]
    state_reads = unit_lower_solve(system, k * (b * jnp.exp(cum) * from_start)[..., None])  # [B, N, M, C, H]
    attend = jnp.einsum("BNMIH,BNMJH->BNMIJ", q, k) * pairwise
    read_query = q * (jnp.exp(cum) * from_start)[..., None]
    write_key = k * (jnp.exp(cum[..., -1:] - cum) * to_end)[..., None]
    chunk_decay = jnp.exp(cum[..., -1]) * from_start[..., -1]  # [B, N, M]

    def step(s, xs):  # s [B, N, H, P]: the state before the chunk
        corrections, state_reads, attend, read_query, write_key, chunk_decay = xs
        new = corrections - jnp.einsum("BNCH,BNHP->BNCP", state_reads, s)
        out = jnp.einsum("BNCH,BNHP->BNCP", read_query, s) + jnp.einsum("BNIJ,BNJP->BNIP", attend, new)
        s = s * chunk_decay[..., None, None] + jnp.einsum("BNCH,BNCP->BNHP", write_key, new)
        return s, out

    if state is None:
        state = jnp.zeros((batch, heads, key_dim, value_dim), dtype)
    xs = (corrections, state_reads, attend, read_query, write_key, chunk_decay)
    state, out = jax.lax.scan(step, jnp.asarray(state, dtype), tuple(jnp.moveaxis(x, 2, 0) for x in xs))
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, chunks * size, value_dim)[:, :, :length]
    return out.swapaxes(1, 2), state  # [B, T, N, P]


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer: [B, T, D] -> [B, T, D], with its recurrent decode cache.

    Attributes:
        config: the heads, widths and convolution (`GatedDeltaConfig`).
    """

    config: GatedDeltaConfig
    kernel_init: Initializer = nn.initializers.normal(0.02)
    out_init: Initializer = nn.initializers.normal(0.02)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, *, segment_ids: jax.Array | None = None, deterministic: bool = True, decode: bool = False
    ) -> jax.Array:
        """x: [B, T, D] -> [B, T, D].

        segment_ids [B, T]: document ids, 0 = padding. A padding position's input is zeroed (as HF's models do), so
        left padding leaves the state at zero; a new document restarts the convolution and the state. In decode mode
        x is the next chunk of the sequence and the state continues from the "cache" collection (a row whose chunk is
        all padding keeps its state).
        """
        del deterministic  # no dropout inside the mixer
        cfg = self.config
        d, (g_heads, n_heads, h, p) = x.shape[-1], (cfg.num_key_heads, cfg.num_value_heads, cfg.key_dim, cfg.value_dim)
        batch, length = x.shape[:2]
        if segment_ids is not None:
            x = x * (segment_ids != 0)[..., None].astype(x.dtype)
        proj = functools.partial(Einsum, kernel_init=self.kernel_init, dtype=self.dtype, param_dtype=self.param_dtype)
        query = proj((d, g_heads, h), ("embed", "kv_heads", "kv"), name="query")("BTD,DGH->BTGH", x)
        key = proj((d, g_heads, h), ("embed", "kv_heads", "kv"), name="key")("BTD,DGH->BTGH", x)
        value = proj((d, n_heads, p), ("embed", "heads", "kv"), name="value")("BTD,DNP->BTNP", x)
        gate = proj((d, n_heads, p), ("embed", "heads", "kv"), name="gate")("BTD,DNP->BTNP", x)
        write = proj((d, n_heads), ("embed", "heads"), name="beta")("BTD,DN->BTN", x)
        a = proj((d, n_heads), ("embed", "heads"), name="decay")("BTD,DN->BTN", x)

        conv_param = lambda name, axis, heads, width: self.param(  # noqa: E731
            name,
            nn.with_logical_partitioning(nn.initializers.normal(cfg.conv_width**-0.5), ("position", axis, "kv")),
            (cfg.conv_width, heads, width),
            self.param_dtype,
        )
        conv_kernel = jnp.concatenate(
            [
                conv_param("query_conv", "kv_heads", g_heads, h).reshape(cfg.conv_width, -1),
                conv_param("key_conv", "kv_heads", g_heads, h).reshape(cfg.conv_width, -1),
                conv_param("value_conv", "heads", n_heads, p).reshape(cfg.conv_width, -1),
            ],
            axis=1,
        )  # [W, F]
        decay_bias = self.param(
            "decay_bias", nn.with_logical_partitioning(nn.initializers.ones, ("heads",)), (n_heads,), self.param_dtype
        )
        decay_rate = self.param(  # log of the rate A, A uniform in [1, 16] at init (Mamba 2's range)
            "decay_rate",
            nn.with_logical_partitioning(
                lambda rng, shape, dtype=jnp.float32: jnp.log(jax.random.uniform(rng, shape, dtype, 1.0, 16.0)),
                ("heads",),
            ),
            (n_heads,),
            self.param_dtype,
        )
        norm_scale = self.param(
            "norm", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (p,), self.param_dtype
        )

        mixed = jnp.concatenate(
            [query.reshape(batch, length, -1), key.reshape(batch, length, -1), value.reshape(batch, length, -1)],
            axis=-1,
        )  # [B, T, F]
        conv_state = recurrent_state = None
        if decode:
            initialized = self.has_variable("cache", "conv_state")
            conv_cache = self.variable(
                "cache", "conv_state", jnp.zeros, (batch, cfg.conv_width - 1, mixed.shape[-1]), mixed.dtype
            )
            state_cache = self.variable("cache", "recurrent_state", jnp.zeros, (batch, n_heads, h, p), jnp.float32)
            if initialized:
                conv_state, recurrent_state = conv_cache.value, state_cache.value
        starts = None if decode and segment_ids is None else document_starts(segment_ids)
        if decode and starts is not None:  # a chunk continues its row's sequence: no reset at its first position
            starts = starts.at[:, 0].set(False)
        convolved = nn.silu(causal_conv(mixed, conv_kernel.astype(self.dtype), conv_state, segment_ids))
        query, key, value = jnp.split(convolved, [g_heads * h, 2 * g_heads * h], axis=-1)
        repeat = n_heads // g_heads  # each key head serves `repeat` consecutive value heads
        query = jnp.repeat(l2_normalize(query.reshape(batch, length, g_heads, h)), repeat, axis=2) * h**-0.5
        key = jnp.repeat(l2_normalize(key.reshape(batch, length, g_heads, h)), repeat, axis=2)
        value = value.reshape(batch, length, n_heads, p)
        decay = -jnp.exp(decay_rate.astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + decay_bias.astype(jnp.float32)
        )
        out, final_state = gated_delta_rule(
            query,
            key,
            value,
            decay,
            jax.nn.sigmoid(write.astype(jnp.float32)),
            state=recurrent_state,
            starts=starts,
            chunk_size=cfg.chunk_size,
        )
        if decode and conv_state is not None:
            keep = jnp.ones((batch,), bool) if segment_ids is None else jnp.any(segment_ids != 0, axis=1)
            history = jnp.concatenate([conv_state, mixed], axis=1)
            history = history[:, history.shape[1] - (cfg.conv_width - 1) :]  # the last W - 1 inputs
            conv_cache.value = jnp.where(keep[:, None, None], history, conv_state)
            state_cache.value = jnp.where(keep[:, None, None, None], final_state, recurrent_state)
        out = sharding.constrain(out.astype(self.dtype), ("act_batch", "act_len", "act_heads", "act_kv"))
        # Per-head RMS norm of the output, then the SiLU gate (HF's RMSNormGated: scale in the activation dtype).
        out = normalize(out, norm_scale, cfg.norm_epsilon, False) * nn.silu(gate.astype(jnp.float32))
        return Einsum(
            (n_heads, p, d),
            ("heads", "kv", "embed"),
            kernel_init=self.out_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="out",
        )("BTNP,NPD->BTD", out.astype(self.dtype))
