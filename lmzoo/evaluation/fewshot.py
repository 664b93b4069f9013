"""In-context (zero-, one-, few-shot) multiple-choice evaluation, without gradient updates.

A task is a JSONL file of {"context": str, "choices": [str, ...], "gold": int}. The prompt of an example
is k demonstrations from a train split, each `template.format(context=...)` followed by its gold choice,
joined by `separator`, then the example's own formatted context. Demonstrations are drawn without
replacement by a generator seeded with (seed, example index), so a prompt depends on nothing else.
Every choice is scored as a continuation of the prompt (`scoring.loglikelihoods`; a decoder reads EOS
first, as at the start of every training document; an encoder-decoder reads the prompt plus EOS); the
prediction is the choice with the highest summed log-likelihood (`accuracy`) or the highest
log-likelihood per character of the choice (`accuracy_norm`, lm-eval's acc_norm). Accuracies come with
a 95% Wilson score interval. Prompts longer than the model's positions lose their oldest tokens
(`truncated_prompts` counts them).
"""

import dataclasses
import json
from collections.abc import Sequence

import numpy as np

from lmzoo import storage, tokenizers
from lmzoo.evaluation import scoring
from lmzoo.models import kinds


@dataclasses.dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    gold: int


def read_task(path: str) -> list[Example]:
    """The examples of a JSONL task file; a malformed line is an error naming the file and line."""
    examples = []
    with storage.open_read(path, text=True) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                example = Example(str(row["context"]), tuple(str(c) for c in row["choices"]), int(row["gold"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(
                    f"{path}:{number}: expected {{'context': str, 'choices': [str, ...], 'gold': int}} ({e})"
                ) from None
            if not 0 <= example.gold < len(example.choices):
                raise ValueError(
                    f"{path}:{number}: gold {example.gold} is not an index of its {len(example.choices)} choices"
                )
            examples.append(example)
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples


def draw_demonstrations(pool_size: int, k: int, index: int, seed: int = 0) -> np.ndarray:
    """Indices [k] into the train split for the example at `index` (without replacement)."""
    if k > pool_size:
        raise ValueError(f"k={k} demonstrations asked for, but the train split has {pool_size} examples")
    return np.random.default_rng([seed, index]).choice(pool_size, size=k, replace=False)


def build_prompt(example: Example, demonstrations: Sequence[Example], *, template: str, separator: str) -> str:
    shots = [template.format(context=d.context) + d.choices[d.gold] for d in demonstrations]
    return separator.join([*shots, template.format(context=example.context)])


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% for z = 1.96)."""
    p = correct / total
    center = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * np.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return float(center - half), float(center + half)


def _accuracy(correct: np.ndarray, prefix: str) -> dict:
    low, high = wilson_interval(int(correct.sum()), len(correct))
    return {prefix: float(correct.mean()), f"{prefix}_ci95": [low, high]}


def majority_baseline(train: Sequence[Example], examples: Sequence[Example]) -> dict:
    """Accuracy of always answering the choice index most often gold in the train split."""
    majority = int(np.bincount([e.gold for e in train]).argmax())
    return {"majority_gold": majority, **_accuracy(np.asarray([e.gold == majority for e in examples]), "accuracy")}


def evaluate_fewshot(
    model,
    params,
    tokenizer: tokenizers.Tokenizer,
    examples: Sequence[Example],
    train: Sequence[Example],
    *,
    k: int,
    template: str = "{context}",
    separator: str = "\n\n",
    seed: int = 0,
    batch_size: int = 16,
) -> tuple[dict, list[str]]:
    """({k, examples, accuracy, accuracy_ci95, accuracy_norm, accuracy_norm_ci95, truncated_prompts}, the prompts).

    A PPO policy is scored by its decoder (`kinds.generative`); a model that cannot score continuations (an encoder,
    a classifier, a recurrent or counted model) is refused before any prompt is built."""
    model, params = kinds.generative(model, params)
    if kinds.kind_of(model) not in (kinds.DECODER, kinds.ENCODER_DECODER):
        raise ValueError(
            f"{type(model).__name__} cannot score continuations; few-shot evaluation needs a decoder (gpt2, llama) "
            "or an encoder-decoder (seq2seq)"
        )
    prompts = [
        build_prompt(
            e, [train[j] for j in draw_demonstrations(len(train), k, i, seed)], template=template, separator=separator
        )
        for i, e in enumerate(examples)
    ]
    is_seq2seq = kinds.kind_of(model) == kinds.ENCODER_DECODER
    pairs, owners = [], []
    for i, (prompt, example) in enumerate(zip(prompts, examples, strict=True)):
        context = (
            tokenizer.encode(prompt) + [tokenizer.eos_id]
            if is_seq2seq
            else [tokenizer.eos_id, *tokenizer.encode(prompt)]
        )
        for choice in example.choices:
            pairs.append((context, tokenizer.encode(choice)))
            owners.append(i)
    limit = scoring.max_positions(model)
    truncated = len(
        {i for (c, n), i in zip(pairs, owners, strict=True) if limit is not None and len(c) + len(n) > limit + 1}
    )
    totals, _ = scoring.loglikelihoods(model, params, pairs, batch_size=batch_size, pad_id=tokenizer.pad_id or 0)
    correct, correct_norm, start = [], [], 0
    for example in examples:
        scores = totals[start : start + len(example.choices)]
        start += len(example.choices)
        lengths = np.asarray([max(len(c), 1) for c in example.choices])
        correct.append(int(np.argmax(scores)) == example.gold)
        correct_norm.append(int(np.argmax(scores / lengths)) == example.gold)
    result = {
        "k": k,
        "examples": len(examples),
        **_accuracy(np.asarray(correct), "accuracy"),
        **_accuracy(np.asarray(correct_norm), "accuracy_norm"),
        "truncated_prompts": truncated,
    }
    return result, prompts
