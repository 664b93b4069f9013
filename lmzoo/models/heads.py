"""Task heads on any backbone with `encode(tokens, ...) -> (hidden [B, T, D], pooled [B, D] | None)`.

    SequenceClassifier  one label per sequence from the first token ([CLS]: BERT & co.), the last
                        real token (the GPT classifier on `[START] a [DELIM] b [EXTRACT]`), or the mean.
    TokenClassifier     one output per token (the separate PPO value model: one output).
    LMWithValueHead     a decoder's logits plus a scalar value per token (the PPO policy with a shared trunk).
    LMWithValueModel    a decoder's logits plus the values of a separate value network (its own trunk).

Head styles of the HF checkpoints: "pooler" (BERT, ALBERT: the backbone's tanh pooler, then a
linear layer), "dense_tanh" (RoBERTa), "dense_relu" (DistilBERT), "linear" (GPT).

Whatever the backbone's dtype and param_dtype (bfloat16), the heads' own layers compute in float32 (its hidden
states cast up) and keep float32 params: class logits, rewards and values are what the losses read.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo.layers import linears

HEAD_STYLES = ("pooler", "dense_tanh", "dense_relu", "linear")
POOLINGS = ("first", "last", "mean")


def pool(hidden: jax.Array, segment_ids: jax.Array | None, how: str) -> jax.Array:
    """hidden [B, T, D] -> [B, D]; "last" and "mean" skip padding (segment id 0) on either side."""
    if how == "first":
        return hidden[:, 0]
    valid = jnp.ones(hidden.shape[:2], bool) if segment_ids is None else segment_ids != 0
    if how == "last":
        # Index of the last valid token, so left- and right-padded rows both work.
        last = hidden.shape[1] - 1 - jnp.argmax(valid[:, ::-1], axis=1)
        return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    if how == "mean":
        weights = valid[..., None].astype(hidden.dtype)
        return jnp.sum(hidden * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
    raise ValueError(f"unknown pooling {how!r}; choose one of {POOLINGS}")


class SequenceClassifier(nn.Module):
    """tokens [B, T] -> logits [B, num_classes].

    Attributes:
        backbone: an encoder or decoder module (lmzoo.models.*).
        head: one of HEAD_STYLES.
        pooling: one of POOLINGS (ignored by head="pooler", which uses the backbone's pooler).
        classifier_init: initializer of the output kernel.
    """

    backbone: nn.Module
    num_classes: int
    head: str = "pooler"
    pooling: str = "first"
    dropout_rate: float = 0.1
    classifier_init: nn.initializers.Initializer = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self, tokens, *, token_types=None, segment_ids=None, positions=None, deterministic: bool = True):
        if self.head not in HEAD_STYLES:
            raise ValueError(f"unknown head {self.head!r}; choose one of {HEAD_STYLES}")
        hidden, pooled = self.backbone.encode(
            tokens, token_types=token_types, segment_ids=segment_ids, positions=positions, deterministic=deterministic
        )
        d = hidden.shape[-1]
        if self.head == "pooler":
            if pooled is None:
                raise ValueError("head='pooler' needs a backbone with a pooler (BERT/ALBERT with pooler=True)")
            x = pooled
        else:
            x = pool(hidden, segment_ids, self.pooling)
        dropout = nn.Dropout(self.dropout_rate)
        if self.head in ("dense_tanh", "dense_relu"):
            x = dropout(x, deterministic=deterministic)
            x = linears.Einsum((d, d), ("embed", "mlp"), use_bias=True, name="head_dense")("BD,DK->BK", x)
            x = jnp.tanh(x) if self.head == "dense_tanh" else jax.nn.relu(x)
        x = dropout(x, deterministic=deterministic)
        classifier = linears.Einsum(
            (d, self.num_classes),
            ("embed", "classes"),
            use_bias=True,
            kernel_init=self.classifier_init,
            name="classifier",
        )
        return classifier("BD,DC->BC", x)


class TokenClassifier(nn.Module):
    """tokens [B, T] -> logits [B, T, num_labels]."""

    backbone: nn.Module
    num_labels: int
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, tokens, *, token_types=None, segment_ids=None, positions=None, deterministic: bool = True):
        hidden, _ = self.backbone.encode(
            tokens, token_types=token_types, segment_ids=segment_ids, positions=positions, deterministic=deterministic
        )
        hidden = nn.Dropout(self.dropout_rate)(hidden, deterministic=deterministic)
        d = hidden.shape[-1]
        return linears.Einsum((d, self.num_labels), ("embed", "classes"), use_bias=True, name="classifier")(
            "BTD,DC->BTC", hidden
        )


class _PolicyDecoder:
    """What a policy (a decoder with values) offers the forwards that read no values: its decoder's config and
    `window_logits` (with the KV cache in decode mode), run under the policy's own module paths ("decoder/..."), so
    LoRA adapters attached to the policy's params apply as in its call (`serving.slots.shared_prompt_logits`)."""

    decoder: nn.Module

    @property
    def config(self):
        return self.decoder.config

    def window_logits(self, tokens, window, **forward):
        return self.decoder.window_logits(tokens, window, **forward)


class LMWithValueHead(_PolicyDecoder, nn.Module):
    """tokens [B, T] -> (logits [B, T, V], values [B, T]): a decoder LM and a value head on its final hidden states.

    The head starts at zero (V ≡ 0, Ziegler et al. 2019), so the value loss cannot disturb the
    policy early on. The decoder's parameters sit under "decoder", so an SFT checkpoint loads there
    and the sampler can run the decoder alone on params["decoder"].
    """

    decoder: nn.Module

    @nn.compact
    def __call__(self, tokens, *, segment_ids=None, positions=None, deterministic: bool = True, logits_window=None):
        """logits_window (start, end): the logits of those positions alone, [B, end - start, V]
        (`models.kinds.DecoderOutputs.window_logits`)."""
        forward = dict(positions=positions, segment_ids=segment_ids, deterministic=deterministic)
        if logits_window is None:
            logits, hidden = self.decoder(tokens, **forward, return_hidden=True)
        else:
            logits, hidden = self.decoder.window_logits(tokens, logits_window, **forward)
        d = hidden.shape[-1]
        head = linears.Einsum(
            (d, 1), ("embed", "classes"), use_bias=True, kernel_init=nn.initializers.zeros, name="value_head"
        )
        return logits, head("BTD,DC->BTC", hidden)[..., 0]


class LMWithValueModel(_PolicyDecoder, nn.Module):
    """tokens [B, T] -> (logits [B, T, V], values [B, T]): a decoder LM and a separate value network.

    The two share no parameters ("decoder" and "value_model"), so the policy loss never reaches the
    value network and the value loss never reaches the policy (InstructGPT, TRL's PPO). value_model
    maps tokens to [B, T, 1] (`lmzoo.rl.reward.value_model`) and must be a module instance of its own.
    """

    decoder: nn.Module
    value_model: nn.Module

    @nn.compact
    def __call__(self, tokens, *, segment_ids=None, positions=None, deterministic: bool = True, logits_window=None):
        """logits_window: as `LMWithValueHead`'s."""
        forward = dict(positions=positions, segment_ids=segment_ids, deterministic=deterministic)
        if logits_window is None:
            logits = self.decoder(tokens, **forward)
        else:
            logits, _ = self.decoder.window_logits(tokens, logits_window, **forward)
        values = self.value_model(tokens, segment_ids=segment_ids, positions=positions, deterministic=deterministic)
        return logits, values[..., 0]
