"""Gaussian VAE language model (Bowman et al. 2016): LSTM encoder -> q(z | x) = N(mu, sigma^2), LSTM decoder p(x | z).

The encoder reads a sentence and maps its last real hidden state to (mu, log sigma^2) [B, Z]; z = mu + sigma * eps
(reparameterised); the decoder starts from a state computed from z and also sees z at every step next to the
word embedding. Encoder and decoder share the token embedding. The KL to the N(0, I) prior is closed-form
(`gaussian_kl`); the losses (ELBO with annealing and free bits, importance-weighted bound) live in
lmzoo/objectives/vae_lm.py.
"""

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import decoding
from lmzoo.layers import embeddings
from lmzoo.models import kinds
from lmzoo.models.lstm import lstm_parts, per_position


@dataclasses.dataclass(frozen=True)
class VAELMConfig:
    """Sizes of the VAE-LM; the field names are exactly the keys of `config.model`. emb_dim is also the LSTM width.

    latent_dim 0 leaves the decoder alone: an LSTM LM from a zero state (no encoder, KL 0, exact likelihood).
    dtype is that of the LSTMs and projections; the posterior (mu, logvar) and z stay float32."""

    vocab_size: int = 10000
    emb_dim: int = 256
    latent_dim: int = 32
    dropout_rate: float = 0.0
    init_scale: float = 0.1
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        kinds.check_fields(
            self,
            sizes=("vocab_size", "emb_dim"),
            counts=("latent_dim",),
            positive=("init_scale",),
            rates=("dropout_rate",),
        )


def gaussian_kl(mu: jax.Array, logvar: jax.Array) -> jax.Array:
    """KL(N(mu, exp(logvar)) || N(0, I)) per dimension: [..., Z] -> [..., Z]."""
    return 0.5 * (jnp.exp(logvar) + mu**2 - 1.0 - logvar)


def gaussian_log_density(z: jax.Array, mu: jax.Array, logvar: jax.Array) -> jax.Array:
    """log N(z; mu, exp(logvar)) summed over the last axis: [..., Z] -> [...]."""
    return -0.5 * jnp.sum(jnp.log(2 * jnp.pi) + logvar + (z - mu) ** 2 / jnp.exp(logvar), axis=-1)


class VAELM(nn.Module):
    """Entry points: `encode`, `decode`, and `__call__` (encode, sample z, decode).

    Attributes:
        config: a `VAELMConfig`.
    """

    kind: ClassVar[str] = kinds.LATENT

    config: VAELMConfig

    def setup(self):
        cfg = self.config
        parts = lstm_parts(self, cfg)
        init = parts.init
        self.embedding = parts.embedding
        dense = functools.partial(nn.Dense, dtype=parts.dtype, param_dtype=parts.param_dtype)
        self.encoder = parts.layer()
        self.posterior = dense(2 * cfg.latent_dim, kernel_init=nn.with_logical_partitioning(init, ("embed", None)))
        self.initial_state = dense(2 * cfg.emb_dim, kernel_init=nn.with_logical_partitioning(init, (None, "embed")))
        self.decoder = parts.layer()
        self.out = dense(cfg.vocab_size, kernel_init=nn.with_logical_partitioning(init, ("embed", "vocab")))
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def encode(self, tokens: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens, weights [B, T] (a sentence, padding weighted 0) -> mu, logvar [B, Z]."""
        b, d = tokens.shape[0], self.config.emb_dim
        if self.config.latent_dim == 0:  # no latent: no encoder (and no zero-size parameters, which orbax cannot save)
            return jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.float32)
        zeros = jnp.zeros((b, d), jnp.float32)
        hidden, _ = self.encoder(embeddings.embed_lookup(self.embedding, tokens), (zeros, zeros))
        last = jnp.maximum(jnp.sum(weights, axis=1).astype(jnp.int32) - 1, 0)
        summary = hidden[jnp.arange(b), last]  # [B, D]: the state after the sentence's last real token
        # float32 whatever the dtype: the KL and the importance weights exponentiate logvar.
        mu, logvar = jnp.split(self.posterior(summary).astype(jnp.float32), 2, axis=-1)
        return mu, logvar

    def start_state(self, z: jax.Array) -> tuple[jax.Array, jax.Array]:
        """z [B, Z] -> the decoder's initial (c, h), each [B, D] in dtype (zeros when Z = 0)."""
        if self.config.latent_dim == 0:
            zeros = jnp.zeros((z.shape[0], self.config.emb_dim), self.config.dtype)
            return zeros, zeros
        c, h = jnp.split(self.initial_state(z), 2, axis=-1)
        return c, jnp.tanh(h)

    def decode(
        self, z: jax.Array, inputs: jax.Array, state: tuple[jax.Array, jax.Array], *, deterministic: bool = True
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """z [B, Z], inputs [B, T] (the sentence shifted right), state (c, h) -> logits [B, T, V], state after."""
        x = embeddings.embed_lookup(self.embedding, inputs).astype(self.config.dtype)
        x = self.dropout(x, deterministic=deterministic)
        x = jnp.concatenate([x, jnp.broadcast_to(z[:, None], x.shape[:2] + z.shape[-1:]).astype(x.dtype)], axis=-1)
        hidden, state = self.decoder(x, state)
        return per_position(self.out, self.dropout(hidden, deterministic=deterministic)), state

    def __call__(self, tokens, inputs, weights, *, rng: jax.Array, deterministic: bool = True):
        """One reparameterised sample: tokens/inputs/weights [B, T] -> logits [B, T, V], mu, logvar [B, Z]."""
        mu, logvar = self.encode(tokens, weights)
        z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(rng, mu.shape)
        logits, _ = self.decode(z, inputs, self.start_state(z), deterministic=deterministic)
        return logits, mu, logvar


@functools.partial(jax.jit, static_argnames=("model", "max_len", "temperature", "vocab_size"))
def generate_from_latent(
    model: VAELM,
    params,
    z: jax.Array,
    rng: jax.Array,
    *,
    bos_id: int,
    max_len: int,
    temperature: float = 0.0,
    vocab_size: int | None = None,
) -> jax.Array:
    """z [B, Z] -> [B, max_len] ids decoded one at a time from `bos_id` (greedy at temperature 0), none >=
    vocab_size (the tokenizer's)."""
    state = model.apply({"params": params}, z, method=model.start_state)

    def step(carry, key):
        token, state = carry
        logits, state = model.apply({"params": params}, z, token[:, None], state, method=model.decode)
        token = decoding.sample_logits(
            key, logits[:, -1], temperature=temperature, top_k=0, top_p=1.0, vocab_size=vocab_size
        )
        return (token, state), token

    start = jnp.full((z.shape[0],), bos_id, jnp.int32)
    _, tokens = jax.lax.scan(step, (start, state), jax.random.split(rng, max_len))
    return tokens.T
