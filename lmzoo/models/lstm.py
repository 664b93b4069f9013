"""LSTM language model (Zaremba et al. 2014): embedding, stacked LSTM layers scanned over time, softmax.

The recurrent state is an explicit carry {"c", "h"} [B, L, D] that the caller threads from one window
of a stream to the next (truncated backpropagation through time), so the module itself is pure.
Dropout acts on the non-recurrent connections only: after the embedding and after every layer.
Every parameter starts uniform in [-init_scale, init_scale], as in the paper.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import decoding, sharding
from lmzoo.layers import embeddings, linears
from lmzoo.models import kinds

Carry = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class LSTMConfig:
    """Sizes of the LSTM LM; the field names are exactly the keys of `config.model`.

    emb_dim is both the embedding and the hidden width (D), as in Zaremba et al."""

    vocab_size: int = 10000
    emb_dim: int = 200
    num_layers: int = 2
    dropout_rate: float = 0.0
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


def symmetric_uniform(scale: float):
    """Initializer drawing every entry uniformly from [-scale, scale]."""

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -scale, scale)

    return init


@dataclasses.dataclass(frozen=True)
class LSTMParts:
    """What every LSTM family here builds alike (the LM, ELMo's biLM, the VAE's encoder and decoder): compute and
    parameter dtypes, the uniform initializer of every weight, the token table [V, D] and a factory of LSTM layers
    of width D."""

    dtype: Any
    param_dtype: Any
    init: Callable
    embedding: jax.Array
    layer: Callable[..., "LSTMLayer"]


def lstm_parts(module: nn.Module, cfg: Any) -> LSTMParts:
    """`LSTMParts` of a family config with vocab_size, emb_dim, init_scale, dtype and param_dtype; declares
    `module`'s "embedding" param (call it in setup or a compact method)."""
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    init = symmetric_uniform(cfg.init_scale)
    table_init = nn.with_logical_partitioning(init, ("vocab", "embed"))
    embedding = module.param("embedding", table_init, (cfg.vocab_size, cfg.emb_dim), param_dtype)
    return LSTMParts(
        dtype,
        param_dtype,
        init,
        embedding,
        functools.partial(LSTMLayer, cfg.emb_dim, cfg.init_scale, dtype, param_dtype),
    )


def per_position(dense: nn.Dense, hidden: jax.Array) -> jax.Array:
    """`dense` at every position, hidden [B, T, D] -> [B, T, F], as one [B*T, D] x [D, F] matmul (see `linears.project`)."""
    return dense(hidden.reshape(-1, hidden.shape[-1])).reshape(hidden.shape[:-1] + (-1,))


