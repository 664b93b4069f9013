"""Verifiable rewards: the built-ins on hand-picked replies and on every GSM8K reference, name resolution, and the
process pool's handling of failing, hanging and batched functions."""

import functools
import importlib
import json
import multiprocessing
import os
import sys
import types

import numpy as np
import pytest

from lmzoo.rl import rewards

GSM8K_TEST = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "gsm8k", "test.jsonl")

# Reward functions for the pool tests. The workers import them by module name, so they live in a module of their own
# on sys.path (a test file's own module name depends on pytest's import mode).
HELPERS = """
import math
import time

from lmzoo.rl import rewards


def sometimes_fails(completion):
    if completion.startswith("bad"):
        raise ValueError("cannot score " + completion)
    return 1.0


def always_fails(completion):
    raise KeyError("no such thing")


def hangs(completion):
    if completion == "hang":
        time.sleep(60)
    return 1.0


@rewards.batched
def hangs_batched(prompts, completions):
    if "hang" in completions:
        time.sleep(60)
    return [2.0] * len(completions)


def odd_returns(completion):
    return {"nan": math.nan, "inf": math.inf, "text": "1.0", "none": None}.get(completion, 0.5)


def every_field(prompt, completion, **fields):
    return float(prompt == "P") + 10.0 * len(fields)


def needs_label(completion, label):
    return float(completion == label)


@rewards.batched
def batch_of_answers(prompts, completions, answer):
    return [float(a) + len(completions) for a in answer]
"""


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reward_helpers")
    (folder / "lmzoo_reward_helpers.py").write_text(HELPERS)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield importlib.import_module("lmzoo_reward_helpers")
        sys.modules.pop("lmzoo_reward_helpers", None)


def _rows(n, **fields):
    return [dict(fields) for _ in range(n)]


# --- gsm8k ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("So she makes 18 dollars.", "18"),
        ("Step one.\n#### 72", "Worked solution <<8*9=72>>\n#### 72"),
        ("#### 72\nand 9 more words", "72"),
        ("The total is \\boxed{1,234}.", "1234"),
        ("<answer>$1,234.</answer>", "#### 1,234"),
        ("It costs $5.00", "5"),
        ("It costs $ 5", "5"),
        ("<answer>50%</answer>", "50"),
        ("<answer>50\\%</answer>", "50"),
        ("<answer> 72 </answer>", "72"),
        ("that is 72.0", "72"),
        ("<answer>-8</answer>", "-8"),
        ("<answer>3/4</answer>", "0.75"),
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("<answer>2.5000000001</answer>", "2.5"),
        ("<answer>72</answer> Then I checked 80 and 81.", "72"),
        ("\\boxed{72} though 5 is also nice", "72"),
        ("<answer>\\boxed{72}</answer>", "72"),
        ("<answer>72 eggs</answer>", 72),
        ("\\boxed{18 \\text{ dollars}}", "18"),
    ],
)
def test_gsm8k_matches(completion, answer):
    assert rewards.gsm8k(completion, answer) == 1.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("I cannot tell.", "72"),  # no number
        ("<answer>8</answer>", "-8"),
        ("<answer>-8</answer>", "8"),
        ("<answer>3/4</answer>", "3"),  # a fraction is one value, not its last digit
        ("<answer>72.0000001</answer>", "72"),  # integers exactly
        ("<answer>2.51</answer>", "2.5"),
        ("<answer></answer> 72", "72"),  # an empty answer tag commits to no answer
        ("<answer>80</answer> #### 72", "72"),
        ("H2O", "2"),  # digits inside a word are no number
    ],
)
def test_gsm8k_mismatches(completion, answer):
    assert rewards.gsm8k(completion, answer) == 0.0


def test_gsm8k_asks_math_verify_when_the_plain_parse_fails(monkeypatch):
    monkeypatch.setattr(rewards, "_math_verify", None)
    assert rewards.gsm8k("<answer>\\pi</answer>", "#### \\pi") == 0.0
    fake = types.SimpleNamespace(parse=str.strip, verify=lambda gold, reply: gold == reply)
    monkeypatch.setattr(rewards, "_math_verify", fake)
    assert rewards.gsm8k("<answer> \\pi </answer>", "#### \\pi") == 1.0
    assert rewards.gsm8k("<answer>\\tau</answer>", "#### \\pi") == 0.0


