"""Encoder-decoders: T5 (v1.0, v1.1), BART and the original Transformer as switches of one module.

    T5 v1.0     relative position bias (bucketed; bidirectional in the encoder, causal in the decoder;
                one table per stack, shared by its layers), pre-norm RMS norm without bias, no absolute
                positions, unscaled attention logits, ReLU MLP, head tied to the embedding with the
                decoder output scaled by emb_dim ** -0.5.
    T5 v1.1     as v1.0 with gated GELU (activations ("gelu_tanh", "linear")) and an untied head.
    BART        learned positions offset by 2, post-LN with an embedding LayerNorm, GELU, biases,
                tied head plus final_logits_bias.
    Transformer Vaswani et al.: sinusoidal positions, embeddings scaled by sqrt(emb_dim), post-LN, ReLU.

Entry points: `encode(inputs)` -> [B, S, D]; `decode(decoder_inputs, encoded)` -> logits [B, T, V]
(with `decode=True` one chunk at a time against the KV cache); `__call__` does both.
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import sharding
from lmzoo.layers import attention, blocks, embeddings, linears, mlp, norms
from lmzoo.models import kinds

POSITIONS = ("relative", "learned", "sinusoidal")
INIT_SCHEMES = ("t5", "normal")


@dataclasses.dataclass(frozen=True)
class Seq2SeqConfig:
    """Encoder-decoder hyper-parameters; the field names are exactly the keys of `config.model`."""

    vocab_size: int = 32128
    emb_dim: int = 512
    num_heads: int = 8
    head_dim: int = 64
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    mlp_dim: int = 2048
    activations: Sequence[str] = ("relu",)
    positions: str = "relative"
    max_len: int = 512  # learned / sinusoidal position table size
    position_offset: int = 0  # BART: 2
    relative_buckets: int = 32
    relative_max_distance: int = 128
    pre_norm: bool = True
    norm: str = "rms"
    use_bias: bool = False
    embedding_norm: bool = False  # BART's layernorm_embedding
    scale_embeddings: bool = False  # multiply embeddings by sqrt(emb_dim)
    embedding_init_std: float = 1.0  # T5 1.0; BART / Transformer 0.02
    init_scheme: str = (
        "t5"  # "t5": kernels std fan_in ** -0.5 (queries (D H) ** -0.5, untied head 1.0); "normal": std 0.02
    )
    tie_embeddings: bool = True
    scale_tied_logits: bool = True  # T5: decoder output * emb_dim ** -0.5 before the tied head
    final_logits_bias: bool = False  # BART
    attention_scale: float = 1.0  # T5 1.0; 0 means head_dim ** -0.5
    layer_norm_epsilon: float = 1e-6
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    decoder_start_id: int = 0  # T5: pad; BART: eos (</s>)
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat_policy: str = "none"

    def __post_init__(self):
        kinds.check_fields(
            self,
            sizes=(
                "vocab_size",
                "emb_dim",
                "num_heads",
                "head_dim",
                "num_encoder_layers",
                "num_decoder_layers",
                "mlp_dim",
                "max_len",
                "relative_buckets",
                "relative_max_distance",
            ),
            counts=("position_offset", "decoder_start_id", "attention_scale"),
            positive=("embedding_init_std", "layer_norm_epsilon"),
            rates=("dropout_rate", "attention_dropout_rate"),
        )
        object.__setattr__(self, "activations", tuple(self.activations))
        if self.positions not in POSITIONS:
            raise ValueError(f"unknown positions {self.positions!r}; choose one of {POSITIONS}")
        if self.init_scheme not in INIT_SCHEMES:
            raise ValueError(f"unknown init_scheme {self.init_scheme!r}; choose one of {INIT_SCHEMES}")
        for name in self.activations:
            mlp.activation(name)


def distance_buckets(num_buckets: int, max_distance: int) -> np.ndarray:
    """T5's bucket of each distance in one direction -> [max(max_distance, num_buckets // 2) + 1] int32; the last
    entry is also the bucket of every longer distance.

    Distances below max_exact = num_buckets // 2 get a bucket each; a larger distance d gets
    max_exact + k for the largest k < n = num_buckets - max_exact with
        log(d / max_exact) / log(max_distance / max_exact) * n >= k,
    decided on Python integers as d^n max_exact^k >= max_distance^k max_exact^n. A distance exactly on
    a bucket boundary thus starts the upper bucket; float32 logs (on device, or in HF's torch code) round
    some of those into the lower one. With max_distance <= max_exact, every distance from max_exact on is
    in the last bucket (HF's formula flips sign there and counts buckets down until it leaves the table).
    """
    max_exact = num_buckets // 2
    if max_exact < 1:
        raise ValueError(f"T5 relative positions need at least 2 buckets per direction; got num_buckets={num_buckets}")
    n = num_buckets - max_exact

    def bucket(d: int) -> int:
        if d < max_exact:
            return d
        return max_exact + sum(d**n * max_exact**k >= max_distance**k * max_exact**n for k in range(1, n))

    return np.array([bucket(d) for d in range(max(max_distance, max_exact) + 1)], np.int32)


def relative_position_bucket(
    relative_position: jax.Array, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> jax.Array:
    """T5's bucketing of key - query offsets [...] -> bucket ids [...]: one bucket per small distance,
    logarithmic up to max_distance, the last bucket beyond; bidirectional halves the buckets between
    keys before and after the query. The buckets are looked up in a host table (`distance_buckets`)."""
    if bidirectional:
        num_buckets //= 2
        direction = jnp.where(relative_position > 0, num_buckets, 0)
        distance = jnp.abs(relative_position)
    else:
        direction = 0
        distance = -jnp.minimum(relative_position, 0)
    table = distance_buckets(num_buckets, max_distance)
    return direction + jnp.asarray(table)[jnp.minimum(distance, len(table) - 1)]


class RelativePositionBias(nn.Module):
    """Learned per-head bias of bucketed offsets: (query [B, T], key [S] positions) -> [B, N, T, S]."""

    num_heads: int
    num_buckets: int
    max_distance: int
    bidirectional: bool
    init_std: float = 0.02
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), ("relpos_buckets", "heads")),
            (self.num_buckets, self.num_heads),
            self.param_dtype,
        )
        offsets = key_positions[None, None, :] - query_positions[:, :, None]
        buckets = relative_position_bucket(
            offsets, bidirectional=self.bidirectional, num_buckets=self.num_buckets, max_distance=self.max_distance
        )
        return jnp.transpose(table[buckets], (0, 3, 1, 2))


class Seq2Seq(nn.Module):
    """Encoder-decoder LM. config: Seq2SeqConfig."""

    kind: ClassVar[str] = kinds.ENCODER_DECODER

    config: Seq2SeqConfig

    def setup(self):
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = embeddings.Embed(
            cfg.vocab_size,
            cfg.emb_dim,
            embedding_init=nn.initializers.normal(cfg.embedding_init_std),
            dtype=dtype,
            param_dtype=param_dtype,
        )
        norm = functools.partial(
            norms.LayerNorm,
            epsilon=cfg.layer_norm_epsilon,
            use_bias=cfg.norm == "layer" and cfg.use_bias,
            use_mean=cfg.norm == "layer",
            dtype=dtype,
            param_dtype=param_dtype,
        )
        block = functools.partial(
            blocks.TransformerBlock,
            attention.AttentionConfig(
                cfg.num_heads,
                cfg.head_dim,
                use_bias=cfg.use_bias,
                scale=cfg.attention_scale or None,
                dropout_rate=cfg.attention_dropout_rate,
            ),
            mlp_dim=cfg.mlp_dim,
            pre_norm=cfg.pre_norm,
            norm=cfg.norm,
            activations=cfg.activations,
            use_bias=cfg.use_bias,
            layer_norm_epsilon=cfg.layer_norm_epsilon,
            dropout_rate=cfg.dropout_rate,
            fan_in_init=cfg.init_scheme == "t5",
            dtype=dtype,
            param_dtype=param_dtype,
        )
        stack = functools.partial(blocks.BlockStack, scan=cfg.scan_layers, remat_policy=cfg.remat_policy)
        self.encoder = stack(block(), cfg.num_encoder_layers)
        self.decoder = stack(block(causal=True, cross_attention=True), cfg.num_decoder_layers)
        if cfg.positions == "relative":
            relpos = functools.partial(
                RelativePositionBias,
                cfg.num_heads,
                cfg.relative_buckets,
                cfg.relative_max_distance,
                init_std=cfg.emb_dim**-0.5 if cfg.init_scheme == "t5" else 0.02,
                param_dtype=param_dtype,
            )
            self.encoder_relpos = relpos(bidirectional=True)
            self.decoder_relpos = relpos(bidirectional=False)
        elif cfg.positions == "learned":
            table = functools.partial(
                embeddings.Embed,
                cfg.max_len,
                cfg.emb_dim,
                axes=("position", "embed"),
                dtype=dtype,
                param_dtype=param_dtype,
            )
            self.encoder_positions, self.decoder_positions = table(), table()
        if cfg.embedding_norm:
            self.encoder_embed_norm, self.decoder_embed_norm = norm(), norm()
        if cfg.pre_norm:
            self.encoder_final_norm, self.decoder_final_norm = norm(), norm()
        if not cfg.tie_embeddings:
            self.lm_head = linears.Einsum(
                (cfg.emb_dim, cfg.vocab_size),
                ("embed", "vocab"),
                kernel_init=nn.initializers.normal(1.0 if cfg.init_scheme == "t5" else 0.02),
                dtype=dtype,
                param_dtype=param_dtype,
            )
        if cfg.final_logits_bias:
            bias_init = nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",))
            self.logits_bias = self.param("final_logits_bias", bias_init, (cfg.vocab_size,), param_dtype)
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def _check_length(self, length: int, what: str) -> None:
        if self.config.positions == "learned":
            embeddings.check_length(length, self.config.max_len, offset=self.config.position_offset, what=what)

    def _embed(self, tokens: jax.Array, positions: jax.Array, which: str, *, deterministic: bool) -> jax.Array:
        cfg = self.config
        x = self.embed(tokens)
        if cfg.scale_embeddings:
            x = x * np.sqrt(cfg.emb_dim).astype(x.dtype)  # a float64 scalar would promote bfloat16 to float32
        if cfg.positions == "learned":
            x = x + getattr(self, f"{which}_positions")(positions + cfg.position_offset)
        elif cfg.positions == "sinusoidal":
            x = x + embeddings.sinusoidal_positions(positions, cfg.emb_dim).astype(x.dtype)
        if cfg.embedding_norm:
            x = getattr(self, f"{which}_embed_norm")(x)
        return self.dropout(x, deterministic=deterministic)

    def encode(
        self, inputs: jax.Array, *, segment_ids: jax.Array | None = None, deterministic: bool = True
    ) -> jax.Array:
        """inputs [B, S] int (segment_ids [B, S], 0 = padding) -> encoded [B, S, D].

        With learned positions, S + position_offset > max_len raises.
        """
        self._check_length(inputs.shape[1], "encoder input")
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
        x = self._embed(inputs, positions, "encoder", deterministic=deterministic)
        bias = self.encoder_relpos(positions[:1], positions[0]) if self.config.positions == "relative" else None
        x = self.encoder(x, segment_ids, bias, deterministic=deterministic)
        if self.config.pre_norm:
            x = self.dropout(self.encoder_final_norm(x), deterministic=deterministic)
        return sharding.constrain(x, ("act_batch", "act_len", "act_embed"))

    def decode(
        self,
        decoder_inputs: jax.Array,
        encoded: jax.Array | None,
        *,
        encoder_segment_ids: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        max_decode_len: int | None = None,
    ) -> jax.Array:
        """decoder_inputs [B, T] (targets shifted right), encoded [B, S, D] -> logits [B, T, V].

        decode=True: the chunk at `positions` [B, T] against the KV cache, whose length is
        max_decode_len (needed for the relative bias of T5). The first decode step projects `encoded`
        into every layer's cross-attention keys/values once; later steps pass encoded=None.
        With learned positions, a decoder length (T, or max_decode_len when decoding) beyond the table raises.
        """
        cfg = self.config
        if decode and max_decode_len is not None:
            self._check_length(max_decode_len, "decoder cache")
        if positions is None:
            self._check_length(decoder_inputs.shape[1], "decoder input")
            positions = jnp.broadcast_to(jnp.arange(decoder_inputs.shape[1]), decoder_inputs.shape)
        x = self._embed(decoder_inputs, positions, "decoder", deterministic=deterministic)
        bias = None
        if cfg.positions == "relative":
            keys = jnp.arange(max_decode_len if decode else decoder_inputs.shape[1])
            bias = self.decoder_relpos(positions, keys)
        if encoder_segment_ids is not None and segment_ids is None:
            segment_ids = jnp.ones(decoder_inputs.shape, jnp.int32)
        x = self.decoder(x, segment_ids, bias, encoded, encoder_segment_ids, deterministic=deterministic, decode=decode)
        if cfg.pre_norm:
            x = self.dropout(self.decoder_final_norm(x), deterministic=deterministic)
        if cfg.tie_embeddings:
            if cfg.scale_tied_logits:
                x = x * cfg.emb_dim**-0.5
            logits = self.embed.attend(x)
        else:
            logits = self.lm_head("BTD,DV->BTV", x)
        if cfg.final_logits_bias:
            logits = logits + self.logits_bias
        return sharding.constrain(logits, ("act_batch", "act_len", "act_vocab"))

    def __call__(
        self,
        inputs: jax.Array,
        decoder_inputs: jax.Array,
        *,
        encoder_segment_ids: jax.Array | None = None,
        decoder_segment_ids: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """inputs [B, S], decoder_inputs [B, T] -> logits [B, T, V]."""
        encoded = self.encode(inputs, segment_ids=encoder_segment_ids, deterministic=deterministic)
        return self.decode(
            decoder_inputs,
            encoded,
            encoder_segment_ids=encoder_segment_ids,
            segment_ids=decoder_segment_ids,
            deterministic=deterministic,
        )
