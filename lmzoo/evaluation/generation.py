"""Text continuations of a prompt from a trained decoder or encoder-decoder."""

import jax
import numpy as np

from lmzoo import decoding
from lmzoo.models import gpt2, seq2seq


def sample_text(run, params, prompt: str, *, max_new_tokens: int, temperature: float,
                top_k: int, top_p: float, seed: int, fit_to_model: bool = False) -> str:  # fmt: skip
    """Decodes a continuation of `prompt` with the KV cache; params are host arrays (`loop.host_params`).

    Encoder-decoders read the prompt (plus EOS) with the encoder and write a new sequence. A decoder's
    prompt plus new tokens must fit its positions: more is an error, or with `fit_to_model` is cut to fit."""
    tokenizer, model = run.tokenizer, run.model
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: ask for at least one new token")
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id or 0)
    if isinstance(model, seq2seq.Seq2Seq):
        inputs = np.asarray([tokenizer.encode(prompt) + [tokenizer.eos_id]])
        new = decoding.generate_seq2seq(model, params, inputs, rng=jax.random.key(seed), max_new_tokens=max_new_tokens, **sampling)
    elif isinstance(model, gpt2.GPT2):
        ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
        room = model.config.max_len - len(ids)
        if room <= 0:
            raise ValueError(f"the prompt is {len(ids)} tokens and the model's max_len is {model.config.max_len}; shorten the prompt")
        if fit_to_model:
            max_new_tokens = min(max_new_tokens, room)
        elif max_new_tokens > room:
            raise ValueError(f"max_new_tokens={max_new_tokens} does not fit: the prompt is {len(ids)} tokens and the model's "
                             f"max_len is {model.config.max_len}; ask for at most {room}")  # fmt: skip
        new = decoding.generate(model, params, np.asarray([ids]), rng=jax.random.key(seed), max_new_tokens=max_new_tokens, **sampling)
    else:
        raise ValueError(f"{type(model).__name__} is not generative; --generate needs a decoder (gpt2) or an encoder-decoder (seq2seq)")
    out = [int(t) for t in np.asarray(new[0])]
    if tokenizer.eos_id in out:
        out = out[: out.index(tokenizer.eos_id)]
    return tokenizer.decode(out)
