"""Multi-turn episodes with a tool: the episode assembled turn by turn (policy tokens, then the environment's
answer), the environment's tokens in the context the policy reads but out of its loss, the calculator answering
<calc> calls, the turn limit, and bad settings refused before any work."""

import pathlib
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo.config import load_config_file
from lmzoo.objectives import base
from lmzoo.train import loop
from lmzoo.train import run as run_lib
from lmzoo.trainers import rl

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_an_episode_appends_each_rows_kept_tokens_after_its_own():
    episode = rl.Episode.empty(2, 6, pad_id=9)
    episode = episode.append(jnp.asarray([[1, 2, 3], [4, 5, 6]]), jnp.asarray([[1, 1, 0], [1, 1, 1]]), policy=True)
    episode = episode.append(jnp.asarray([[7, 8], [7, 8]]), jnp.asarray([[1, 1], [1, 1]]), policy=False)
    episode = episode.append(jnp.asarray([[5, 5], [5, 5]]), jnp.asarray([[1, 0], [1, 1]]), policy=True)
    np.testing.assert_array_equal(episode.tokens, [[1, 2, 7, 8, 5, 9], [4, 5, 6, 7, 8, 5]])
    np.testing.assert_array_equal(episode.loss_mask, [[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]])
    np.testing.assert_array_equal(episode.context_mask, [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(episode.filled, [5, 6])  # the second row's last token found no room
    np.testing.assert_array_equal(episode.full, [False, True])


def test_left_aligned_moves_real_tokens_to_the_right_end_in_order():
    tokens, mask = rl.left_aligned(jnp.asarray([[0, 1, 2, 0, 3, 0]]), jnp.asarray([[0, 1, 1, 0, 1, 0]]))
    np.testing.assert_array_equal(tokens, [[0, 0, 0, 1, 2, 3]])
    np.testing.assert_array_equal(mask, [[0, 0, 0, 1, 1, 1]])


@pytest.fixture
def echo_env(tmp_path, monkeypatch):
    (tmp_path / "echo_env.py").write_text(
        textwrap.dedent(
            """
            from lmzoo.rl.environments import Environment, Step


            class Echo(Environment):
                def step(self, text):
                    return Step("<o>", 0.5, False)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "echo_env:Echo"


def _objective(**fields):
    config = load_config_file(REPO / "configs" / "gsm8k.py", "tiny")
    for key, value in fields.items():
        config.objective[key] = value
    return run_lib.validated_objective(config)


def _episodes(built):
    trainer = built.trainer(built.model())
    tokenizer = base.fixed_tokenizer(built.config)
    from lmzoo.data.loaders import Shard

    batch = built.train_loader(tokenizer, built.read()["train"], Shard(0, 1)).batch(0)
    state = trainer.init(jax.random.key(0))
    samples = jax.jit(lambda params, b: trainer.generate(params, b, jax.random.key(3), samples_per_prompt=4))(
        trainer.policy_params(state.params, state.frozen), {k: jnp.asarray(v) for k, v in batch.items()}
    )
    return trainer, state, tokenizer, jax.device_get(samples)


def test_turns_alternate_with_the_environment_which_the_loss_leaves_out(echo_env):
    built = _objective(environment=echo_env, max_turns=3, turn_len=2, response_len=12, observation_len=3)
    trainer, state, tokenizer, samples = _episodes(built)
    policy = np.asarray([1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1], np.float32)
    full = [i for i, row in enumerate(samples["responses"]) if tokenizer.eos_id not in row[policy > 0]]
    assert full, "every row drew <eos> early"
    for i in full:
        np.testing.assert_array_equal(samples["mask"][i], policy)
        np.testing.assert_array_equal(samples["context_mask"][i], np.ones(12))
        assert tokenizer.decode(samples["responses"][i][2:5].tolist()) == "<o>"
        assert tokenizer.decode(samples["responses"][i][7:10].tolist()) == "<o>"
        assert samples["turns"][i] == 3 and samples["environment_rewards"][i] == 1.0

    # Out of the loss: the rollout's old and reference log-probs at the environment's tokens do not matter.
    rollout, metrics = jax.jit(trainer.score)(state.params, trainer.scoring_models(state), state.kl_coef, samples)
    assert float(metrics["episode/turn_limit"][0]) == float(len(samples["turns"]))
    rollout = {**jax.device_get(rollout), "sequence_advantages": np.linspace(-1, 1, len(samples["mask"]))}
    environment = (samples["context_mask"] - samples["mask"]) > 0
    changed = {
        **rollout,
        "old_logprobs": np.where(environment, -7.0, rollout["old_logprobs"]),
        "ref_logprobs": np.where(environment, 3.0, rollout["ref_logprobs"]),
    }
    loss = jax.jit(lambda params, r: trainer.minibatch_loss(params, r, None, state.frozen)[0])
    assert float(loss(state.params, rollout)) == float(loss(state.params, changed))

    # In the context: another observation changes what the policy's later turns are conditioned on.
    other = dict(rollout, sequences=np.asarray(rollout["sequences"]).copy())
    prompt_len = built.fields.prompt_len
    other["sequences"][:, prompt_len + 2] = tokenizer.encode("x")[0]
    logits = jax.jit(
        lambda r: trainer.policy.apply(
            {"params": state.params}, r["sequences"], segment_ids=r["segment_ids"], positions=r["positions"]
        )[0]
    )
    later = slice(prompt_len + 5, prompt_len + 12)
    assert not np.allclose(np.asarray(logits(rollout))[:, later], np.asarray(logits(other))[:, later])
    built.close()  # its reward workers


def test_the_calculator_answers_a_call_and_ends_at_an_answer():
    built = _objective(environment="calculator", max_turns=2, response_len=36, turn_len=20, observation_len=20)
    trainer = built.trainer(built.model())
    tools, tokenizer = trainer.environment, base.fixed_tokenizer(built.config)
    assert tools.stop_sequences == (tuple(tokenizer.encode("</calc>")),)
    built._prompts(built.read()["train"], "train split")
    turns = ["Half of 48 is <calc>48/2</calc>", "#### 24"]
    tokens = np.full((2, 40), tokenizer.pad_id, np.int32)
    mask = np.zeros((2, 40), np.int32)
    for i, text in enumerate(turns):
        ids = tokenizer.encode(text)
        tokens[i, : len(ids)], mask[i, : len(ids)] = ids, 1
    split, ids = np.zeros(2, np.int32), np.arange(2, dtype=np.int32)
    tools(tokens, mask, -1, split, ids)
    observation, observation_mask, done, reward = tools(tokens, mask, 0, split, ids)
    assert tokenizer.decode(observation[0][observation_mask[0] > 0].tolist()) == "<result>24</result>"
    assert not observation_mask[1].any()
    np.testing.assert_array_equal(done, [False, True])
    np.testing.assert_array_equal(reward, [0.0, 0.0])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"environment": "no_such_env"}, "unknown environment 'no_such_env'"),
        ({"max_turns": 2}, "max_turns=2: turns alternate with an environment"),
        ({"environment": "calculator", "turn_len": 99}, "turn_len=99"),
        ({"environment": "calculator", "response_len": 40, "turn_len": 30}, "prompt_len \\+ response_len \\+ turn_len"),
    ],
)
def test_bad_episode_settings_are_refused_before_any_work(fields, message, tmp_path):
    config = load_config_file(REPO / "configs" / "gsm8k.py", "tiny")
    for key, value in fields.items():
        config.objective[key] = value
    with pytest.raises(ValueError, match=message):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
