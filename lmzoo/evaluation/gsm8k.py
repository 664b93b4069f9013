"""GSM8K: greedy accuracy and pass@k of a decoder's free-form answers to grade-school maths problems.

Rows are GSM8K's jsonl: {"question": str, "answer": str}, the answer a worked solution whose last line is `#### N`
(`read_rows`). A row's prompt is `template.format(**row)` (default "Question: {question}\\nAnswer:"), encoded as it
is (no EOS or BOS before it, as lm-eval's `generate_until` and `eval.py --generate` encode a prompt); a prompt longer
than the model's positions less `max_new_tokens` keeps its last tokens (`truncated_prompts` counts them). Prompts go
`batch_size` at a time through `decoding.sample` (KV cache), left-padded to the batch's longest prompt rounded up to 16
tokens (fewer compiled shapes), the last batch filled up with copies of its last prompt (one batch shape).

A reply is the sampled tokens up to EOS, decoded, then cut before the first "\\nQuestion:" (`STOP`: a base model goes
on with the next question of the few-shot pattern it sees; sampling also stops there when those tokens come). It is
correct when `lmzoo.rl.rewards.gsm8k(completion=reply, answer=row["answer"])` is 1: the reply's final number (in its
last <answer> or \\boxed{}, after its last ####, else its last number) equals the reference's `#### N`.

- `accuracy` (also reported as `pass@1`): greedy decoding, one reply per problem.
- `pass@k` for each k > 1: n = max(k) replies sampled per problem at `temperature` (> 0); with c of them correct, the
  unbiased estimator 1 - C(n-c, k) / C(n, k) of Chen et al. (2021, "Evaluating Large Language Models Trained on
  Code"), averaged over problems (`pass_at_k`). `pass@1_sampled` is the mean c / n. The key of batch b is
  `fold_in(key(seed), b)`, so the samples depend on seed and batch_size.
"""

import math
from collections.abc import Sequence

import jax
import numpy as np

from lmzoo import decoding, tokenizers
from lmzoo.data import problems
from lmzoo.evaluation import scoring
from lmzoo.models import kinds
from lmzoo.rl import rewards

DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
STOP = "\nQuestion:"


def read_rows(path: str) -> list[dict]:
    """The rows of a GSM8K-format jsonl file (local or in a bucket) or a synthetic task (`lmzoo.data.problems`), each
    with string "question" and "answer" and an answer that states a final number (it scores itself 1); errors name
    the file and the line or row."""
    rows = problems.read_rows(path)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    for number, row in enumerate(rows, 1):
        if rewards.gsm8k(completion=row["answer"], answer=row["answer"]) != 1.0:
            raise ValueError(
                f"{path}: row {number}'s answer {row['answer'][-60:]!r} states no final number (GSM8K's answers end "
                "in '#### N')"
            )
    return rows


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c are correct: 1 - C(n-c, k) / C(n, k), exact integer
    binomials (Chen et al. 2021); 1 when n - c < k (every draw of k holds a correct one)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _stop_sequences(tokenizer: tokenizers.Tokenizer, stop: str) -> tuple[tuple[int, ...], ...]:
    """`stop`'s ids as a stop sequence for the sampler, when they decode back to it (a character vocabulary that
    lacks one of its characters would otherwise stop at a different text)."""
    ids = tokenizer.encode(stop) if stop else []
    return (tuple(ids),) if ids and tokenizer.decode(ids) == stop else ()


