"""DeepSeek-V3 (DeepSeek-AI 2024): multi-head latent attention and a mixture of many small experts.

    x = x + MLA(RMSNorm(x)); x = x + FFN(RMSNorm(x)); final RMSNorm; untied output head (by default).

Attention is multi-head latent attention (`layers.latent_attention`): keys and values from a low-rank latent of
kv_lora_rank per position plus one rotary key of qk_rope_head_dim shared by the heads, so the decode cache holds those
two alone (`kv_cache_bytes`); queries through a latent of q_lora_rank; YaRN's frequencies and softmax scale when the
context is stretched. The first `first_dense_layers` layers' FFN is a SwiGLU of mlp_dim ("dense_blocks"); the others'
a mixture of experts ("moe_blocks", `layers.mlp.MoeBlock`): each token scored by a sigmoid per expert, its top
`experts_per_token` chosen with a per-expert correction bias among the experts of its `groups_per_token` best groups
of `expert_groups`, weighted by their scores (renormalised, times `routed_scaling`), plus `num_shared_experts` shared
experts every token goes through (one SwiGLU of num_shared_experts * expert_mlp_dim). No auxiliary loss: the
correction bias balances the load (DeepSeek-V3's auxiliary-loss-free balancing sets it; here it is read from the
checkpoint and kept as it is).

Load and export HF `DeepseekV3ForCausalLM` with `lmzoo.convert.deepseek`.
"""

import dataclasses
import functools
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import sharding
from lmzoo.layers import blocks, mlp, norms
from lmzoo.layers.latent_attention import LatentAttention, LatentAttentionConfig, Yarn
from lmzoo.models import kinds

# HF's DeepseekV3Attention normalises its latents with RMSNorm's default epsilon, whatever rms_norm_eps says.
LATENT_NORM_EPSILON = 1e-6


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """DeepSeek-V3 hyper-parameters; the field names are exactly the keys of `config.model`.

    q_lora_rank 0 means queries projected from x directly. rope_scaling_factor 0 means no scaling, else YaRN's with
    the rope_* fields after it (`layers.latent_attention.Yarn`; rope_mscale, rope_mscale_all_dim and
    rope_attention_factor 0 mean not given). rope_interleave: the rotation pairs interleaved dimensions (DeepSeek-V3's
    checkpoints). norm_epsilon is the layers' norms' (the latents' is LATENT_NORM_EPSILON). The first
    first_dense_layers layers are dense SwiGLUs of mlp_dim; the rest mixtures of num_experts experts of expert_mlp_dim
    (`layers.mlp.MoeConfig`: sigmoid scores, correction bias, expert_groups, groups_per_token, routed_scaling,
    renormalize_expert_weights; num_shared_experts shared experts).
    """

    vocab_size: int = 129_280
    max_len: int = 4096
    emb_dim: int = 7168
    num_heads: int = 128
    num_layers: int = 61
    mlp_dim: int = 18_432
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10_000.0
    rope_scaling_factor: float = 0.0
    rope_original_max_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float = 0.0
    rope_truncate: bool = True
    rope_interleave: bool = True
    first_dense_layers: int = 3
    num_experts: int = 256
    experts_per_token: int = 8
    expert_mlp_dim: int = 2048
    num_shared_experts: int = 1
    expert_groups: int = 8
    groups_per_token: int = 4
    routed_scaling: float = 2.5
    renormalize_expert_weights: bool = True
    moe_form: str = "dropless"
    capacity_factor: float = 1.25
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
                "num_layers",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
                "rope_original_max_len",
            ),
            counts=(
                "mlp_dim",
                "q_lora_rank",
                "first_dense_layers",
                "num_experts",
                "expert_mlp_dim",
                "num_shared_experts",
                "rope_scaling_factor",
                "rope_mscale",
                "rope_mscale_all_dim",
                "rope_attention_factor",
            ),
            positive=("norm_epsilon", "rope_theta", "init_std"),
            rates=("dropout_rate", "attention_dropout_rate"),
        )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config.model.qk_rope_head_dim={self.qk_rope_head_dim}: rotary keys need an even size")
        if self.first_dense_layers > self.num_layers:
            raise ValueError(
                f"config.model.first_dense_layers={self.first_dense_layers} exceeds num_layers={self.num_layers}; "
                f"set it to at most {self.num_layers}"
            )
        if self.first_dense_layers and self.mlp_dim < 1:
            raise ValueError("config.model.mlp_dim must be >= 1: the first_dense_layers layers are SwiGLUs of mlp_dim")
        if self.moe is not None and self.moe.problems():
            raise ValueError(
                "; ".join(
                    f"config.model.{name}={getattr(self.moe, name)!r}: {why}" for name, why, _ in self.moe.problems()
                )
            )

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    @property
    def moe(self) -> mlp.MoeConfig | None:
        """The MoE layers' `layers.mlp.MoeConfig` (no auxiliary loss); None when every layer is dense."""
        if not self.moe_layers:
            return None
        return mlp.MoeConfig(
            num_experts=self.num_experts,
            experts_per_token=self.experts_per_token,
            expert_mlp_dim=self.expert_mlp_dim,
            shared_expert_mlp_dim=self.num_shared_experts * self.expert_mlp_dim,
            moe_form=self.moe_form,
            capacity_factor=self.capacity_factor,
            router_z_loss_coef=0.0,
            load_balance_coef=0.0,
            renormalize_expert_weights=self.renormalize_expert_weights,
            router_score="sigmoid",
            score_correction=True,
            expert_groups=self.expert_groups,
            groups_per_token=self.groups_per_token,
            routed_scaling=self.routed_scaling,
            shared_expert_gate=False,
        )

    @property
    def yarn(self) -> Yarn | None:
        if not self.rope_scaling_factor:
            return None
        return Yarn(
            factor=self.rope_scaling_factor,
            original_max_len=self.rope_original_max_len,
            beta_fast=self.rope_beta_fast,
            beta_slow=self.rope_beta_slow,
            mscale=self.rope_mscale,
            mscale_all_dim=self.rope_mscale_all_dim,
            attention_factor=self.rope_attention_factor,
            truncate=self.rope_truncate,
        )

    @property
    def attention(self) -> LatentAttentionConfig:
        return LatentAttentionConfig(
            num_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            q_lora_rank=self.q_lora_rank,
            rope_theta=self.rope_theta,
            yarn=self.yarn,
            rope_interleave=self.rope_interleave,
            norm_epsilon=LATENT_NORM_EPSILON,
            dropout_rate=self.attention_dropout_rate,
        )

    def check_expert_axis(self) -> None:
        """Raises unless the expert mesh axis in context divides num_experts: each device holds whole experts."""
        shards = sharding.logical_axis_size("exp")
        if self.moe_layers and self.num_experts % shards:
            raise ValueError(
                f"config.model.num_experts={self.num_experts} must be a multiple of the {shards} devices of the "
                "expert mesh axis; set the expert size of config.sharding.mesh_shape (data, fsdp, expert, tensor) to "
                f"a divisor of {self.num_experts}"
            )

    def kv_cache_bytes(self, batch: int, length: int) -> int:
        """Bytes of the decode cache's latents and rotary keys for `batch` sequences of `length` positions:
        kv_lora_rank + qk_rope_head_dim a position and layer, where multi-head attention would cache
        num_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)."""
        width = self.attention.cache_width()
        return self.num_layers * batch * length * width * jnp.dtype(self.dtype).itemsize


