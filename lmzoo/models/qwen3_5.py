"""Qwen3.5 (Qwen team 2026; its text model): a hybrid of linear and full attention, three Gated DeltaNet layers to one.

    x = x + mixer(RMSNorm(x)); x = x + SwiGLU(RMSNorm(x)); final RMSNorm; untied output head (by default).

The mixer of a "linear_attention" layer is Gated DeltaNet (`layers.gated_delta`): a decayed delta-rule state per
value head, computed chunk by chunk for training and prefill and carried token by token while decoding. A
"full_attention" layer's is grouped-query attention with a per-head RMSNorm of queries and keys, rotary embeddings on a
quarter of each head (`rotary_fraction`) and each head's output gated by a sigmoid (`AttentionConfig.output_gate`).
HF's norms multiply by 1 + w (zero-centred weights); lmzoo's scales are the factor itself, so the converter adds the 1.

The layer kinds repeat (HF's `layer_types`, by default "linear_attention" thrice then "full_attention"): the stack is
`num_layers / len(pattern)` copies of one group of the repeating pattern's layers (`LayerGroup`, "block_0".."block_3"),
scanned or looped as one body (MaxText's way with Gemma's 5:1 stack), so the compiled program does not grow with depth.
HF layer i is group i // len(pattern), block i % len(pattern). The decode cache holds, per full-attention layer, its
keys and values and, per Gated DeltaNet layer, the last conv_width - 1 inputs of its convolution and its state
[N, H, P]: constant in the generated length.

With `num_experts` > 0 every layer's SwiGLU is a mixture of experts with a sigmoid-gated shared expert
(`layers.mlp.MoeBlock`, Qwen2-MoE's routing: Qwen3.5-MoE); its auxiliary losses reach the loss through the "moe"
collection (`objectives.tasks.causal_lm_task`).

Load and export HF `Qwen3_5ForCausalLM` (model_type qwen3_5_text; the text model of the released vision-language
checkpoints) and `Qwen3_5MoeForCausalLM` (qwen3_5_moe_text) with `lmzoo.convert.qwen3_5`.
"""

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import sharding
from lmzoo.layers import attention, blocks, embeddings, mlp, norms
from lmzoo.layers.gated_delta import GatedDeltaConfig, GatedDeltaNet
from lmzoo.models import kinds

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR, FULL)  # HF's names of the kinds of layer
FULL_ATTENTION_INTERVAL = 4  # HF's default: every fourth layer is full attention


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config(mlp.MoeFields):
    """Qwen3.5 text model hyper-parameters; the field names are exactly the keys of `config.model`.

    Full attention: num_heads of head_dim, num_kv_heads key/value heads, rotary with rope_theta on the leading
    int(head_dim * rotary_fraction) dimensions. Gated DeltaNet: linear_key_heads query/key heads of linear_key_dim,
    linear_value_heads value heads of linear_value_dim, a causal convolution of conv_width taps, chunk_size positions
    per step of the chunked recurrence (a speed setting: the result does not depend on it). layer_types: HF's kind of
    each layer, "linear_attention" or "full_attention"; empty means HF's default (every fourth layer full).
    The mixture-of-experts fields are `layers.mlp.MoeFields`' (Qwen3.5-MoE: every layer's feed-forward a mixture of
    num_experts SwiGLU experts of expert_mlp_dim, top-experts_per_token renormalised, plus a sigmoid-gated shared
    expert of shared_expert_mlp_dim); num_experts 0 means a dense SwiGLU of mlp_dim.
    """

    vocab_size: int = 248_320
    max_len: int = 32_768
    emb_dim: int = 4096
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 256
    num_layers: int = 32
    mlp_dim: int = 12_288
    rope_theta: float = 10_000_000.0
    rotary_fraction: float = 0.25
    layer_types: tuple[str, ...] = ()
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    conv_width: int = 4
    chunk_size: int = 64
    tie_embeddings: bool = False
    norm_epsilon: float = 1e-6
    init_std: float = 0.02
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat_policy: str = "none"

    def __post_init__(self):
        kinds.check_fields(
            self,
            sizes=(
                "vocab_size",
                "max_len",
                "emb_dim",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "num_layers",
                "mlp_dim",
                "linear_key_heads",
                "linear_value_heads",
                "linear_key_dim",
                "linear_value_dim",
                "conv_width",
                "chunk_size",
            ),
            counts=("num_experts", "expert_mlp_dim", "shared_expert_mlp_dim"),
            positive=("norm_epsilon", "rope_theta", "init_std", "rotary_fraction"),
            rates=("dropout_rate", "attention_dropout_rate"),
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.model.num_heads={self.num_heads} must be a multiple of config.model.num_kv_heads="
                f"{self.num_kv_heads}; choose a divisor of num_heads"
            )
        if self.linear_value_heads % self.linear_key_heads:
            raise ValueError(
                f"config.model.linear_value_heads={self.linear_value_heads} must be a multiple of "
                f"config.model.linear_key_heads={self.linear_key_heads} (each key head serves a group of value heads)"
            )
        rotated = int(self.head_dim * self.rotary_fraction)
        if self.rotary_fraction > 1 or rotated < 2 or rotated % 2:
            raise ValueError(
                f"config.model.rotary_fraction={self.rotary_fraction} rotates {rotated} of head_dim={self.head_dim} "
                "dimensions; it must be in (0, 1] and rotate an even number >= 2"
            )
        if self.moe is not None and self.moe.problems():
            raise ValueError(
                "; ".join(
                    f"config.model.{name}={getattr(self, name)!r}: {why}; set --config.model.{name}={fix}"
                    for name, why, fix in self.moe.problems()
                )
            )
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"config.model.layer_types has {len(self.layer_types)} kinds for num_layers={self.num_layers}; give "
                "one per layer, or () for HF's default (every fourth layer full_attention)"
            )
        unknown = sorted({kind for kind in self.layer_types if kind not in LAYER_TYPES})
        if unknown:
            raise ValueError(f"config.model.layer_types has {unknown[0]!r}: each layer is one of {LAYER_TYPES}")

    @property
    def moe(self) -> mlp.MoeConfig | None:
        """The MoE fields as `layers.mlp.MoeConfig`; None for a dense model (num_experts 0)."""
        if not self.num_experts:
            return None
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(mlp.MoeFields)}
        return mlp.MoeConfig(**{**fields, "expert_mlp_dim": self.expert_mlp_dim or self.mlp_dim})

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every layer's kind: layer_types, or HF's default pattern."""
        if self.layer_types:
            return self.layer_types
        return tuple(FULL if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else LINEAR for i in range(self.num_layers))

    @property
    def pattern(self) -> tuple[str, ...]:
        """The shortest run of kinds that repeats to make the stack: one scanned group."""
        layers = self.kinds
        for period in range(1, len(layers) + 1):
            if len(layers) % period == 0 and layers == layers[:period] * (len(layers) // period):
                return layers[:period]
        return layers

    @property
    def attention(self) -> attention.AttentionConfig:
        """The full-attention layers' fields."""
        return attention.AttentionConfig(
            self.num_heads,
            self.head_dim,
            num_kv_heads=self.num_kv_heads,
            use_bias=False,
            rotary=embeddings.Rotary(self.rope_theta, fraction=self.rotary_fraction),
            qk_norm=True,
            qk_norm_epsilon=self.norm_epsilon,
            dropout_rate=self.attention_dropout_rate,
            output_gate=True,
        )

    @property
    def gated_delta(self) -> GatedDeltaConfig:
        """The Gated DeltaNet layers' fields."""
        return GatedDeltaConfig(
            num_key_heads=self.linear_key_heads,
            num_value_heads=self.linear_value_heads,
            key_dim=self.linear_key_dim,
            value_dim=self.linear_value_dim,
            conv_width=self.conv_width,
            norm_epsilon=self.norm_epsilon,
            chunk_size=self.chunk_size,
        )


