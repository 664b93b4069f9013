"""DAPO's dynamic sampling with refill (objective.sampling_rounds R): a step reads R x B prompts and draws B at a time
until B groups whose rewards differ are kept, in the order drawn; the update learns from them alone."""

import contextlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo.config import load_config_file
from lmzoo.data.loaders import Shard
from lmzoo.objectives import base
from lmzoo.rl import policy_gradient
from lmzoo.train import run as run_lib
from lmzoo.trainers import rl

REPO = pathlib.Path(__file__).resolve().parents[2]
ROUNDS = 3


@contextlib.contextmanager
def _built(tmp_path, monkeypatch, **objective):
    # Replies to prompts of even length score their first character's parity; the others all score 0: their groups
    # teach nothing and are dropped.
    (tmp_path / "half_reward.py").write_text(
        "def even_prompts(prompt, completion):\n"
        "    return float(ord(completion[:1] or 'a') % 2) if len(prompt) % 2 == 0 else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config_file(REPO / "configs" / "gsm8k.py", "tiny")
    config.objective.update(rewards="half_reward:even_prompts", dynamic_sampling=True, **objective)
    built = run_lib.validated_objective(config)
    trainer = built.trainer(built.model())
    loader = built.train_loader(base.fixed_tokenizer(built.config), built.read()["train"], Shard(0, 1))
    try:
        yield built, trainer, {k: jnp.asarray(v) for k, v in loader.batch(0).items()}
    finally:
        built.close()  # its reward workers


def test_refill_keeps_the_first_informative_groups_in_the_order_drawn(tmp_path, monkeypatch):
    with _built(tmp_path, monkeypatch, sampling_rounds=ROUNDS) as (built, trainer, batch):
        groups, size = built.config.train.batch_size, built.config.objective.samples_per_prompt
        assert batch["prompts"].shape[0] == ROUNDS * groups
        state = trainer.init(jax.random.key(0))
        policy = trainer.policy_params(state.params, state.frozen)
        rng = jax.random.key(3)
        kept, metrics = jax.jit(trainer._refilled_rollout)(policy, trainer.scoring_models(state), batch, rng)

        # The same rounds drawn and scored one by one, outside the loop.
        expected, rounds = [], 0
        for r in range(ROUNDS):
            if len(expected) >= groups:
                break
            rows = {k: v[r * groups : (r + 1) * groups] for k, v in batch.items() if not k.startswith("ptx")}
            samples = trainer.generate(policy, rows, jax.random.fold_in(rng, r), samples_per_prompt=size)
            inputs = rl.rollout_inputs(
                samples["prompts"], samples["prompt_mask"], samples["responses"], samples["mask"]
            )
            forward = dict(segment_ids=inputs["segment_ids"], positions=inputs["positions"])
            has_eos = jnp.any((samples["responses"] == trainer.eos_id) & (samples["mask"] > 0), axis=1)
            scores, _, _ = trainer._scores(trainer.scoring_models(state), inputs, forward, samples, has_eos)
            informative = np.asarray(policy_gradient.informative_groups(scores.reshape(groups, size)))
            expected += [
                (r, g, np.asarray(samples["responses"][g * size : (g + 1) * size])) for g in np.flatnonzero(informative)
            ]
            rounds += 1
        assert 0 < len(expected) and rounds > 1, "the reward must leave some groups uninformative in round 0"
        kept_groups = min(groups, len(expected))
        for slot, (r, g, responses) in enumerate(expected[:kept_groups]):
            np.testing.assert_array_equal(kept["prompts"][slot * size], batch["prompts"][r * groups + g])
            np.testing.assert_array_equal(kept["responses"][slot * size : (slot + 1) * size], responses)
        grouped = np.asarray(kept["scores"]).reshape(groups, size)
        assert np.all(grouped[:kept_groups].max(axis=1) > grouped[:kept_groups].min(axis=1))
        assert float(metrics["objective/sampling_rounds"][0]) == rounds


def test_a_step_learns_from_the_refilled_batch(tmp_path, monkeypatch):
    with _built(tmp_path, monkeypatch, sampling_rounds=ROUNDS) as (built, trainer, batch):
        state = trainer.init(jax.random.key(0))
        new_state, metrics = jax.jit(trainer.step)(state, batch)
        informative, groups = (float(x) for x in metrics["objective/informative_groups"])
        assert groups == built.config.train.batch_size and informative > 0
        moved = jax.tree.leaves(
            jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), state.params, new_state.params)
        )
        assert max(moved) > 0
        assert 1 <= float(metrics["objective/sampling_rounds"][0]) <= ROUNDS


@pytest.mark.parametrize(
    "objective, message",
    [
        (dict(sampling_rounds=2, dynamic_sampling=False), "refills GRPO's batch under dynamic_sampling"),
        (dict(sampling_rounds=2, max_staleness=1), "refilling is for synchronous GRPO"),
        (dict(sampling_rounds=0), "sampling_rounds=0: must be >= 1"),
    ],
)
def test_bad_sampling_rounds_are_refused(objective, message):
    config = load_config_file(REPO / "configs" / "gsm8k.py", "tiny")
    config.objective.update(**objective)
    with pytest.raises(ValueError, match=message):
        run_lib.validated_objective(config)