@pytest.mark.skipif(not os.path.exists(GSM8K_TEST), reason="needs ../shared/data/gsm8k/test.jsonl")
def test_gsm8k_scores_every_reference_solution():
    with open(GSM8K_TEST) as f:
        solutions = [json.loads(line)["answer"] for line in f]
    assert len(solutions) > 1000
    for solution in solutions:
        assert rewards.gsm8k(solution, solution) == 1.0, solution
        body, final = solution.rsplit("####", 1)
        off_by_one = f"{body}#### {int(final.strip().replace(',', '')) + 1}"
        assert rewards.gsm8k(off_by_one, solution) == 0.0, off_by_one


# --- format and length ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>add them</think><answer>72</answer>", 1.0),
        ("  \n<think>\nline one\nline two\n</think>\n\n<answer>72</answer>\n", 1.0),
        ("<answer>72</answer>", 0.0),
        ("<think>a</think><answer>72</answer> and more", 0.0),
        ("<think>a</think> so <answer>72</answer>", 0.0),
        ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),
        ("<think>a</think></think><answer>1</answer>", 0.0),
    ],
)
def test_think_format(completion, expected):
    assert rewards.think_format(completion) == expected


def test_think_format_with_a_bound_pattern():
    answer_only = functools.partial(rewards.think_format, pattern=r"<answer>\d+</answer>")
    assert answer_only("<answer>72</answer>\n") == 1.0
    assert answer_only("<think>a</think><answer>72</answer>") == 0.0


def test_length_penalty():
    assert rewards.length_penalty("x" * 1000) == 0.0
    assert rewards.length_penalty("x" * 1500) == -0.5
    assert rewards.length_penalty("x" * 5000) == -1.0
    assert rewards.length_penalty("x" * 15, max_chars=10) == -0.5


# --- resolve ----------------------------------------------------------------------------------------------------


