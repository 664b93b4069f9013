"""GRPO with verifiable rewards: problems read from GSM8K's file and generated in memory, reward functions scoring
sampled replies inside the jitted scoring phase through the host pool, the successors' flags reaching the loss, and
bad settings refused before any work."""

import pathlib
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo.data import problems
from lmzoo.objectives import ppo
from lmzoo.rl import policy_gradient
from lmzoo.train import loop
from lmzoo.train import run as run_lib

REPO = pathlib.Path(__file__).resolve().parents[2]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def _config(tmp_path=None, **objective):
    from lmzoo.config import load_config_file

    config = load_config_file(REPO / "configs" / "gsm8k.py", "tiny")
    for key, value in objective.items():
        config.objective[key] = value
    return config


def test_synthetic_addition_is_deterministic_and_checked():
    rows = problems.synthetic_rows("synthetic:addition?digits=3&n=50&seed=1")
    assert rows == problems.synthetic_rows("synthetic:addition?digits=3&n=50&seed=1")
    assert all(int(r["answer"]) == sum(int(x) for x in r["question"].split("+")) for r in rows)
    assert max(int(x) for r in rows for x in r["question"].split("+")) < 1000
    with pytest.raises(ValueError, match="unknown synthetic task 'sums'"):
        problems.synthetic_rows("synthetic:sums")
    with pytest.raises(ValueError, match="unknown option 'digit'"):
        problems.synthetic_rows("synthetic:addition?digit=3")


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k")
def test_gsm8k_rows_become_prompts_and_solutions():
    assert problems.is_problem_file(str(GSM8K))
    read = problems.read_problems(str(GSM8K), "Question: {question}\nAnswer:")
    assert len(read) == 1319
    assert read[0].prompt.startswith("Question: ") and read[0].prompt.endswith("\nAnswer:")
    assert "####" in problems.solution(read[0].fields) and "<<" not in problems.solution(read[0].fields)
    with pytest.raises(ValueError, match="KeyError: 'problem'"):
        problems.read_problems(str(GSM8K), "{problem}")


def _trainer_and_objective(**objective):
    config = _config(**objective)
    built = run_lib.validated_objective(config)
    trainer = built.trainer(built.model())
    return trainer, built


def _samples(built, replies: list[str], rows: list[int], split: int):
    """Samples of byte replies (each ended by <eos>, padded) to the problems `rows` of split `split`."""
    tokenizer = ppo.base.fixed_tokenizer(built.config)
    o = built.fields
    responses = np.full((len(replies), o.response_len), tokenizer.pad_id, np.int32)
    mask = np.zeros(responses.shape, np.float32)
    for i, reply in enumerate(replies):
        ids = [*tokenizer.encode(reply), tokenizer.eos_id][: o.response_len]
        responses[i, : len(ids)], mask[i, : len(ids)] = ids, 1.0
    prompts = np.full((len(replies), o.prompt_len), tokenizer.pad_id, np.int32)
    prompts[:, -1] = tokenizer.encode("=")[0]
    return {
        "prompts": jnp.asarray(prompts),
        "prompt_mask": jnp.asarray((prompts != tokenizer.pad_id).astype(np.int32)),
        "responses": jnp.asarray(responses),
        "mask": jnp.asarray(mask),
        "problem_split": jnp.full((len(replies),), split, jnp.int32),
        "problem_ids": jnp.asarray(rows, jnp.int32),
    }


