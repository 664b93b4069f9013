"""The Llama-style decoder (Touvron et al. 2023) and its relatives Mistral, Qwen2, Qwen3, Gemma 3 and gpt-oss.

    x = x + attn(RMSNorm(x)); x = x + SwiGLU(RMSNorm(x)); final RMSNorm; untied output head (by default).

Rotary position embeddings (HF's rotate-half layout, `rope_theta`, Llama 3's "llama3" scaling or "linear" scaling),
grouped-query attention (`num_kv_heads`), an optional sliding window (Mistral), q/k/v biases (Qwen2) and a per-head
RMSNorm of queries and keys before the rotation (Qwen3's `qk_norm`), all on the shared `lmzoo.layers` blocks. Load and
export HF `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `Gemma3ForCausalLM`
/ `GptOssForCausalLM` with `lmzoo.convert`.

Gemma 3 (text) adds layers of two kinds (`layer_types`: sliding-window attention rotating with `sliding_rope_theta`,
full attention with `rope_theta` and the scaling, 5:1), the sublayers' outputs normalised before each residual add
(`sandwich_norms`), embeddings scaled by sqrt(emb_dim) (`embed_scale`), the logit scale `query_pre_attn_scalar ** -0.5`
and a gated tanh-GELU (`mlp_activation`). The kinds differ only in the window and the rotation, which the layers take
per layer (`layers.blocks.BlockStack.per_layer`), so a scanned stack of both kinds is still one scan body.

With `num_experts` > 0 every layer's SwiGLU is a mixture of SwiGLU experts (`layers.mlp.MoeBlock`: Mixtral's top-2
renormalised router; Qwen2-MoE's shared expert with `shared_expert_mlp_dim`; Qwen3-MoE's routed experts alone, with
`qk_norm`); its auxiliary losses reach the loss
through the "moe" collection (`objectives.tasks.causal_lm_task`).

gpt-oss (OpenAI 2025) is that mixture with biases on the four attention projections (`qkv_bias`, `out_bias`), a
learned sink logit per head in every softmax (`attention_sinks`), sliding and full layers 1:1 that rotate alike (YaRN:
`rope_scaling_type` "yarn"), a biased router whose top-k logits are softmaxed (`router_bias`, renormalised weights)
and biased experts with a clamped SwiGLU (`expert_bias`, `swiglu_limit`, `swiglu_alpha`).
"""

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo.layers import attention, blocks, embeddings, mlp
from lmzoo.models import kinds

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)  # HF's names of the kinds of layer (`layer_types`)
ROPE_SCALING_TYPES = ("llama3", "linear", "yarn")


