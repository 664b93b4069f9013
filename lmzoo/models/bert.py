"""Bidirectional encoders: BERT, RoBERTa, ALBERT and DistilBERT as switches of one module.

    BERT       post-LN blocks, token-type embeddings, pooler ([CLS] -> dense -> tanh), NSP head.
    RoBERTa    type_vocab_size=1, no pooler/NSP, position ids start at position_offset=2
               (pad tokens get position_offset-1), byte-level BPE vocabulary.
    ALBERT     factorized embeddings (embedding_dim E << emb_dim H, then an E -> H projection),
               one block shared by all layers (share_layers), sentence-order head.
    DistilBERT type_vocab_size=0, no pooler, 6 layers (initialised from every other teacher layer).

All share the MLM head: dense (H -> E), activation, LayerNorm, decoder tied to the word
embeddings plus a bias. Networks return logits; losses live in `lmzoo.objectives`.
"""

import dataclasses
import functools
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import sharding
from lmzoo.layers import attention, blocks, embeddings, linears, mlp, norms
from lmzoo.models import kinds


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Encoder hyper-parameters; the field names are exactly the keys of `config.model`."""

    vocab_size: int = 30522
    max_len: int = 512
    emb_dim: int = 768
    embedding_dim: int = 0  # E of factorized embeddings (ALBERT); 0 = emb_dim
    embed_projection: bool = False  # E -> H dense after the embeddings (HF ALBERT has it even when E == H)
    num_heads: int = 12
    num_layers: int = 12
    mlp_dim: int = 3072
    type_vocab_size: int = 2  # 0 = no token-type embeddings (DistilBERT)
    position_offset: int = 0  # first position id (RoBERTa: 2)
    share_layers: bool = False
    pooler: bool = True
    sentence_head: bool = True  # NSP (BERT) / SOP (ALBERT) classifier on the pooled output
    activation: str = "gelu"
    layer_norm_epsilon: float = 1e-12
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat_policy: str = "none"

    def __post_init__(self):
        kinds.check_fields(
            self,
            sizes=("vocab_size", "max_len", "emb_dim", "num_heads", "num_layers", "mlp_dim"),
            counts=("embedding_dim", "type_vocab_size", "position_offset"),
            positive=("layer_norm_epsilon",),
            rates=("dropout_rate", "attention_dropout_rate"),
        )
        if self.embed_dim != self.emb_dim:  # factorized embeddings always project
            object.__setattr__(self, "embed_projection", True)
        if self.emb_dim % self.num_heads:
            raise ValueError(
                f"config.model.emb_dim={self.emb_dim} must be divisible by config.model.num_heads={self.num_heads}"
            )
        if self.sentence_head and not self.pooler:
            raise ValueError("sentence_head needs pooler=True (NSP/SOP classify the pooled [CLS] state)")
        mlp.activation(self.activation)

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.num_heads

    @property
    def embed_dim(self) -> int:
        return self.embedding_dim or self.emb_dim


class Bert(nn.Module):
    """Encoder with MLM (and NSP/SOP) heads.

    Entry points: `__call__` -> MLM logits [B, T, V]; `encode` -> (hidden [B, T, H], pooled [B, H]
    or None); `sentence_logits(pooled)` -> [B, 2].
    """

    kind: ClassVar[str] = kinds.ENCODER

    config: BertConfig

    def setup(self):
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        embed = functools.partial(embeddings.Embed, dtype=dtype, param_dtype=param_dtype)
        dense = functools.partial(linears.Einsum, use_bias=True, dtype=dtype, param_dtype=param_dtype)
        norm = functools.partial(norms.LayerNorm, epsilon=cfg.layer_norm_epsilon, dtype=dtype, param_dtype=param_dtype)
        e, h = cfg.embed_dim, cfg.emb_dim
        self.word_embeddings = embed(cfg.vocab_size, e)
        self.position_embeddings = embed(cfg.max_len, e, axes=("position", "embed"))
        if cfg.type_vocab_size:
            self.token_type_embeddings = embed(cfg.type_vocab_size, e, axes=("classes", "embed"))
        self.ln_embed = norm()
        if cfg.embed_projection:
            self.embed_projection = dense((e, h), ("embed", "mlp"))
        block = blocks.TransformerBlock(
            attention.AttentionConfig(cfg.num_heads, cfg.head_dim, dropout_rate=cfg.attention_dropout_rate),
            mlp_dim=cfg.mlp_dim,
            causal=False,
            pre_norm=False,
            activations=(cfg.activation,),
            layer_norm_epsilon=cfg.layer_norm_epsilon,
            dropout_rate=cfg.dropout_rate,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.blocks = blocks.BlockStack(
            block, cfg.num_layers, scan=cfg.scan_layers, remat_policy=cfg.remat_policy, share_params=cfg.share_layers
        )
        if cfg.pooler:
            self.pooler = dense((h, h), ("embed", "mlp"))
        if cfg.sentence_head:
            self.sentence_classifier = dense((h, 2), ("embed", "classes"))
        self.mlm_dense = dense((h, e), ("mlp", "embed"))
        self.mlm_norm = norm()
        self.mlm_bias = self.param(
            "mlm_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)), (cfg.vocab_size,), param_dtype
        )
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def _positions(self, tokens: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        index = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if not self.config.position_offset:
            return index
        # RoBERTa numbers real tokens from position_offset and gives padding position_offset - 1.
        valid = jnp.ones_like(tokens) if segment_ids is None else (segment_ids != 0).astype(jnp.int32)
        return jnp.cumsum(valid, axis=1) * valid + (self.config.position_offset - 1)

    def encode(
        self,
        tokens: jax.Array,
        *,
        token_types: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        deterministic: bool = True,
    ) -> tuple[jax.Array, jax.Array | None]:
        """tokens [B, T]; token_types [B, T] (sentence A/B); segment_ids [B, T] (0 = padding; packed
        examples use 1, 2, ...) -> (hidden [B, T, H], pooled [B, H] or None).

        Without explicit positions, T + position_offset > max_len raises (the table has no row for them).
        """
        cfg = self.config
        if positions is None:
            embeddings.check_length(tokens.shape[1], cfg.max_len, offset=cfg.position_offset, what="encoder input")
            positions = self._positions(tokens, segment_ids)
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)
        if cfg.type_vocab_size:
            x = x + self.token_type_embeddings(jnp.zeros_like(tokens) if token_types is None else token_types)
        x = self.dropout(self.ln_embed(x), deterministic=deterministic)
        if cfg.embed_projection:
            x = self.embed_projection("BTE,EH->BTH", x)
        x = self.blocks(x, segment_ids, deterministic=deterministic)
        x = sharding.constrain(x, ("act_batch", "act_len", "act_embed"))
        pooled = jnp.tanh(self.pooler("BH,HK->BK", x[:, 0])) if cfg.pooler else None
        return x, pooled

    def mlm_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, T, H] (or gathered [B, M, H]) -> logits [B, T, V]."""
        x = mlp.activation(self.config.activation)(self.mlm_dense("BTH,HE->BTE", hidden))
        logits = self.word_embeddings.attend(self.mlm_norm(x)) + self.mlm_bias
        return sharding.constrain(logits, ("act_batch", "act_len", "act_vocab"))

    def pretraining_logits(
        self,
        tokens: jax.Array,
        prediction_positions: jax.Array,
        *,
        token_types: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        deterministic: bool = True,
    ) -> tuple[jax.Array, jax.Array | None]:
        """MLM logits only at prediction_positions [B, M] -> [B, M, V] (the vocabulary projection is
        the costliest matmul, so pretraining computes it for the ~15% masked positions only), and
        NSP/SOP logits [B, 2] (None without a sentence head)."""
        hidden, pooled = self.encode(
            tokens, token_types=token_types, segment_ids=segment_ids, deterministic=deterministic
        )
        gathered = jnp.take_along_axis(hidden, prediction_positions[..., None], axis=1)
        sentence = self.sentence_logits(pooled) if self.config.sentence_head else None
        return self.mlm_logits(gathered), sentence

    def sentence_logits(self, pooled: jax.Array) -> jax.Array:
        """pooled [B, H] -> NSP/SOP logits [B, 2]."""
        return self.sentence_classifier("BH,HC->BC", pooled)

    def __call__(
        self,
        tokens: jax.Array,
        *,
        token_types: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """MLM logits [B, T, V]; with a sentence head also its logits [B, 2]."""
        hidden, pooled = self.encode(
            tokens, token_types=token_types, segment_ids=segment_ids, positions=positions, deterministic=deterministic
        )
        logits = self.mlm_logits(hidden)
        if self.config.sentence_head:
            return logits, self.sentence_logits(pooled)
        return logits


def distilbert_student_params(teacher_params: dict[str, Any], teacher_layers: int) -> dict[str, Any]:
    """DistilBERT init: the teacher's params with every other layer (0, 2, 4, ...) kept.

    Works on the per-layer layout (`blocks/layer_i`); pooler/sentence head are dropped.
    """
    blocks = teacher_params["blocks"]
    kept = {f"layer_{j}": blocks[f"layer_{i}"] for j, i in enumerate(range(0, teacher_layers, 2))}
    dropped = ("pooler", "sentence_classifier")
    return {**{k: v for k, v in teacher_params.items() if k not in dropped and k != "blocks"}, "blocks": kept}
