"""What a model family is, declared by its module class as `kind`; evaluation asks for the kind, not the class.

- DECODER: `model(tokens, positions=, segment_ids=) -> logits [B, T, V]`, a KV cache for `lmzoo.decoding.generate`,
  `max_len` positions (GPT-2).
- ENCODER: bidirectional, `pretraining_logits` (BERT family); scored by its objectives, not by continuations.
- ENCODER_DECODER: `model(inputs, decoder_inputs, encoder_segment_ids=) -> logits`, `decoding.generate_seq2seq`
  and beam search (T5, BART, the Transformer).
- RECURRENT: `model(tokens, carry) -> (logits, carry)` (LSTM LM, ELMo's biLM).
- LATENT: a sentence VAE (`vae_lm`), scored by its ELBO / importance-weighted bound.
- COUNTED: a count-based model, its config standing for the module (`ngram`).
"""

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
