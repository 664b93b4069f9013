"""Text continuations of a prompt from a trained decoder or encoder-decoder, and text-to-text generations
scored against their references."""

import jax
import numpy as np

from lmzoo import decoding
from lmzoo.evaluation import reconstruction
from lmzoo.models import kinds


def sample_text(
    run,
    params,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    note_window: bool = True,
    stop_ids: tuple[int, ...] = (),
    stops: tuple[str, ...] = (),
) -> str:
    """Decodes a continuation of `prompt` with the KV cache; params are host arrays (`CompiledTrainer.host_params`).

    Encoder-decoders read the prompt (plus EOS) with the encoder and write a new sequence. A decoder generates any
    length (`decoding.generate` slides its window past the model's positions), saying so when `note_window`
    (the end-of-training sample, which needs no note). The continuation ends at EOS, and at any of `stop_ids` (a
    checkpoint's other eos ids) or `stops` (texts: a chat template's end of turn), which a decoder stops sampling at
    while its positions last, and which are cut from the text returned."""
    tokenizer = run.tokenizer
    model, params = kinds.generative(run.model, params)
    if kinds.kind_of(model) == kinds.DECODER:
        model, params = kinds.decoding_form(model, params)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: ask for at least one new token")
    sampling = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id or 0,
        vocab_size=tokenizer.vocab_size,
    )
    kind = kinds.kind_of(model)
    if kind == kinds.ENCODER_DECODER:
        inputs = np.asarray([tokenizer.encode(prompt) + [tokenizer.eos_id]])
        new = decoding.generate_seq2seq(
            model, params, inputs, rng=jax.random.key(seed), max_new_tokens=max_new_tokens, **sampling
        )
    elif kind == kinds.DECODER:
        ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
        max_len = model.config.max_len
        if len(ids) + max_new_tokens > max_len and note_window:
            print(
                f"note: the prompt ({len(ids)} tokens) and {max_new_tokens} new tokens pass the model's {max_len} "
                f"positions: each token past them is predicted from the last {max_len} (a sliding window)"
            )
        stop_sequences = tuple((i,) for i in stop_ids) + tuple(tuple(tokenizer.encode(s)) for s in stops if s)
        new = decoding.generate(
            model,
            params,
            np.asarray([ids]),
            rng=jax.random.key(seed),
            max_new_tokens=max_new_tokens,
            stop_sequences=stop_sequences,
            **sampling,
        )
    else:
        raise ValueError(
            f"{type(model).__name__} is not generative; --generate needs a decoder (gpt2, llama) or an encoder-decoder (seq2seq)"
        )
    out = [int(t) for t in np.asarray(new[0])]
    ends = [k for k, t in enumerate(out) if t == tokenizer.eos_id or t in stop_ids]
    text = tokenizer.decode(out[: ends[0]] if ends else out)
    for stop in stops:
        text = text.split(stop, 1)[0] if stop else text
    return text


def evaluate_generation(
    run, state, split: str = "validation", *, max_batches: int | None = None
) -> tuple[dict, list[dict]]:
    """(metrics, examples) of greedy generations for a text-to-text run's evaluation examples.

    Each example's encoder input is decoded greedily (`decoding.sample_seq2seq`, jitted) until EOS or the
    target length, and the text before EOS is scored against the reference target's: BLEU, ROUGE-1/2/L and
    exact match (`reconstruction.text_metrics`), over `generated_examples` examples of `evaluated_batches`
    batches. Examples are {"source", "generation", "reference"}. Padding rows are skipped.
    """
    tokenizer, model = run.tokenizer, run.model
    if kinds.kind_of(model) != kinds.ENCODER_DECODER:
        raise ValueError(f"generation scoring needs an encoder-decoder (seq2seq), not {type(model).__name__}")
    params, eos, pad = run.compiled.host_params(state), tokenizer.eos_id, tokenizer.pad_id or 0

    def text(ids) -> str:
        ids = [int(i) for i in ids if i != pad]
        return tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids)

    examples, count = [], 0
    for batch in run.eval_batches(split):
        if max_batches is not None and count >= max_batches:
            break
        count += 1
        keep = batch["example_weights"] > 0
        inputs, segments, targets = batch["inputs"][keep], batch["encoder_segment_ids"][keep], batch["targets"][keep]
        samples = decoding.sample_seq2seq(
            model,
            params,
            inputs,
            segments,
            jax.random.key(0),
            max_new_tokens=targets.shape[1],
            temperature=0.0,
            eos_id=eos,
            pad_id=pad,
            vocab_size=tokenizer.vocab_size,
        )
        tokens, mask = jax.device_get((samples.tokens, samples.mask))
        for source, generated, generated_mask, target in zip(inputs, tokens, mask, targets, strict=True):
            examples.append(
                {"source": text(source), "generation": text(generated[generated_mask > 0]), "reference": text(target)}
            )
    if not examples:
        raise ValueError(f"the {split} split has no examples to generate for")
    metrics = reconstruction.text_metrics([e["generation"] for e in examples], [e["reference"] for e in examples])
    return {**metrics, "generated_examples": len(examples), "evaluated_batches": count}, examples