@dataclasses.dataclass(frozen=True)
class LlamaConfig(mlp.MoeFields):
    """Decoder hyper-parameters; the field names are exactly the keys of `config.model`.

    head_dim 0 means emb_dim // num_heads; num_kv_heads 0 means num_heads; sliding_window 0 means none;
    rope_scaling_factor 0 means no scaling, else `rope_scaling_type`'s: "llama3" (Llama 3's, with the three fields
    after it), "linear" (every frequency divided by the factor) or "yarn" (`layers.embeddings.Yarn`:
    rope_original_max_len, rope_beta_fast, rope_beta_slow, rope_truncate, and rope_attention_factor, the cos/sin
    tables' scale, 0: YaRN's 0.1 ln(factor) + 1). qk_norm RMS-normalises each head's queries and keys (learned
    [head_dim] scales, epsilon norm_epsilon) before the rotation. qkv_bias: biases on the query, key and value
    projections; out_bias: on the output projection. attention_sinks: a learned logit per head joins each softmax's
    denominator (gpt-oss's sinks).

    layer_types: HF's kind of each layer, "full_attention" or "sliding_attention"; empty means every layer alike
    (sliding_window, if set, applies to all). With them, sliding layers attend within sliding_window and full layers
    to every key; full layers rotate with rope_theta and the scaling, sliding layers with sliding_rope_theta unscaled
    (HF's Gemma 3 rope_parameters), or, with sliding_rope_theta 0, as the full layers (gpt-oss). sandwich_norms: each
    sublayer's output RMS-normalised before its residual add (Gemma's post-attention and post-feed-forward norms).
    embed_scale: embeddings times sqrt(emb_dim), in the activation dtype. query_pre_attn_scalar: logit scale
    query_pre_attn_scalar ** -0.5 (0: head_dim ** -0.5).
    mlp_activation: of the gated MLP's gate (Gemma's "gelu_tanh": GeGLU); experts are always SiLU-gated (gpt-oss's
    clamped form with swiglu_limit).
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
    rope_scaling_type: str = "llama3"
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 0.0
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    sliding_rope_theta: float = 0.0
    qkv_bias: bool = False
    out_bias: bool = False
    attention_sinks: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float = 0.0
    mlp_activation: str = "silu"
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
        if self.rope_scaling_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"config.model.rope_scaling_type={self.rope_scaling_type!r}: choose one of {ROPE_SCALING_TYPES}"
            )
        if self.rope_scaling_factor and self.rope_scaling_type == "llama3":
            embeddings.check_rope_scaling(self.rope_scaling)
        if self.rope_scaling_factor < 0:
            raise ValueError(f"config.model.rope_scaling_factor={self.rope_scaling_factor} must be >= 0 (0: none)")
        if self.yarn is not None and (self.rope_original_max_len < 1 or self.rope_attention_factor < 0):
            raise ValueError(
                f"config.model.rope_original_max_len={self.rope_original_max_len} must be >= 1 and "
                f"rope_attention_factor={self.rope_attention_factor} >= 0 (0: YaRN's own) for YaRN"
            )
        self._check_layer_kinds()
        for name in ("sliding_rope_theta", "query_pre_attn_scalar"):
            if getattr(self, name) < 0:
                raise ValueError(f"config.model.{name}={getattr(self, name)} must be >= 0 (0: the default)")
        if self.mlp_activation not in mlp.ACTIVATIONS:
            raise ValueError(
                f"config.model.mlp_activation={self.mlp_activation!r}: choose one of {sorted(mlp.ACTIVATIONS)}"
            )
        if self.num_experts and self.mlp_activation != "silu":
            raise ValueError(
                f"config.model.mlp_activation={self.mlp_activation!r} with num_experts={self.num_experts}: experts "
                "are SiLU-gated; set mlp_activation='silu'"
            )

    def _check_layer_kinds(self) -> None:
        """layer_types (a tuple, whatever sequence the config gave) names a known kind per layer, with the window
        its sliding layers need; sliding_rope_theta needs sliding layers."""
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"config.model.layer_types has {len(self.layer_types)} kinds for num_layers={self.num_layers}; give "
                "one per layer, or () for every layer alike"
            )
        unknown = sorted({kind for kind in self.layer_types if kind not in LAYER_TYPES})
        if unknown:
            raise ValueError(f"config.model.layer_types has {unknown[0]!r}: each layer is one of {LAYER_TYPES}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError(
                "config.model.layer_types has sliding_attention layers but sliding_window=0; set "
                "--config.model.sliding_window to their window"
            )
        if self.sliding_rope_theta and SLIDING not in self.layer_types:
            raise ValueError(
                f"config.model.sliding_rope_theta={self.sliding_rope_theta} rotates sliding_attention layers, and "
                "layer_types has none; set it to 0 or give layer_types"
            )
        if self.sliding_rope_theta and self.yarn is not None and self.yarn.table_scale != 1.0:
            raise ValueError(
                f"config.model.sliding_rope_theta={self.sliding_rope_theta} with YaRN scaling: YaRN's table scale "
                "applies to every layer, so the sliding layers cannot rotate unscaled; set sliding_rope_theta=0 (they "
                "rotate as the full layers, as gpt-oss's) or rope_attention_factor=1.0"
            )

    @property
    def moe(self) -> mlp.MoeConfig | None:
        """The MoE fields as `layers.mlp.MoeConfig`; None for a dense model (num_experts 0)."""
        if not self.num_experts:
            return None
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(mlp.MoeFields)}
        return mlp.MoeConfig(**{**fields, "expert_mlp_dim": self.expert_mlp_dim or self.mlp_dim})

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.emb_dim // self.num_heads

    @property
    def rope_scaling(self) -> tuple[float, float, float, int] | None:
        """Llama 3's scaling (`embeddings.Rotary.scaling`), or None (no scaling, or "linear")."""
        if not self.rope_scaling_factor or self.rope_scaling_type != "llama3":
            return None
        return (
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_len,
        )

    @property
    def yarn(self) -> embeddings.Yarn | None:
        """YaRN's scaling (`embeddings.Rotary.yarn`), or None (no scaling, or another kind)."""
        if not self.rope_scaling_factor or self.rope_scaling_type != "yarn":
            return None
        return embeddings.Yarn(
            factor=self.rope_scaling_factor,
            original_max_len=self.rope_original_max_len,
            beta_fast=self.rope_beta_fast,
            beta_slow=self.rope_beta_slow,
            attention_factor=self.rope_attention_factor,
            truncate=self.rope_truncate,
        )

    def rotary(self, kind: str = FULL) -> embeddings.Rotary:
        """The rotation of a layer of `kind`: sliding layers' (of layer_types) with sliding_rope_theta, unscaled,
        when it is set; the others' (and with sliding_rope_theta 0 every layer's) with rope_theta and the scaling."""
        if kind == SLIDING and self.layer_types and self.sliding_rope_theta:
            return embeddings.Rotary(self.sliding_rope_theta)
        linear = self.rope_scaling_factor if self.rope_scaling_type == "linear" and self.rope_scaling_factor else 1.0
        return embeddings.Rotary(self.rope_theta, self.rope_scaling, linear, self.yarn)

    def per_layer(self) -> dict[str, tuple] | None:
        """With layer_types, each layer's sliding_window (0: none) and rotary_frequencies [head_dim / 2], the
        `BlockStack.per_layer` values of the attention's call; None when every layer is alike."""
        if not self.layer_types:
            return None
        frequencies = {kind: self.rotary(kind).inverse_frequencies(self.head_size) for kind in LAYER_TYPES}
        return {
            "sliding_window": tuple(self.sliding_window if kind == SLIDING else 0 for kind in self.layer_types),
            "rotary_frequencies": tuple(frequencies[kind] for kind in self.layer_types),
        }

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
        x, embed = kinds.embed_tokens(
            cfg, tokens, positions=positions, deterministic=deterministic, what="Llama input", scale=cfg.embed_scale
        )
        if self.has_experts:
            cfg.check_expert_axis()
        block = blocks.TransformerBlock(
            attention.AttentionConfig(
                cfg.num_heads,
                cfg.head_size,
                num_kv_heads=cfg.kv_heads,
                use_bias=cfg.out_bias,
                qkv_bias=cfg.qkv_bias,
                rotary=cfg.rotary(),
                qk_norm=cfg.qk_norm,
                qk_norm_epsilon=cfg.norm_epsilon,
                sliding_window=None if cfg.layer_types else cfg.sliding_window or None,
                scale=cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None,
                dropout_rate=cfg.attention_dropout_rate,
                sinks=cfg.attention_sinks,
            ),
            mlp_dim=cfg.mlp_dim,
            causal=True,
            pre_norm=True,
            sandwich_norms=cfg.sandwich_norms,
            norm="rms",
            activations=(cfg.mlp_activation, "linear"),
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
            block,
            cfg.num_layers,
            scan=cfg.scan_layers,
            remat_policy=cfg.remat_policy,
            per_layer=cfg.per_layer(),
            name="blocks",
        )(x, segment_ids, None, None, None, positions, deterministic=deterministic, decode=decode)
        return kinds.decoder_logits(cfg, x, embed, return_hidden=return_hidden)