class LinearAttentionBlock(nn.Module):
    """x + GatedDeltaNet(RMSNorm(x)); x + SwiGLU(RMSNorm(x)). [B, T, D] -> [B, T, D]."""

    config: Qwen3_5Config
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None = None, *, deterministic: bool, decode: bool = False
    ) -> jax.Array:
        cfg = self.config
        norm = functools.partial(
            norms.LayerNorm,
            epsilon=cfg.norm_epsilon,
            use_bias=False,
            use_mean=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        init = nn.initializers.normal(cfg.init_std)
        dropout = nn.Dropout(cfg.dropout_rate)
        x = sharding.constrain(x, ("act_batch", "act_len", "act_embed"))
        h = GatedDeltaNet(
            cfg.gated_delta,
            kernel_init=init,
            out_init=init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="linear_attn",
        )(norm(name="ln_attn")(x), segment_ids=segment_ids, decode=decode)
        x = x + dropout(h, deterministic=deterministic)
        kernels = dict(kernel_init=init, out_init=init, dtype=self.dtype, param_dtype=self.param_dtype, name="mlp")
        if cfg.moe is None:
            ffn = mlp.MlpBlock(cfg.mlp_dim, activations=("silu", "linear"), use_bias=False, **kernels)
        else:
            ffn = mlp.MoeBlock(cfg.moe, **kernels)
        h = ffn(norm(name="ln_mlp")(x), deterministic=deterministic)
        return x + dropout(h, deterministic=deterministic)


class LayerGroup(nn.Module):
    """One repetition of the layer pattern: "block_j" is the pattern's j-th layer (`LinearAttentionBlock` or a
    full-attention `blocks.TransformerBlock`). [B, T, D] -> [B, T, D]."""

    config: Qwen3_5Config
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        *,
        deterministic: bool,
        decode: bool = False,
    ) -> jax.Array:
        cfg = self.config
        for j, kind in enumerate(cfg.pattern):
            if kind == LINEAR:
                block = LinearAttentionBlock(cfg, dtype=self.dtype, param_dtype=self.param_dtype, name=f"block_{j}")
                x = block(x, segment_ids, deterministic=deterministic, decode=decode)
            else:
                block = blocks.TransformerBlock(
                    cfg.attention,
                    mlp_dim=cfg.mlp_dim,
                    causal=True,
                    pre_norm=True,
                    norm="rms",
                    activations=("silu", "linear"),
                    use_bias=False,
                    layer_norm_epsilon=cfg.norm_epsilon,
                    dropout_rate=cfg.dropout_rate,
                    init_std=cfg.init_std,
                    residual_init_std=cfg.init_std,
                    moe=cfg.moe,
                    dtype=self.dtype,
                    param_dtype=self.param_dtype,
                    name=f"block_{j}",
                )
                x = block(x, segment_ids, positions=positions, deterministic=deterministic, decode=decode)
        return x