class DeepseekBlock(nn.Module):
    """Pre-norm layer: latent attention, then a SwiGLU (`moe` None) or a mixture of experts. [B, T, D] -> [B, T, D].

    Attributes:
        attention: LatentAttentionConfig.
        mlp_dim: F of the dense SwiGLU.
        moe: the mixture of experts, or None for the dense SwiGLU.
    """

    attention: LatentAttentionConfig
    mlp_dim: int
    moe: mlp.MoeConfig | None = None
    norm_epsilon: float = 1e-6
    dropout_rate: float = 0.0
    init_std: float = 0.02
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

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
        """x [B, T, D]; segment_ids [B, T] (0 = padding); positions [B, T] for the rotation."""
        norm = functools.partial(
            norms.LayerNorm,
            epsilon=self.norm_epsilon,
            use_bias=False,
            use_mean=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        init = nn.initializers.normal(self.init_std)
        kernels = dict(kernel_init=init, out_init=init, dtype=self.dtype, param_dtype=self.param_dtype)
        dropout = nn.Dropout(self.dropout_rate)
        x = sharding.constrain(x, ("act_batch", "act_len", "act_embed"))
        h = LatentAttention(self.attention, **kernels, name="attn")(
            norm(name="ln_attn")(x),
            segment_ids=segment_ids,
            positions=positions,
            deterministic=deterministic,
            decode=decode,
        )
        x = x + dropout(h, deterministic=deterministic)
        if self.moe is None:
            ffn = mlp.MlpBlock(self.mlp_dim, activations=("silu", "linear"), use_bias=False, **kernels, name="mlp")
        else:
            ffn = mlp.MoeBlock(self.moe, **kernels, name="mlp")
        h = ffn(norm(name="ln_mlp")(x), deterministic=deterministic)
        return x + dropout(h, deterministic=deterministic)


class Deepseek(kinds.DecoderOutputs, nn.Module):
    """Causal decoder LM with latent attention, dense layers then mixtures of experts.

    Attributes:
        config: DeepseekConfig.
    """

    kind: ClassVar[str] = kinds.DECODER
    token_table: ClassVar[str] = "embed"

    config: DeepseekConfig

    @property
    def has_experts(self) -> bool:
        """Whether some layers are mixtures of experts, which sow their statistics into `layers.mlp.MOE_COLLECTION`."""
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
        token). segment_ids [B, T]: document ids (0 = padding). decode: one chunk against the latent cache
        (`lmzoo.decoding`).
        """
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        x, embed = kinds.embed_tokens(
            cfg, tokens, positions=positions, deterministic=deterministic, what="DeepSeek input"
        )
        if self.has_experts:
            cfg.check_expert_axis()
        block = functools.partial(
            DeepseekBlock,
            cfg.attention,
            cfg.mlp_dim,
            norm_epsilon=cfg.norm_epsilon,
            dropout_rate=cfg.dropout_rate,
            init_std=cfg.init_std,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        stacks = (("dense_blocks", cfg.first_dense_layers, None), ("moe_blocks", cfg.moe_layers, cfg.moe))
        for name, num_layers, moe in stacks:
            if num_layers:
                x = blocks.BlockStack(
                    block(moe=moe), num_layers, scan=cfg.scan_layers, remat_policy=cfg.remat_policy, name=name
                )(x, segment_ids, positions, deterministic=deterministic, decode=decode)
        return kinds.decoder_logits(cfg, x, embed, return_hidden=return_hidden)