def generate_replies(
    model,
    params,
    tokenizer: tokenizers.Tokenizer,
    prompts: Sequence[str],
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    batch_size: int = 16,
    seed: int = 0,
    stop: str = STOP,
) -> tuple[list[list[str]], int]:
    """([prompts][samples] replies, the number of prompts truncated to fit): `batch_size` prompts a call, each
    repeated `samples` times, through `decoding.sample` (left-padded, KV cache)."""
    eos, pad = tokenizer.eos_id, tokenizer.pad_id or 0
    keep = scoring.prompt_room(model, max_new_tokens, "max_new_tokens")
    encoded = [tokenizer.encode(p) or [eos] for p in prompts]
    truncated = sum(keep is not None and len(ids) > keep for ids in encoded)
    settings = dict(
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        eos_id=eos,
        stop_sequences=_stop_sequences(tokenizer, stop),
        pad_id=pad,
        vocab_size=tokenizer.vocab_size,
    )
    size = min(batch_size, len(encoded))
    replies = []
    for index, start in enumerate(range(0, len(encoded), size)):
        chunk = encoded[start : start + size]
        tokens, mask = scoring.generation_prompts(chunk + [chunk[-1]] * (size - len(chunk)), keep=keep, pad_id=pad)
        tokens, mask = np.repeat(tokens, samples, axis=0), np.repeat(mask, samples, axis=0)
        rng = jax.random.fold_in(jax.random.key(seed), index)
        out = decoding.sample(model, params, tokens, mask, rng, **settings)
        new, new_mask = jax.device_get((out.tokens, out.mask))
        texts = [decoding.reply_text(tokenizer, t, m, (stop,)) for t, m in zip(new, new_mask, strict=True)]
        replies += [texts[i * samples : (i + 1) * samples] for i in range(len(chunk))]
    return replies, truncated


def evaluate(
    model,
    params,
    tokenizer: tokenizers.Tokenizer,
    rows: Sequence[dict],
    *,
    template: str = DEFAULT_TEMPLATE,
    k_values: Sequence[int] = (1,),
    max_new_tokens: int = 256,
    temperature: float = 0.8,
    batch_size: int = 16,
    seed: int = 0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop: str = STOP,
    show: int = 3,
) -> dict:
    """{examples, accuracy, pass@1, pass@k for each k > 1 in k_values, pass@1_sampled and samples_per_problem (when
    k > 1 asks for samples), truncated_prompts, replies (the first `show` greedy ones: question, reply, reference,
    correct)} of a decoder on GSM8K-format `rows` (see the module docstring). temperature, top_k and top_p apply to
    the sampled replies only; `accuracy` is greedy.

    A PPO policy answers with its decoder (`kinds.generative`); a model that is not a decoder is refused."""
    model, params = kinds.generative(model, params)
    if kinds.kind_of(model) != kinds.DECODER:
        raise ValueError(f"GSM8K evaluation needs a decoder (gpt2, llama); this run is {type(model).__name__}")
    model, params = kinds.decoding_form(model, params)
    k_values = sorted({1, *(int(k) for k in k_values)})
    if k_values[0] < 1:
        raise ValueError(f"pass@k asks for k={k_values[0]}: each k must be >= 1")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} and batch_size={batch_size} must be >= 1")
    samples = k_values[-1]
    if samples > 1:
        if not temperature > 0:
            raise ValueError(
                f"pass@{samples} draws {samples} replies per problem: temperature must be > 0, not {temperature} "
                "(greedy replies are all the same)"
            )
        decoding.check_sampling(temperature=temperature, top_k=top_k, top_p=top_p, vocab_size=tokenizer.vocab_size)
    if not rows:
        raise ValueError("no GSM8K rows to evaluate")
    prompts = [problems.format_prompt(template, row, i) for i, row in enumerate(rows)]
    common = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, stop=stop)
    greedy, truncated = generate_replies(
        model, params, tokenizer, prompts, samples=1, temperature=0.0, seed=seed, **common
    )
    correct = [rewards.gsm8k(completion=r[0], answer=row["answer"]) == 1.0 for r, row in zip(greedy, rows, strict=True)]
    accuracy = float(np.mean(correct))
    result = {"examples": len(rows), "accuracy": accuracy, "pass@1": accuracy}
    if samples > 1:
        sampled, _ = generate_replies(
            model,
            params,
            tokenizer,
            prompts,
            samples=samples,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            **common,
        )
        counts = [
            sum(rewards.gsm8k(completion=reply, answer=row["answer"]) == 1.0 for reply in replies)
            for replies, row in zip(sampled, rows, strict=True)
        ]
        for k in k_values[1:]:
            result[f"pass@{k}"] = float(np.mean([pass_at_k(samples, c, k) for c in counts]))
        result["pass@1_sampled"] = float(np.mean(counts) / samples)
        result["samples_per_problem"] = samples
    result["truncated_prompts"] = truncated
    result["replies"] = [
        {"question": row.get("question"), "reply": reply[0], "reference": row["answer"], "correct": ok}
        for row, reply, ok in list(zip(rows, greedy, correct, strict=True))[:show]
    ]
    return result