def test_reward_functions_score_the_decoded_replies_inside_the_jitted_scoring(tmp_path, monkeypatch):
    module = tmp_path / "my_rewards.py"
    module.write_text(
        textwrap.dedent(
            """
            def digits(completion, **row):
                return float(sum(c.isdigit() for c in completion))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer, built = _trainer_and_objective(rewards="gsm8k,my_rewards:digits", reward_weights="1.0,0.5")
    rows = built._prompts(built.read()["train"], "train split")  # registers the split's problems
    split = int(rows["problem_split"][0])
    table = built._tables.tables[split]
    answers = [table[i].fields["answer"] for i in range(4)]
    replies = [answers[0], str(int(answers[1]) + 1), "x", f"{answers[3]}"]
    samples = _samples(built, replies, [0, 1, 2, 3], split)
    params = trainer.init(jax.random.key(0))
    scores, _, metrics = jax.jit(lambda frozen, s: trainer._scores(frozen, None, None, s, jnp.ones(4, bool)))(
        params.frozen, samples
    )
    correct = np.asarray([1.0, 0.0, 0.0, 1.0])
    digit_counts = np.asarray([sum(c.isdigit() for c in r[: built.fields.response_len - 1]) for r in replies])
    np.testing.assert_allclose(np.asarray(scores), correct + 0.5 * digit_counts)
    assert float(metrics["rewards/gsm8k"][0]) == 2.0 and float(metrics["rewards/gsm8k_failures"][0]) == 0.0
    built.close()  # its reward workers


def test_the_successors_flags_reach_the_loss():
    trainer, built = _trainer_and_objective(
        scale_rewards=False, loss_aggregation="constant", ratio_level="sequence", kl_loss="k1", clip_eps_high=0.3
    )
    rng = np.random.default_rng(0)
    o = built.fields
    b, t, vocab = 4, o.response_len, built.config.model.vocab_size
    logits = jnp.asarray(rng.normal(size=(b, t, vocab)), jnp.float32)  # the response window's (`_response_window`)
    responses = jnp.asarray(rng.integers(0, 256, size=(b, t)), jnp.int32)
    logprobs, _ = trainer._logprobs(logits, responses)
    minibatch = {
        "responses": responses,
        "old_logprobs": logprobs - 0.05,
        "ref_logprobs": logprobs + 0.02,
        "mask": jnp.asarray(np.tril(np.ones((b, t)))[:, ::-1].copy(), jnp.float32),
        "sequence_advantages": jnp.asarray([1.0, -1.0, 0.5, 0.0], jnp.float32),
    }
    got, _ = trainer._algorithm_loss(logits, None, minibatch)
    expected, _ = policy_gradient.grpo_loss(
        logprobs,
        minibatch["ref_logprobs"],
        minibatch,
        clip_eps=o.clip_eps,
        kl_coef=o.kl_coef,
        clip_eps_high=0.3,
        aggregation="constant",
        ratio_level="sequence",
        kl_estimator="k1",
    )
    default, _ = policy_gradient.grpo_loss(logprobs, minibatch["ref_logprobs"], minibatch, kl_coef=o.kl_coef)
    np.testing.assert_allclose(float(got), float(expected), rtol=1e-6)
    assert abs(float(expected) - float(default)) > 1e-4
    returns = jnp.asarray([[1.0, 0.0, 0.0, 1.0]])
    np.testing.assert_allclose(
        policy_gradient.group_advantages(returns, scale_by_std=trainer.settings.scale_rewards), [[0.5, -0.5, -0.5, 0.5]]
    )


@pytest.mark.parametrize(
    ("objective", "message"),
    [
        ({"rewards": "no_such_module:fn"}, "no_such_module"),
        ({"rewards": "nonsense"}, "nonsense"),
        ({"rewards": ""}, "score replies with a reward model"),
        ({"samples_per_prompt": 1}, "needs >= 2 samples per prompt"),
        ({"loss_aggregation": "mean"}, "loss_aggregation='mean'"),
        ({"kl_loss": "k9"}, "kl_loss='k9'"),
        ({"clip_eps_high": 0.1}, "clip_eps_high=0.1"),
    ],
)
def test_bad_settings_are_refused_before_any_work(objective, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        loop.train_and_evaluate(_config(**objective), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_rewards_need_problem_rows(tmp_path):
    config = _config()
    config.data.path = str(REPO.parent / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz")
    if not pathlib.Path(config.data.path).exists():
        pytest.skip("needs ../shared/data/hh_rlhf")
    with pytest.raises(ValueError, match="must hold problems"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