def test_resolve_built_ins_and_user_functions(tmp_path, monkeypatch):
    assert rewards.resolve("gsm8k") is rewards.gsm8k
    assert rewards.resolve("format") is rewards.think_format
    (tmp_path / "my_rewards_module.py").write_text("def exact(completion, answer):\n    return 1.0\nLIMIT = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = rewards.resolve("my_rewards_module:exact")
    assert fn.__name__ == "exact" and fn.__module__ == "my_rewards_module"
    with pytest.raises(ValueError, match="no_such_reward_module.*PYTHONPATH"):
        rewards.resolve("no_such_reward_module:f")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        rewards.resolve("my_rewards_module:missing")
    with pytest.raises(ValueError, match="LIMIT.*not a function"):
        rewards.resolve("my_rewards_module:LIMIT")
    with pytest.raises(ValueError, match="unknown reward function 'gsmk'.*gsm8k, format, length"):
        rewards.resolve("gsmk")


def test_resolve_all_weights():
    functions, weights = rewards.resolve_all("gsm8k, format")
    assert list(functions) == ["gsm8k", "format"] and weights == [1.0, 1.0]
    assert rewards.resolve_all("gsm8k,format,length", "1, 0.5, 2")[1] == [1.0, 0.5, 2.0]
    with pytest.raises(ValueError, match="1 reward weights"):
        rewards.resolve_all("gsm8k,format", "1")
    with pytest.raises(ValueError, match="not comma-separated numbers"):
        rewards.resolve_all("gsm8k", "heavy")
    with pytest.raises(ValueError, match="named twice: gsm8k"):
        rewards.resolve_all("gsm8k,gsm8k")


# --- the pool ---------------------------------------------------------------------------------------------------


def test_pool_weighted_sum():
    functions, weights = rewards.resolve_all("gsm8k,format,length", "1,0.5,2")
    completions = ["<think>x</think><answer>72</answer>", "<answer>72</answer>", "71" + " " * 1498]
    with rewards.RewardPool(functions, weights) as pool:
        scores = pool.score(["q"] * 3, completions, _rows(3, question="q", answer="#### 72"))
    assert scores.names == ("gsm8k", "format", "length")
    np.testing.assert_array_equal(scores.per_function, [[1, 1, 0], [1, 0, 0], [0, 0, -0.5]])
    np.testing.assert_array_equal(scores.total, [1.5, 1.0, -1.0])
    assert scores.total.dtype == scores.per_function.dtype == np.float32
    assert scores.failures == {"gsm8k": 0, "format": 0, "length": 0}


def test_pool_matches_direct_calls_on_many_samples():
    rng = np.random.default_rng(0)
    answers = [str(a) for a in rng.integers(0, 100, 200)]
    completions = [f"<think>t</think><answer>{int(a) + rng.integers(0, 2)}</answer>" for a in answers]
    rows = [{"answer": a} for a in answers]
    with rewards.RewardPool([rewards.gsm8k], [1.0], workers=2) as pool:
        scores = pool.score(completions, completions, rows)
    np.testing.assert_array_equal(scores.total, [rewards.gsm8k(c, a) for c, a in zip(completions, answers)])


def test_pool_passes_the_fields_a_function_names(helpers):
    bound = functools.partial(rewards.think_format, pattern="<answer>.*</answer>")
    functions = {"every_field": helpers.every_field, "bound": bound, "batch": helpers.batch_of_answers}
    rows = [{"prompt": "row's own prompt", "answer": "3", "question": "q"}, {"answer": "5", "question": "q"}]
    with rewards.RewardPool(functions, [1.0, 1.0, 1.0]) as pool:
        scores = pool.score(["P", "P"], ["<answer>x</answer>", "y"], rows)
    # every_field: the pool's prompt wins over the row's; **fields gets the other row fields.
    # batch_of_answers: one call with lists of the batch (answer + batch size).
    np.testing.assert_array_equal(scores.per_function, [[21, 21], [1, 0], [5, 7]])


def test_pool_scores_failing_samples_zero_and_goes_on(helpers):
    with rewards.RewardPool([helpers.sometimes_fails, helpers.odd_returns], [1.0, 1.0]) as pool:
        scores = pool.score(["q"] * 5, ["ok", "bad 1", "nan", "text", "none"], _rows(5))
        assert scores.failures == {"sometimes_fails": 1, "odd_returns": 3}
        np.testing.assert_array_equal(scores.per_function, [[1, 0, 1, 1, 1], [0.5, 0.5, 0, 0, 0]])
        assert pool.score(["q"] * 2, ["inf", "ok"], _rows(2)).failures == {"sometimes_fails": 0, "odd_returns": 1}


def test_pool_stops_on_a_function_that_always_fails(helpers):
    with rewards.RewardPool([helpers.sometimes_fails, helpers.always_fails], [1.0, 1.0]) as pool:
        with pytest.raises(rewards.RewardFunctionError, match="'always_fails' failed on all 3 samples") as error:
            pool.score(["q"] * 3, ["a", "b", "c"], _rows(3))
    assert error.value.name == "always_fails"
    assert "KeyError: 'no such thing'" in error.value.traceback
    assert str(error.value).count("Traceback (most recent call last)") == 1


def test_pool_abandons_hung_calls_and_recovers(helpers):
    functions = [helpers.hangs, helpers.hangs_batched]
    with rewards.RewardPool(functions, [1.0, 1.0], timeout_s=1.0, workers=2) as pool:
        # Chunks [a, hang] and [b, c]: the hung sample costs only itself; the batched call scores all 0.
        scores = pool.score(["q"] * 4, ["a", "hang", "b", "c"], _rows(4))
        np.testing.assert_array_equal(scores.per_function, [[1, 0, 1, 1], [0, 0, 0, 0]])
        assert scores.failures == {"hangs": 1, "hangs_batched": 4}
        workers = [p for p in multiprocessing.active_children() if p.name == "lmzoo-reward"]
        assert len(workers) == 2  # the hung ones were killed, not left behind
        scores = pool.score(["q"] * 3, ["a", "b", "c"], _rows(3))
        np.testing.assert_array_equal(scores.total, [3, 3, 3])
        assert scores.failures == {"hangs": 0, "hangs_batched": 0}


def test_pool_refuses_unusable_functions_at_set_up(helpers):
    with pytest.raises(ValueError, match="'<lambda>' cannot be sent.*not a lambda"):
        rewards.RewardPool([lambda completion: 1.0], [1.0])
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        rewards.RewardPool([rewards.gsm8k], [1.0, 1.0])
    with rewards.RewardPool([rewards.gsm8k, helpers.needs_label], [1.0, 1.0]) as pool:
        pool.check_fields(["answer", "label"])
        with pytest.raises(ValueError, match="'needs_label' takes the row field.*'label'.*they have: answer, question"):
            pool.check_fields(["question", "answer"])
        with pytest.raises(ValueError, match="'gsm8k' takes the row field.*'answer'.*they have: label, question"):
            pool.score(["q"], ["1"], [{"question": "q", "label": "1"}])
