"""GRPO with one update per rollout skips the policy's forward in scoring (the update's own log-probs, held constant,
are the old ones): the same update and the same metrics as when scoring reads them."""

import functools
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo.config import load_config_file
from lmzoo.data.loaders import Shard
from lmzoo.objectives import base
from lmzoo.train import run as run_lib

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kl_loss", ["off", "k3"])
def test_one_update_reads_its_own_old_logprobs(tmp_path, monkeypatch, request, kl_loss):
    # A reward random replies differ in (the answer reward is 0 for all of them: no update would move the params).
    (tmp_path / "parity_reward.py").write_text(
        "def odd_first(completion):\n    return float(ord(completion[:1] or 'a') % 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config_file(REPO / "configs" / "gsm8k.py", "tiny")
    config.objective.rewards = "parity_reward:odd_first"
    config.objective.kl_loss = kl_loss
    built = run_lib.validated_objective(config)
    trainer = built.trainer(built.model())
    request.addfinalizer(built.close)  # its reward workers
    assert trainer.update_reads_old_logprobs
    loader = built.train_loader(base.fixed_tokenizer(built.config), built.read()["train"], Shard(0, 1))
    batch = {k: jnp.asarray(v) for k, v in loader.batch(0).items()}
    state = trainer.init(jax.random.key(0))
    samples = jax.jit(lambda st, b: trainer.run_phase("rollout", st, b, None))(state, batch)
    policy = trainer.policy_params(state.params, state.frozen)

    @functools.partial(jax.jit, static_argnums=1)
    def scored_and_updated(samples, policy_forward):
        scored = trainer.score(
            policy, trainer.scoring_models(state), state.kl_coef, samples, policy_forward=policy_forward
        )
        return scored, trainer.run_phase("update", state, batch, scored)

    (read, _), (read_state, read_metrics) = scored_and_updated(samples, True)
    (skipped, _), (skipped_state, skipped_metrics) = scored_and_updated(samples, False)
    assert "old_logprobs" in read and "old_logprobs" not in skipped
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), state.params, read_state.params))
    assert max(moved) > 0, "the update moved nothing: the comparison would be empty"
    chex.assert_trees_all_close(read_state.params, skipped_state.params, rtol=1e-5, atol=1e-7)
    for key in ("objective/scores", "objective/entropy", "objective/kl", "policy/rollout_entropy", "loss/total"):
        np.testing.assert_allclose(
            np.divide(*read_metrics[key]), np.divide(*skipped_metrics[key]), rtol=1e-5, atol=1e-7
        )