class LSTMLayer(nn.Module):
    """One LSTM layer over a window: gates i, f, g, o from one [D_in + D, 4D] affine map.

    Attributes:
        hidden: width D of the cell and hidden state.
        init_scale: half-width of the uniform initializer.
        dtype: of the computation, the outputs and the final (c, h); param_dtype: of the weights.
    """

    hidden: int
    init_scale: float = 0.1
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, state: tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [B, T, D_in], state (c, h) each [B, D] -> outputs [B, T, D], final (c, h)."""
        init = symmetric_uniform(self.init_scale)
        gates = 4 * self.hidden
        param = functools.partial(self.param, dtype=self.param_dtype)
        wi = param("wi", nn.with_logical_partitioning(init, ("embed", "mlp")), (x.shape[-1], gates))
        wh = param("wh", nn.with_logical_partitioning(init, ("embed", "mlp")), (self.hidden, gates))
        bias = param("bias", nn.with_logical_partitioning(init, ("mlp",)), (gates,))
        # The input half of every step's gates in one matmul, time-major for the scan: [T, B, 4D].
        x = jnp.swapaxes(x, 0, 1).astype(self.dtype)
        # The bias in dtype too: a float32 bias would turn a bfloat16 scan carry into float32.
        input_gates = linears.project("TBD,DG->TBG", x, wi.astype(self.dtype)) + bias.astype(self.dtype)

        def cell(carry, step_gates):
            c, h = carry
            i, f, g, o = jnp.split(step_gates + h @ wh.astype(self.dtype), 4, axis=-1)
            c = nn.sigmoid(f) * c + nn.sigmoid(i) * jnp.tanh(g)
            h = nn.sigmoid(o) * jnp.tanh(c)
            return (c, h), h

        state = tuple(s.astype(self.dtype) for s in state)
        (c, h), outputs = jax.lax.scan(cell, state, input_gates)
        return jnp.swapaxes(outputs, 0, 1), (c, h)  # [T, B, D] -> [B, T, D]


class LSTM(nn.Module):
    """Stacked LSTM LM with an untied softmax layer (weights and bias).

    Attributes:
        config: an `LSTMConfig`.
    """

    kind: ClassVar[str] = kinds.RECURRENT

    config: LSTMConfig

    def initial_carry(self, batch_size: int) -> Carry:
        """Zero state {"c", "h"} [B, L, D]."""
        zeros = jnp.zeros((batch_size, self.config.num_layers, self.config.emb_dim), jnp.float32)
        return {"c": zeros, "h": zeros}

    @nn.compact
    def __call__(
        self, tokens: jax.Array, carry: Carry, *, deterministic: bool = True, return_layers: bool = False
    ) -> tuple[jax.Array, Carry] | tuple[jax.Array, Carry, list[jax.Array]]:
        """tokens [B, T], carry [B, L, D] each -> logits [B, T, V], carry after the window.

        With `return_layers`, also the outputs of the embedding and of every layer, each [B, T, D]."""
        cfg = self.config
        parts = lstm_parts(self, cfg)
        dtype, init = parts.dtype, parts.init
        param = functools.partial(self.param, dtype=parts.param_dtype)
        x = embeddings.embed_lookup(parts.embedding, tokens).astype(dtype)
        x = sharding.constrain(x, ("act_batch", "act_len", "act_embed"))
        layer_outputs = [x]
        cs, hs = [], []
        for layer in range(cfg.num_layers):
            x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
            x, (c, h) = parts.layer(name=f"layer_{layer}")(x, (carry["c"][:, layer], carry["h"][:, layer]))
            layer_outputs.append(x)
            cs.append(c)
            hs.append(h)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        out = param("out", nn.with_logical_partitioning(init, ("embed", "vocab")), (cfg.emb_dim, cfg.vocab_size))
        out_bias = param("out_bias", nn.with_logical_partitioning(init, ("vocab",)), (cfg.vocab_size,))
        # Logits in float32 whatever the dtype (the matmul accumulates in float32).
        logits = linears.project(
            "BTD,DV->BTV", x, out.astype(dtype), preferred_element_type=jnp.promote_types(dtype, jnp.float32)
        )
        logits = logits + out_bias.astype(logits.dtype)
        new_carry = {
            "c": jnp.stack(cs, axis=1).astype(carry["c"].dtype),
            "h": jnp.stack(hs, axis=1).astype(carry["h"].dtype),
        }
        if return_layers:
            return logits, new_carry, layer_outputs
        return logits, new_carry


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "temperature", "top_k", "top_p", "vocab_size"))
def generate(
    model: LSTM,
    params,
    prompt: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    vocab_size: int | None = None,
) -> jax.Array:
    """prompt [B, P] (P >= 1) -> [B, max_new_tokens] ids sampled one at a time, the carry threaded through;
    none >= vocab_size (the tokenizer's)."""
    logits, carry = model.apply({"params": params}, prompt, model.initial_carry(prompt.shape[0]))

    def step(state, key):
        last_logits, carry = state
        token = decoding.sample_logits(
            key, last_logits, temperature=temperature, top_k=top_k, top_p=top_p, vocab_size=vocab_size
        )
        logits, carry = model.apply({"params": params}, token[:, None], carry)
        return (logits[:, -1], carry), token

    _, tokens = jax.lax.scan(step, (logits[:, -1], carry), jax.random.split(rng, max_new_tokens))
    return tokens.T
