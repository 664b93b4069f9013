"""ELMo (Peters et al. 2018): a bidirectional LSTM LM whose layers, mixed by softmax weights times gamma, are
contextual features for downstream models.

The forward stack reads a sentence left to right and predicts the next token; the backward stack reads it
right to left (each row reversed within its length, padding left in place) and predicts the previous token.
Both share the token embedding and the softmax layer. `BiLM.__call__` also returns every layer in sentence
order, [L + 1, B, T, 2D]: layer 0 is the embedding twice (as ELMo's token layer), layer j the forward and
backward outputs of LSTM layer j side by side. `ScalarMix` and `ELMoClassifier` consume those layers as
frozen features (computed outside the gradient).
"""

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo.layers.embeddings import embed_lookup
from lmzoo.models import kinds
from lmzoo.models.lstm import lstm_parts, per_position


@dataclasses.dataclass(frozen=True)
class ELMoConfig:
    """Sizes of the biLM; the field names are exactly the keys of `config.model`. emb_dim is also the LSTM width."""

    vocab_size: int = 10000
    emb_dim: int = 256
    num_layers: int = 2
    dropout_rate: float = 0.1
    init_scale: float = 0.1
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        kinds.check_fields(
            self,
            sizes=("vocab_size", "emb_dim", "num_layers"),
            positive=("init_scale",),
            rates=("dropout_rate",),
        )


def reverse_within_length(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """x [B, T, ...] -> row b's first lengths[b] entries in reverse order; positions past the length unchanged."""
    t = jnp.arange(x.shape[1])
    index = jnp.where(t < lengths[:, None], lengths[:, None] - 1 - t, t)  # [B, T]
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


class BiLM(nn.Module):
    """Forward and backward LSTM stacks over a shared embedding and softmax.

    Attributes:
        config: an `ELMoConfig`.
    """

    kind: ClassVar[str] = kinds.RECURRENT

    config: ELMoConfig

    def setup(self):
        cfg = self.config
        parts = lstm_parts(self, cfg)
        self.embedding = parts.embedding
        self.forward_layers = [parts.layer() for _ in range(cfg.num_layers)]
        self.backward_layers = [parts.layer() for _ in range(cfg.num_layers)]
        kernel_init = nn.with_logical_partitioning(parts.init, ("embed", "vocab"))
        self.out = nn.Dense(cfg.vocab_size, kernel_init=kernel_init, dtype=parts.dtype, param_dtype=parts.param_dtype)
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def __call__(self, tokens: jax.Array, weights: jax.Array, *, deterministic: bool = True):
        """tokens, weights [B, T] (sentences, padding weighted 0) -> forward logits [B, T, V] (position t predicts
        token t + 1), backward logits [B, T, V] (position t predicts token t - 1), layers [L + 1, B, T, 2D]."""
        lengths = jnp.sum(weights, axis=1).astype(jnp.int32)
        x = embed_lookup(self.embedding, tokens).astype(self.config.dtype)
        zeros = jnp.zeros((tokens.shape[0], self.config.emb_dim), x.dtype)
        forward, backward = x, reverse_within_length(x, lengths)
        layers = [jnp.concatenate([x, x], axis=-1)]
        for forward_layer, backward_layer in zip(self.forward_layers, self.backward_layers, strict=True):
            forward, _ = forward_layer(self.dropout(forward, deterministic=deterministic), (zeros, zeros))
            backward, _ = backward_layer(self.dropout(backward, deterministic=deterministic), (zeros, zeros))
            layers.append(jnp.concatenate([forward, reverse_within_length(backward, lengths)], axis=-1))
        forward_logits = per_position(self.out, self.dropout(forward, deterministic=deterministic))
        backward_logits = reverse_within_length(
            per_position(self.out, self.dropout(backward, deterministic=deterministic)), lengths
        )
        return forward_logits, backward_logits, jnp.stack(layers)


class ScalarMix(nn.Module):
    """gamma * sum_j softmax(s)_j * layer_j: layers [L + 1, B, T, D] -> [B, T, D]."""

    @nn.compact
    def __call__(self, layers: jax.Array) -> jax.Array:
        scores = self.param("scores", nn.initializers.zeros, (layers.shape[0],))
        gamma = self.param("gamma", nn.initializers.ones, ())
        return gamma * jnp.einsum("L,LBTD->BTD", jax.nn.softmax(scores), layers)


class ELMoClassifier(nn.Module):
    """Sentence classifier on frozen ELMo layers: scalar mix, mean over real tokens, dropout, linear.

    Attributes:
        num_classes: output classes C.
        dropout_rate: on the pooled features.
    """

    num_classes: int
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, layers: jax.Array, weights: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """layers [L + 1, B, T, D], weights [B, T] -> logits [B, C]."""
        mixed = ScalarMix()(layers)
        pooled = jnp.sum(mixed * weights[..., None], axis=1) / jnp.maximum(jnp.sum(weights, axis=1, keepdims=True), 1.0)
        pooled = nn.Dropout(self.dropout_rate)(pooled, deterministic=deterministic)
        return nn.Dense(self.num_classes)(pooled)
