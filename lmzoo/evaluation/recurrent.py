"""Samples from a recurrent LM (`lmzoo.models.lstm`): sentences drawn after `<eos>`, printed by eval.py."""

import jax
import numpy as np

from lmzoo.models import lstm


def evaluate_samples(
    run,
    state,
    split: str = "validation",
    *,
    max_batches=None,
    num_samples: int = 3,
    max_new_tokens: int = 40,
    temperature: float = 1.0,
    seed: int = 0,
):
    """Draws `num_samples` continuations of `<eos>` (new sentences), prints them; metrics: mean sentence length.

    `split` and `max_batches` are unused (sampling reads no data)."""
    tokenizer = run.tokenizer
    params = jax.device_get(state.params)
    prompt = np.full((num_samples, 1), tokenizer.eos_id, np.int32)
    drawn = np.asarray(
        lstm.generate(
            run.model,
            params,
            prompt,
            jax.random.key(seed),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            vocab_size=tokenizer.vocab_size,
        )
    )
    texts, lengths = [], []
    for row in drawn.tolist():
        sentence = row[: row.index(tokenizer.eos_id)] if tokenizer.eos_id in row else row
        lengths.append(len(sentence))
        texts.append(tokenizer.decode(sentence))
        print(f"sample: {texts[-1]}")
    return {"sample_length": float(np.mean(lengths))}, [{"sample": t} for t in texts]
