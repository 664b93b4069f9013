"""The Llama-style decoder (Touvron et al. 2023) and its relatives Mistral and Qwen2.

    x = x + attn(RMSNorm(x)); x = x + SwiGLU(RMSNorm(x)); final RMSNorm; untied output head (by default).

Rotary position embeddings (HF's rotate-half layout, `rope_theta`, Llama 3's "llama3" scaling), grouped-query
attention (`num_kv_heads`), an optional sliding window (Mistral) and q/k/v biases (Qwen2), all on the shared
`lmzoo.layers` blocks. Load and export HF `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` with
`lmzoo.convert`.
"""

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import layers, sharding
from lmzoo.models import kinds


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Decoder hyper-parameters; the field names are exactly the keys of `config.model`.

    head_dim 0 means emb_dim // num_heads; num_kv_heads 0 means num_heads; sliding_window 0 means none;
    rope_scaling_factor 0 means no scaling, else Llama 3's scaling with the three fields after it.
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
        layers.check_fields(
            self,
            sizes=("vocab_size", "max_len", "emb_dim", "num_heads", "num_layers", "mlp_dim"),
            positive=("norm_epsilon", "rope_theta", "init_std"),
            rates=("dropout_rate", "attention_dropout_rate"),
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
            layers.check_rope_scaling(self.rope_scaling)

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


class Llama(nn.Module):
    """Causal decoder LM with rotary positions.

    Attributes:
        config: LlamaConfig.
    """

    kind: ClassVar[str] = kinds.DECODER

    config: LlamaConfig

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
            layers.check_length(tokens.shape[1], cfg.max_len, what="Llama input")
        init = nn.initializers.normal(cfg.init_std)
        embed = layers.Embed(
            cfg.vocab_size, cfg.emb_dim, embedding_init=init, dtype=dtype, param_dtype=param_dtype, name="embed"
        )
        x = nn.Dropout(cfg.dropout_rate)(embed(tokens), deterministic=deterministic)
        block = layers.TransformerBlock(
            num_heads=cfg.num_heads,
            head_dim=cfg.head_size,
            mlp_dim=cfg.mlp_dim,
            causal=True,
            pre_norm=True,
            norm="rms",
            activations=("silu", "linear"),
            use_bias=False,
            layer_norm_epsilon=cfg.norm_epsilon,
            dropout_rate=cfg.dropout_rate,
            attention_dropout_rate=cfg.attention_dropout_rate,
            init_std=cfg.init_std,
            residual_init_std=cfg.init_std,
            num_kv_heads=cfg.kv_heads,
            qkv_bias=cfg.qkv_bias,
            rotary=layers.Rotary(cfg.rope_theta, cfg.rope_scaling),
            sliding_window=cfg.sliding_window or None,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        x = layers.BlockStack(
            block, cfg.num_layers, scan=cfg.scan_layers, remat_policy=cfg.remat_policy, name="blocks"
        )(x, segment_ids, None, None, None, positions, deterministic=deterministic, decode=decode)
        x = layers.LayerNorm(
            epsilon=cfg.norm_epsilon, use_bias=False, use_mean=False, dtype=dtype, param_dtype=param_dtype, name="norm"
        )(x)
        x = sharding.constrain(x, ("act_batch", "act_len", "act_embed"))
        if cfg.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = layers.Einsum(
                (cfg.emb_dim, cfg.vocab_size),
                ("embed", "vocab"),
                kernel_init=init,
                dtype=dtype,
                param_dtype=param_dtype,
                name="lm_head",
            )("BTD,DV->BTV", x)
        logits = sharding.constrain(logits, ("act_batch", "act_len", "act_vocab"))
        return (logits, x) if return_hidden else logits

    def output_embedding(self) -> jax.Array:
        """The output projection as [V, D] (for `lmzoo.objectives.losses.fused_head_loss`)."""
        params = nn.unbox(self.variables["params"])
        return params["embed"]["embedding"] if self.config.tie_embeddings else params["lm_head"]["kernel"].T

    def encode(
        self,
        tokens: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        deterministic: bool = True,
        token_types: jax.Array | None = None,
    ) -> tuple[jax.Array, None]:
        """Final hidden states [B, T, D] (and no pooled output), the interface heads use."""
        if token_types is not None:
            raise ValueError("Llama has no token-type embeddings; encode pairs with delimiter tokens instead")
        _, hidden = self(
            tokens, positions=positions, segment_ids=segment_ids, deterministic=deterministic, return_hidden=True
        )
        return hidden, None
