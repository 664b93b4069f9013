"""Few-shot evaluation: deterministic prompts, predictions from the choices' log-likelihoods, intervals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import testing, tokenizers
from lmzoo.evaluation import fewshot

TRAIN = [fewshot.Example(f"t{i}", (" a", " bb"), i % 2) for i in range(6)]
EVAL = [fewshot.Example(text, (" a", " bb", " c"), gold) for text, gold in (("x", 0), ("yy", 1), ("z", 2), ("w", 1))]


def test_read_task_and_its_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"context": "c", "choices": ["p", "q"], "gold": 1}) + "\n\n")
    assert fewshot.read_task(str(good)) == [fewshot.Example("c", ("p", "q"), 1)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"context": "c", "choices": ["p"], "gold": 0})
        + "\n"
        + json.dumps({"context": "c", "choices": ["p"]})
    )
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        fewshot.read_task(str(bad))
    bad.write_text(json.dumps({"context": "c", "choices": ["p"], "gold": 3}))
    with pytest.raises(ValueError, match="gold 3"):
        fewshot.read_task(str(bad))


def test_demonstrations_are_deterministic_and_distinct():
    first = fewshot.draw_demonstrations(100, 8, index=3, seed=0)
    np.testing.assert_array_equal(first, fewshot.draw_demonstrations(100, 8, index=3, seed=0))
    assert len(set(first.tolist())) == 8
    assert not np.array_equal(first, fewshot.draw_demonstrations(100, 8, index=4, seed=0))
    with pytest.raises(ValueError, match="k=7"):
        fewshot.draw_demonstrations(6, 7, index=0)


def test_prompt_layout():
    prompt = fewshot.build_prompt(EVAL[0], TRAIN[:2], template="Q: {context}\nA:", separator="\n\n")
    assert prompt == "Q: t0\nA: a\n\nQ: t1\nA: bb\n\nQ: x\nA:"


def test_wilson_interval():
    low, high = fewshot.wilson_interval(5, 10)
    np.testing.assert_allclose([low, high], [0.2366, 0.7634], atol=1e-4)  # Wilson (1927), as in statsmodels
    assert fewshot.wilson_interval(10, 10)[1] == pytest.approx(1.0)


def test_predictions_are_the_argmax_of_the_choice_loglikelihoods():
    model, params = testing.tiny_gpt2(vocab_size=40, max_len=64)
    tokenizer = tokenizers.CharTokenizer.from_corpus(["Q: abcxyzwt0123456789\nA"])
    for k in (0, 2):
        result, prompts = fewshot.evaluate_fewshot(
            model, params, tokenizer, EVAL, TRAIN, k=k, template="Q: {context}\nA:", batch_size=4
        )
        correct, correct_norm = [], []
        for example, prompt in zip(EVAL, prompts, strict=True):
            assert prompt.count("\n\n") == k and prompt.endswith(f"Q: {example.context}\nA:")
            scores = []
            for choice in example.choices:
                ids = [tokenizer.eos_id, *tokenizer.encode(prompt + choice)]
                log_probs = np.asarray(jax.nn.log_softmax(model.apply({"params": params}, jnp.asarray([ids[:-1]]))[0]))
                n = len(choice)
                scores.append(log_probs[np.arange(len(ids) - 1 - n, len(ids) - 1), ids[-n:]].sum())
            correct.append(int(np.argmax(scores)) == example.gold)
            correct_norm.append(int(np.argmax(np.asarray(scores) / [len(c) for c in example.choices])) == example.gold)
        assert result["accuracy"] == np.mean(correct) and result["accuracy_norm"] == np.mean(correct_norm)
        assert result["examples"] == 4 and result["truncated_prompts"] == 0
        assert result["accuracy_ci95"][0] <= result["accuracy"] <= result["accuracy_ci95"][1]


def test_majority_baseline():
    baseline = fewshot.majority_baseline(TRAIN[:3], EVAL)  # golds 0, 1, 0: answer 0 everywhere
    assert baseline["majority_gold"] == 0 and baseline["accuracy"] == 0.25
