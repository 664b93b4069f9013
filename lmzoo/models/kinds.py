"""What a model family is, declared by its module class as `kind`; evaluation asks for the kind, not the class.

- DECODER: `model(tokens, positions=, segment_ids=) -> logits [B, T, V]`, a KV cache for `lmzoo.decoding.generate`,
  `max_len` positions (GPT-2).
- ENCODER: bidirectional, `pretraining_logits` (BERT family); scored by its objectives, not by continuations.
- ENCODER_DECODER: `model(inputs, decoder_inputs, encoder_segment_ids=) -> logits`, `decoding.generate_seq2seq`
  and beam search (T5, BART, the Transformer).
- RECURRENT: `model(tokens, carry) -> (logits, carry)` (LSTM LM, ELMo's biLM).
- LATENT: a sentence VAE (`vae_lm`), scored by its ELBO / importance-weighted bound.
- COUNTED: a count-based model, its config standing for the module (`ngram`).

Each family's config dataclass also checks its own fields on construction (`check_fields`).
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import sharding
from lmzoo.convert import mapping
from lmzoo.layers import adapters, embeddings, linears, norms

DECODER = "decoder"
ENCODER = "encoder"
ENCODER_DECODER = "encoder_decoder"
RECURRENT = "recurrent"
LATENT = "latent"
COUNTED = "counted"


def kind_of(model) -> str | None:
    """The kind a model declares (None for wrappers such as classifier heads, which declare none)."""
    return getattr(model, "kind", None)


def generative(model, params) -> tuple:
    """(model, params) that generate text: the model itself, or the decoder a wrapper without a kind holds under
    "decoder" (a PPO policy with its value head or value network: the policy is what was trained)."""
    inner = getattr(model, "decoder", None)
    if kind_of(model) is None and kind_of(inner) == DECODER and "decoder" in params:
        return inner, params["decoder"]
    return model, params


def decoding_form(model, params) -> tuple:
    """(model, params) to generate with: a model whose stack is scanned (`scan_layers`) as the same model looped, its
    params split per layer (`convert.mapping.unstack_layers`, slices of the same arrays: traceable inside `jax.jit`)
    with any attached LoRA adapters merged (`layers.adapters.merge_attached`); any other model as it is.

    Decoding through a scanned stack slices every layer's KV cache out of the stacked cache and stacks the updated
    ones back at every step, each step copying the whole cache several times; looped, each layer writes its new
    keys and values into its own cache in place. The looped program compiles each layer on its own: a decode step is
    small, and generation compiles it once."""
    config = getattr(model, "config", None)
    if not getattr(config, "scan_layers", False):
        return model, params
    looped = model.clone(config=dataclasses.replace(config, scan_layers=False))
    return looped, mapping.unstack_layers(adapters.merge_attached(nn.unbox(params)), take=lambda leaf, i: leaf[i])


def check_fields(
    config: Any,
    *,
    sizes: Sequence[str] = (),
    counts: Sequence[str] = (),
    positive: Sequence[str] = (),
    rates: Sequence[str] = (),
) -> None:
    """Raises one ValueError naming every out-of-range field of a family config dataclass as `config.model.FIELD`
    with its fix (called from each family's `__post_init__`, so `models.make_config` checks them all before any
    model is built): sizes >= 1, counts >= 0, positive (epsilons, scales) > 0, rates (dropout) in [0, 1)."""
    rules = [
        *((f, lambda v: v >= 1, "must be a positive integer; set --config.model.{f}=N with N >= 1") for f in sizes),
        *((f, lambda v: v >= 0, "must be >= 0; set --config.model.{f}=0 or more") for f in counts),
        *((f, lambda v: v > 0, "must be > 0; set --config.model.{f} to a positive value") for f in positive),
        *(
            (f, lambda v: 0 <= v < 1, "must be in [0, 1); set e.g. --config.model.{f}=0.1 (0 turns it off)")
            for f in rates
        ),
    ]
    problems = [
        f"config.model.{f}={getattr(config, f)!r}: {why.format(f=f)}"
        for f, ok, why in rules
        if not ok(getattr(config, f))
    ]
    if problems:
        raise ValueError("; ".join(problems))


class DecoderOutputs:
    """What a decoder family exposes besides its call (GPT-2, Llama): `output_embedding` for the fused LM head,
    `window_logits` for a few positions' logits and `encode` for the heads built on it. Mixed into the family's
    module, whose token table is the param collection `token_table` and whose untied head is "lm_head"
    (`layers.embeddings.output_logits`)."""

    token_table: ClassVar[str]

    def output_embedding(self) -> jax.Array:
        """The output projection as [V, D]: the token table when tied, else lm_head's kernel transposed.

        With the final hidden states (`return_hidden`) it lets a loss compute the logits in chunks
        (`lmzoo.objectives.losses.fused_head_loss`)."""
        params = nn.unbox(self.variables["params"])
        return params[self.token_table]["embedding"] if self.config.tie_embeddings else params["lm_head"]["kernel"].T

    def window_logits(
        self,
        tokens: jax.Array,
        window: tuple[int, int],
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
    ) -> tuple[jax.Array, jax.Array]:
        """tokens [B, T] -> (logits [B, end - start, V] of positions start..end-1 alone, final hidden states
        [B, T, D]) for window (start, end): the head reads only those positions (a policy's log-probs of its replies
        need no logits over the prompts, a prefill only its last position's), and under jit the call's full
        [B, T, V] logits, unused, are never computed. decode: as the call's (the KV cache filled)."""
        start, end = window
        _, hidden = self(
            tokens,
            positions=positions,
            segment_ids=segment_ids,
            deterministic=deterministic,
            decode=decode,
            return_hidden=True,
        )
        dtype = jnp.dtype(self.config.dtype)
        embedding = self.output_embedding().astype(dtype)  # [V, D]
        logits = linears.project("BTD,VD->BTV", hidden[:, start:end].astype(dtype), embedding)
        return sharding.constrain(logits, ("act_batch", "act_len", "act_vocab")), hidden

    def encode(
        self,
        tokens: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        deterministic: bool = True,
        token_types: jax.Array | None = None,
    ) -> tuple[jax.Array, None]:
        """Final hidden states [B, T, D] (and no pooled output), the interface heads use.

        token_types is accepted for interface compatibility with encoders and must be None.
        """
        if token_types is not None:
            raise ValueError(
                f"{type(self).__name__} has no token-type embeddings; encode pairs with delimiter tokens instead"
            )
        _, hidden = self(
            tokens, positions=positions, segment_ids=segment_ids, deterministic=deterministic, return_hidden=True
        )
        return hidden, None


def embed_tokens(
    cfg: Any, tokens: jax.Array, *, positions: jax.Array | None, deterministic: bool, what: str, scale: bool = False
) -> tuple[jax.Array, embeddings.Embed]:
    """The rotary decoders' input (Llama, DeepSeek, Qwen3.5; called inside the family's compact call, so the table
    is its "embed"): tokens [B, T] -> (embeddings [B, T, D] after dropout, the table for a tied head). Without
    `positions` (they count 0..T-1 from constant tables) T is checked against cfg.max_len, naming `what`. `scale`:
    times sqrt(D), rounded to the activation dtype first as HF's Gemma does."""
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    if positions is None:
        embeddings.check_length(tokens.shape[1], cfg.max_len, what=what)
    embed = embeddings.Embed(
        cfg.vocab_size,
        cfg.emb_dim,
        embedding_init=nn.initializers.normal(cfg.init_std),
        dtype=dtype,
        param_dtype=param_dtype,
        name="embed",
    )
    x = embed(tokens)
    if scale:
        x = x * jnp.asarray(cfg.emb_dim**0.5, x.dtype)
    return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic), embed


def decoder_logits(
    cfg: Any, x: jax.Array, embed: embeddings.Embed, *, return_hidden: bool
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The rotary decoders' output: the last layer's x [B, T, D] through the final RMSNorm ("norm") -> logits
    [B, T, V] from the token table (tied) or "lm_head", and the normed x when `return_hidden`."""
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    x = norms.LayerNorm(
        epsilon=cfg.norm_epsilon, use_bias=False, use_mean=False, dtype=dtype, param_dtype=param_dtype, name="norm"
    )(x)
    x = sharding.constrain(x, ("act_batch", "act_len", "act_embed"))
    logits = embeddings.output_logits(
        x,
        embed,
        tied=cfg.tie_embeddings,
        kernel_init=nn.initializers.normal(cfg.init_std),
        dtype=dtype,
        param_dtype=param_dtype,
    )
    return (logits, x) if return_hidden else logits
