"""GPT (Radford et al. 2018, post-LN) and GPT-2 (Radford et al. 2019, pre-LN) decoders.

One decoder with switches:
    GPT   : x = LN(x + attn(x)); x = LN(x + mlp(x)); no final norm.
    GPT-2 : x = x + attn(LN(x)); x = x + mlp(LN(x)); final LayerNorm; residual output
            projections initialised with std 0.02 / sqrt(2 * num_layers).
Both use learned absolute positions and (by default) an output head tied to the token embedding.
Load HuggingFace GPT-2 weights with `lmzoo.convert.hf`.
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
class GPT2Config:
    """Decoder hyper-parameters; the field names are exactly the keys of `config.model`."""

    vocab_size: int = 50257
    max_len: int = 1024
    emb_dim: int = 768
    num_heads: int = 12
    num_layers: int = 12
    mlp_dim: int = 3072
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    pre_norm: bool = True
    tie_embeddings: bool = True
    scale_residual_init: bool = True
    activation: str = "gelu_tanh"
    use_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat_policy: str = "none"

    def __post_init__(self):
        kinds.check_fields(
            self,
            sizes=("vocab_size", "max_len", "emb_dim", "num_heads", "num_layers", "mlp_dim"),
            positive=("layer_norm_epsilon",),
            rates=("dropout_rate", "attention_dropout_rate"),
        )
        if self.emb_dim % self.num_heads:
            raise ValueError(
                f"config.model.emb_dim={self.emb_dim} must be divisible by config.model.num_heads={self.num_heads}"
            )
        mlp.activation(self.activation)

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.num_heads


class GPT2(kinds.DecoderOutputs, nn.Module):
    """Causal decoder LM.

    Attributes:
        config: GPT2Config.
    """

    kind: ClassVar[str] = kinds.DECODER
    token_table: ClassVar[str] = "wte"

    config: GPT2Config

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

        positions [B, T]: position ids (default 0..T-1, which must fit the max_len table: T > max_len
        raises; packed examples restart per document). segment_ids [B, T]: document ids of packed
        examples (attention stays within a document; 0 = padding). decode: run one chunk against the
        KV cache (see `lmzoo.decoding`).
        """
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        if positions is None:
            embeddings.check_length(tokens.shape[1], cfg.max_len, what="GPT-2 input")
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        wte = embeddings.Embed(cfg.vocab_size, cfg.emb_dim, dtype=dtype, param_dtype=param_dtype, name="wte")
        wpe = embeddings.Embed(
            cfg.max_len,
            cfg.emb_dim,
            axes=("position", "embed"),
            dtype=dtype,
            param_dtype=param_dtype,
            name="wpe",
        )
        x = wte(tokens) + wpe(positions)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        block = blocks.TransformerBlock(
            attention.AttentionConfig(
                cfg.num_heads,
                cfg.head_dim,
                use_bias=cfg.use_bias,
                dropout_rate=cfg.attention_dropout_rate,
            ),
            mlp_dim=cfg.mlp_dim,
            causal=True,
            pre_norm=cfg.pre_norm,
            activations=(cfg.activation,),
            use_bias=cfg.use_bias,
            layer_norm_epsilon=cfg.layer_norm_epsilon,
            dropout_rate=cfg.dropout_rate,
            residual_init_std=0.02 / (2 * cfg.num_layers) ** 0.5 if cfg.scale_residual_init else 0.02,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        x = blocks.BlockStack(
            block, cfg.num_layers, scan=cfg.scan_layers, remat_policy=cfg.remat_policy, name="blocks"
        )(x, segment_ids, deterministic=deterministic, decode=decode)
        if cfg.pre_norm:
            x = norms.LayerNorm(
                epsilon=cfg.layer_norm_epsilon,
                use_bias=cfg.use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                name="ln_final",
            )(x)
        x = sharding.constrain(x, ("act_batch", "act_len", "act_embed"))
        logits = embeddings.output_logits(x, wte, tied=cfg.tie_embeddings, dtype=dtype, param_dtype=param_dtype)
        return (logits, x) if return_hidden else logits
