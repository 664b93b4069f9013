"""Asynchronous GRPO (objective.max_staleness = k): the update of step s learns from the rollout drawn at step s - k,
kept in the checkpointed state with its drawing policy's log-probs and corrected by truncated importance sampling;
k = 0 is the synchronous run exactly, and a resumed asynchronous run continues exactly."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo.config import load_config_file
from lmzoo.data.loaders import Shard
from lmzoo.objectives import base
from lmzoo.train import loop
from lmzoo.train import run as run_lib

REPO = pathlib.Path(__file__).resolve().parents[2]


def _config(steps=3, **objective):
    config = load_config_file(REPO / "configs" / "gsm8k.py", "tiny")
    config.train.steps = config.optim.decay_steps = steps
    config.train.log_every = 1
    for key, value in objective.items():
        config.objective[key] = value
    return config


def _train_rows(workdir):
    return [
        row for row in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if row["split"] == "train"
    ]


def test_no_staleness_is_the_synchronous_run(tmp_path):
    loop.train_and_evaluate(_config(), str(tmp_path / "sync"))
    loop.train_and_evaluate(_config(max_staleness=0), str(tmp_path / "k0"))
    drop = ("time/", "tokens_per_sec", "steps_per_sec")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]  # noqa: E731
    assert strip(_train_rows(tmp_path / "sync")) == strip(_train_rows(tmp_path / "k0"))


def test_each_update_learns_from_the_rollout_drawn_k_steps_before(tmp_path, monkeypatch):
    # A reward random replies differ in (the answer reward is 0 for all of them: no update would move the params).
    (tmp_path / "parity_reward.py").write_text(
        "def odd_first(completion):\n    return float(ord(completion[:1] or 'a') % 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = _config(max_staleness=1, rewards="parity_reward:odd_first")
    built = run_lib.validated_objective(config)
    trainer = built.trainer(built.model())
    tokenizer = base.fixed_tokenizer(built.config)
    loader = built.train_loader(tokenizer, built.read()["train"], Shard(0, 1))
    phase = {name: jax.jit(lambda st, b, c, name=name: trainer.run_phase(name, st, b, c)) for name in trainer.phases}

    def step(state, index):
        batch = {k: jnp.asarray(v) for k, v in loader.batch(index).items()}
        drawn = phase["rollout"](state, batch, None)
        scored = phase["scoring"](state, batch, drawn)
        new_state, metrics = phase["update"](state, batch, scored)
        return drawn, scored, new_state, metrics

    state0 = trainer.init(jax.random.key(0))
    drawn0, _, state1, metrics1 = step(state0, 0)
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state0.params, state1.params)
    assert all(jax.tree.leaves(same)), "the first step only draws: the queue was empty"
    np.testing.assert_array_equal(state1.pending["responses"][0], drawn0["drawn"]["responses"])
    np.testing.assert_array_equal(state1.pending["version"][0], 0)
    assert float(metrics1["async/updates"][0]) == 0.0

    drawn1, scored1, state2, metrics2 = step(state1, 1)
    (rollout, _), _, version = scored1
    np.testing.assert_array_equal(rollout["responses"], drawn0["drawn"]["responses"])  # learnt from step 0's draw
    np.testing.assert_array_equal(rollout["behaviour_logprobs"], drawn0["drawn"]["behaviour_logprobs"])
    np.testing.assert_array_equal(version, 0)
    np.testing.assert_array_equal(state2.pending["responses"][0], drawn1["drawn"]["responses"])
    assert float(metrics2["async/updates"][0]) == 1.0 and float(metrics2["async/staleness"][0]) == 1.0
    assert "policy/tis_weight" in metrics2
    changed = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state1.params, state2.params)
    assert not all(jax.tree.leaves(changed))
    built.close()  # its reward workers


def test_an_asynchronous_run_resumes_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    loop.train_and_evaluate(_config(steps=4, max_staleness=2), str(straight))
    config = _config(steps=4, max_staleness=2)
    config.train.steps = 2
    loop.train_and_evaluate(config, str(resumed))
    loop.train_and_evaluate(_config(steps=4, max_staleness=2), str(resumed))
    a = run_lib.restore_step(run_lib.open_run(str(straight)))[1]
    b = run_lib.restore_step(run_lib.open_run(str(resumed)))[1]
    for x, y in zip(jax.tree.leaves((a.params, a.pending)), jax.tree.leaves((b.params, b.pending)), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    ("objective", "message"),
    [
        ({"max_staleness": -1}, "max_staleness=-1"),
        ({"max_staleness": 1, "environment": "calculator"}, "asynchronous rollouts are for GRPO"),
        ({"max_staleness": 1, "tis_cap": 0.0}, "tis_cap=0.0"),
    ],
)
def test_bad_staleness_settings_are_refused(objective, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        loop.train_and_evaluate(_config(**objective), str(tmp_path / "run"))