class Qwen3_5(kinds.DecoderOutputs, nn.Module):
    """Causal decoder LM of Gated DeltaNet and gated full-attention layers.

    Attributes:
        config: Qwen3_5Config.
    """

    kind: ClassVar[str] = kinds.DECODER
    token_table: ClassVar[str] = "embed"

    config: Qwen3_5Config

    @property
    def has_experts(self) -> bool:
        """Whether the layers are mixtures of experts, which sow their losses into `layers.mlp.MOE_COLLECTION`."""
        return self.config.moe is not None

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        return_hidden: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """tokens: [B, T] int -> logits [B, T, V] (and final hidden states [B, T, D] if return_hidden).

        positions [B, T]: rotary positions (default 0..T-1, T <= max_len; left padding counts from the first real
        token). segment_ids [B, T]: document ids (0 = padding; a new document restarts the linear layers' state).
        decode: one chunk against the cache (`lmzoo.decoding`).
        """
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        x, embed = kinds.embed_tokens(
            cfg, tokens, positions=positions, deterministic=deterministic, what="Qwen3.5 input"
        )
        if self.has_experts:
            cfg.check_expert_axis()
        groups = cfg.num_layers // len(cfg.pattern)
        x = blocks.BlockStack(
            LayerGroup(cfg, dtype=dtype, param_dtype=param_dtype),
            groups,
            scan=cfg.scan_layers,
            remat_policy=cfg.remat_policy,
            name="blocks",
        )(x, segment_ids, positions, deterministic=deterministic, decode=decode)
        return kinds.decoder_logits(cfg, x, embed, return_hidden=return_hidden)
