"""The Llama-style decoder (Touvron et al. 2023) and its relatives Mistral, Qwen2 and Qwen3.

    x = x + attn(RMSNorm(x)); x = x + SwiGLU(RMSNorm(x)); final RMSNorm; untied output head (by default).

Rotary position embeddings (HF's rotate-half layout, `rope_theta`, Llama 3's "llama3" scaling), grouped-query
attention (`num_kv_heads`), an optional sliding window (Mistral), q/k/v biases (Qwen2) and a per-head RMSNorm of
queries and keys before the rotation (Qwen3's `qk_norm`), all on the shared `lmzoo.layers` blocks. Load and export HF
`LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` with `lmzoo.convert`.

With `num_experts` > 0 every layer's SwiGLU is a mixture of SwiGLU experts (`layers.mlp.MoeBlock`: Mixtral's top-2
renormalised router; Qwen2-MoE's shared expert with `shared_expert_mlp_dim`; Qwen3-MoE's routed experts alone, with
`qk_norm`); its auxiliary losses reach the loss
through the "moe" collection (`objectives.tasks.causal_lm_task`).
"""

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import sharding
from lmzoo.layers import attention, blocks, embeddings, mlp, norms
from lmzoo.models import kinds


@dataclasses.dataclass(frozen=True)
class LlamaConfig(mlp.MoeFields):
    """Decoder hyper-parameters; the field names are exactly the keys of `config.model`.

    head_dim 0 means emb_dim // num_heads; num_kv_heads 0 means num_heads; sliding_window 0 means none;
    rope_scaling_factor 0 means no scaling, else Llama 3's scaling with the three fields after it. qk_norm
    RMS-normalises each head's queries and keys (learned [head_dim] scales, epsilon norm_epsilon) before the rotation.
    The mixture-of-experts fields are `layers.mlp.MoeFields`' (declared there): num_experts 0 means a dense SwiGLU,
    expert_mlp_dim 0 means mlp_dim.
    """

    vocab_size: int = 32000
    max_len: int = 2048
    emb_dim: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 0
    head_dim: int = 0
    num_layers: int = 32
    mlp_dim: int = 11008
    rope_theta: float = 10_000.0
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    sliding_window: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
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
            sizes=("vocab_size", "max_len", "emb_dim", "num_heads", "num_layers", "mlp_dim"),
            counts=("num_experts", "expert_mlp_dim", "shared_expert_mlp_dim"),
            positive=("norm_epsilon", "rope_theta", "init_std"),
            rates=("dropout_rate", "attention_dropout_rate"),
        )
        if self.moe is not None and self.moe.problems():
            raise ValueError(
                "; ".join(
                    f"config.model.{name}={getattr(self, name)!r}: {why}; set --config.model.{name}={fix}"
                    for name, why, fix in self.moe.problems()
                )
            )
        for name in ("num_kv_heads", "head_dim", "sliding_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"config.model.{name}={getattr(self, name)} must be >= 0 (0: the default)")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"config.model.num_heads={self.num_heads} must be a multiple of config.model.num_kv_heads="
                f"{self.kv_heads} (each kv head serves a group of query heads); choose a divisor of num_heads"
            )
        if self.head_size % 2:
            raise ValueError(f"rotary embeddings need an even head size; config.model.head_dim is {self.head_size}")
        if self.rope_scaling_factor:
            embeddings.check_rope_scaling(self.rope_scaling)

    @property
    def moe(self) -> mlp.MoeConfig | None:
        """The MoE fields as `layers.mlp.MoeConfig`; None for a dense model (num_experts 0)."""
        if not self.num_experts:
            return None
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(mlp.MoeFields)}
        return mlp.MoeConfig(**{**fields, "expert_mlp_dim": self.expert_mlp_dim or self.mlp_dim})

    def check_expert_axis(self) -> None:
        """Raises unless the expert mesh axis in context (`sharding.logical_axis_size("exp")`) divides num_experts:
        each device holds whole experts."""
        shards = sharding.logical_axis_size("exp")
        if self.num_experts % shards:
            raise ValueError(
                f"config.model.num_experts={self.num_experts} must be a multiple of the {shards} devices of the "
                f"expert mesh axis; set --config.model.num_experts to a multiple of {shards}, or the expert size of "
                f"config.sharding.mesh_shape (data, fsdp, expert, tensor) to a divisor of {self.num_experts}"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.emb_dim // self.num_heads

    @property
    def rope_scaling(self) -> tuple[float, float, float, int] | None:
        if not self.rope_scaling_factor:
            return None
        return (
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_len,
        )

    def kv_cache_bytes(self, batch: int, length: int) -> int:
        """Bytes of the KV cache for `batch` sequences of `length` positions: K heads, not N (x K / N of a full
        multi-head cache)."""
        return 2 * self.num_layers * batch * length * self.kv_heads * self.head_size * jnp.dtype(self.dtype).itemsize


class Llama(kinds.DecoderOutputs, nn.Module):
    """Causal decoder LM with rotary positions.

    Attributes:
        config: LlamaConfig.
    """

    kind: ClassVar[str] = kinds.DECODER
    token_table: ClassVar[str] = "embed"

    config: LlamaConfig

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

        positions [B, T]: rotary positions (default 0..T-1, T <= max_len; packed documents restart at 0, left
        padding counts from the first real token). segment_ids [B, T]: document ids (0 = padding). decode: one
        chunk against the KV cache (`lmzoo.decoding`).
        """
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        if positions is None:  # the layers rotate by 0..T-1 from constant tables
            embeddings.check_length(tokens.shape[1], cfg.max_len, what="Llama input")
        init = nn.initializers.normal(cfg.init_std)
        embed = embeddings.Embed(
            cfg.vocab_size, cfg.emb_dim, embedding_init=init, dtype=dtype, param_dtype=param_dtype, name="embed"
        )
        x = nn.Dropout(cfg.dropout_rate)(embed(tokens), deterministic=deterministic)
        if self.has_experts:
            cfg.check_expert_axis()
        block = blocks.TransformerBlock(
            attention.AttentionConfig(
                cfg.num_heads,
                cfg.head_size,
                num_kv_heads=cfg.kv_heads,
                use_bias=False,
                qkv_bias=cfg.qkv_bias,
                rotary=embeddings.Rotary(cfg.rope_theta, cfg.rope_scaling),
                qk_norm=cfg.qk_norm,
                qk_norm_epsilon=cfg.norm_epsilon,
                sliding_window=cfg.sliding_window or None,
                dropout_rate=cfg.attention_dropout_rate,
            ),
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
            dtype=dtype,
            param_dtype=param_dtype,
        )
        x = blocks.BlockStack(
            block, cfg.num_layers, scan=cfg.scan_layers, remat_policy=cfg.remat_policy, name="blocks"
        )(x, segment_ids, None, None, None, positions, deterministic=deterministic, decode=decode)
        x = norms.LayerNorm(
            epsilon=cfg.norm_epsilon, use_bias=False, use_mean=False, dtype=dtype, param_dtype=param_dtype, name="norm"
        )(x)
        x = sharding.constrain(x, ("act_batch", "act_len", "act_embed"))
        logits = embeddings.output_logits(
            x, embed, tied=cfg.tie_embeddings, kernel_init=init, dtype=dtype, param_dtype=param_dtype
        )
        return (logits, x) if return_hidden else logits
