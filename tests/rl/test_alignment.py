"""The alignment stages through the one training loop on a slice of the real HH-RLHF file:
SFT -> reward model (initialised from the SFT checkpoint) -> PPO against both (frozen, read by path)."""

import functools
import gzip
import itertools
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from lmzoo import config as config_lib
from lmzoo import metrics as metrics_lib
from lmzoo import sharding
from lmzoo.data import comparisons
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL_FILE = str(
    pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz"
)


def stage_config(name: str, data_path: str, variant: str = "tiny", **train):
    """configs/<name>.py:<variant> on `data_path`, with config.train fields replaced."""
    config = config_lib.load_config_file(ROOT / "configs" / f"{name}.py", variant)
    config.data.path = data_path
    config.train.update(train)
    return config


def _rows(workdir) -> list[dict]:
    return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """A 120-pair slice of the real file, a 2-step SFT run and a 2-step reward model from it."""
    root = tmp_path_factory.mktemp("alignment")
    data = root / "hh.jsonl"
    with gzip.open(REAL_FILE, "rt", encoding="utf-8") as f:
        data.write_text("".join(itertools.islice(f, 120)))
    sft, rm = root / "sft", root / "rm"
    loop.train_and_evaluate(stage_config("hh_sft", str(data), steps=2), str(sft))
    rm_config = stage_config("hh_rm", str(data), steps=2)
    rm_config.init_from = f"ckpt:{sft}"
    final = loop.train_and_evaluate(rm_config, str(rm))
    return {"data": str(data), "sft": str(sft), "rm": str(rm), "rm_final": final}


def test_sft_trains_on_replies_of_training_prompts_only(stages):
    run = run_lib.open_run(stages["sft"])
    heldout = {c.prompt for c in run.raw("validation")}
    assert heldout and not heldout & {c.prompt for c in run.raw("train")}
    batch = run.train_loader().batch(0)
    assert set(batch) >= {"inputs", "targets", "weights", "segment_ids", "positions"}
    assert 0 < batch["weights"].sum() < np.count_nonzero(batch["segment_ids"])  # prompts carry no loss
    run.close()
    validation = [r for r in _rows(stages["sft"]) if r["split"] == "validation"]
    assert validation and np.isfinite(validation[-1]["loss"])


def test_reward_model_starts_from_sft_and_reports_accuracy_next_to_length_baselines(stages):
    sft_params = run_lib.load(stages["sft"]).params
    run = run_lib.open_run(stages["rm"])
    _, state = run_lib.restore_step(run, 2)
    run.close()
    assert set(state.params) == {"backbone", "classifier"}
    assert state.params["backbone"]["wpe"]["embedding"].shape == sft_params["wpe"]["embedding"].shape
    final = stages["rm_final"]
    for key in ("pairwise_accuracy", "length_longer_accuracy", "length_shorter_accuracy"):
        assert 0.0 <= final[key] <= 1.0
    # Every pair is counted by exactly one length direction, up to ties (½ each).
    assert final["length_longer_accuracy"] + final["length_shorter_accuracy"] == pytest.approx(1.0)
    assert final["pairs"] == len(comparisons.read_splits(stages["data"], 0.1, 0)["validation"])
    assert final["pairwise_accuracy"] == pytest.approx(final["accuracy"])


# (configs/hh_ppo.py variant, config.objective overrides) of the PPO runs that resume and shard: today's default,
# and a separate value network initialised from the reward model with the PPO-ptx term on packed demonstrations.
PPO_VARIANTS = {
    "value_head": ("tiny", {}),
    "value_model_ptx": ("tiny,value_model", {"ptx_coef": 0.5, "ptx_batch_size": 4}),
}


def ppo_config(data: str, sft: str, rm: str, objective: dict | None = None, variant: str = "tiny", **train):
    """configs/hh_ppo.py:<variant> against the given SFT and reward-model workdirs, with an adaptive β that moves,
    and `objective` overrides."""
    config = stage_config("hh_ppo", data, variant, **train)
    config.objective.update(sft=f"ckpt:{sft}", reward_model=f"ckpt:{rm}", kl_target=0.5, kl_horizon=10.0)
    config.objective.update(objective or {})
    return config


def state_arrays(state) -> dict[str, np.ndarray]:
    """Everything a PPO state carries besides the frozen models, flattened by path."""
    leaves = jax.tree_util.tree_flatten_with_path(
        (state.params, state.opt_state, state.kl_coef, state.rng, state.step, state.reward_normalization)
    )[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def test_ppo_iteration_starts_at_the_reference_and_updates_only_the_policy(stages):
    config = ppo_config(stages["data"], stages["sft"], stages["rm"])
    config.objective.update(epochs=1, minibatches=1)
    run = run_lib.build(config, stages["sft"] + "_ppo_first")
    state, _ = run_lib.restore_or_init(run)
    before = jax.device_get(state)
    batch = sharding.put_batch(run.train_loader().batch(0), run.compiled.batch_sharding)
    with run.context():
        after, metrics = run.compiled.step(state, batch)
        again = jax.device_put(before, run.compiled.state_shardings)
        phased, phased_metrics = loop.run_timed_phases(run.compiled.phases, again, batch)
    summary = metrics_lib.summarize(metrics)
    run.close()
    # The loop runs the step as its jitted phases, timing each: the same iteration as the one-program step.
    assert list(run.compiled.phases) == ["rollout", "scoring", "update"]
    assert all(phased_metrics[f"time/{name}_ms"][0] > 0 for name in run.compiled.phases)
    jax.tree.map(
        functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6),
        jax.device_get(phased.params),
        jax.device_get(after.params),
    )
    untimed = {k: v for k, v in phased_metrics.items() if not k.startswith("time/")}
    assert metrics_lib.summarize(untimed) == pytest.approx(summary, rel=1e-4, abs=1e-6)
    # The policy starts as the SFT reference: zero KL, and the single update starts from ratio 1.
    assert summary["objective/kl"] == 0.0
    assert summary["policy/ratio"] == pytest.approx(1.0, abs=1e-5) and summary["policy/clipfrac"] == 0.0
    assert summary["policy/approxkl"] < 1e-9
    assert summary["tokens/response_len"] <= config.objective.response_len
    after = jax.device_get(after)
    jax.tree.map(np.testing.assert_array_equal, after.frozen, before.frozen)
    np.testing.assert_array_equal(before.params["value_head"]["kernel"], 0.0)
    assert np.any(after.params["value_head"]["kernel"] != 0.0)
    assert not np.array_equal(after.params["decoder"]["wte"]["embedding"], before.params["decoder"]["wte"]["embedding"])
    np.testing.assert_array_equal(
        before.params["decoder"]["wte"]["embedding"], before.frozen["reference"]["wte"]["embedding"]
    )
    assert 0.0 < float(after.kl_coef) != float(before.kl_coef)  # adaptive: KL 0 is below target, β shrinks


@pytest.fixture(scope="module", params=sorted(PPO_VARIANTS))
def straight_ppo(stages, request):
    """3 PPO iterations in one go of each PPO_VARIANTS entry (the reference of the resume and device tests)."""
    variant, objective = PPO_VARIANTS[request.param]
    workdir = stages["sft"] + "_ppo_straight_" + request.param
    loop.train_and_evaluate(
        ppo_config(stages["data"], stages["sft"], stages["rm"], objective, variant, steps=3), workdir
    )
    run = run_lib.open_run(workdir)
    _, state = run_lib.restore_step(run, frozen=False)
    run.close()
    return {"workdir": workdir, "arrays": state_arrays(state), "objective": objective, "variant": variant}


def test_resumed_ppo_continues_exactly(stages, straight_ppo, capsys):
    objective, variant = straight_ppo["objective"], straight_ppo["variant"]
    workdir = straight_ppo["workdir"].replace("_straight_", "_resumed_")
    loop.train_and_evaluate(
        ppo_config(stages["data"], stages["sft"], stages["rm"], objective, variant, steps=2), workdir
    )
    assert "reward_normalization/samples 8" in capsys.readouterr().out
    loop.train_and_evaluate(
        ppo_config(stages["data"], stages["sft"], stages["rm"], objective, variant, steps=3), workdir
    )
    assert "prepared before" not in capsys.readouterr().out  # the normalisation comes back with the checkpoint
    run = run_lib.open_run(workdir)
    _, state = run_lib.restore_step(run, frozen=False)
    run.close()
    resumed = state_arrays(state)
    assert resumed.keys() == straight_ppo["arrays"].keys()
    gain = [value for key, value in resumed.items() if "reward_gain" in key]
    assert len(gain) == 1 and np.isfinite(gain[0]) and gain[0] != 1.0  # fitted, not the init's 1
    if "value_model" in variant:
        assert any("value_model" in key for key in resumed)  # the value network is checkpointed with the policy
    for key, value in straight_ppo["arrays"].items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)
    straight_rows = [r for r in _rows(straight_ppo["workdir"]) if r["split"] == "train" and r["step"] == 3]
    resumed_rows = [r for r in _rows(workdir) if r["split"] == "train" and r["step"] == 3]
    keys = ("objective/scores", "objective/kl", "objective/kl_coef", "loss/total")
    if objective.get("ptx_coef", 0) > 0:
        keys += ("ptx/loss",)  # the same demonstrations after the restart
        assert resumed_rows[0]["ptx/loss"] > 0
    for key in keys:
        assert resumed_rows[0][key] == straight_rows[0][key], key


def test_grpo_keeps_the_kl_out_of_the_reward_and_resumes_exactly(stages):
    objective = dict(algorithm="grpo", samples_per_prompt=2, epochs=2, minibatches=2, kl_coef=0.04, kl_target=0.0)
    straight, resumed = (stages["sft"] + f"_grpo_{name}" for name in ("straight", "resumed"))
    loop.train_and_evaluate(ppo_config(stages["data"], stages["sft"], stages["rm"], objective, steps=3), straight)
    for steps in (2, 3):
        loop.train_and_evaluate(
            ppo_config(stages["data"], stages["sft"], stages["rm"], objective, steps=steps), resumed
        )
    arrays = {}
    for workdir in (straight, resumed):
        run = run_lib.open_run(workdir)
        arrays[workdir] = state_arrays(run_lib.restore_step(run, frozen=False)[1])
        run.close()
    for key, value in arrays[straight].items():
        np.testing.assert_array_equal(arrays[resumed][key], value, err_msg=key)
    # The value head gets no loss: it stays at its zero initialisation.
    head = [v for k, v in arrays[straight].items() if k.startswith("[0]['value_head']")]
    assert head and all(np.all(v == 0.0) for v in head)
    rows = [[r for r in _rows(w) if r["split"] == "train"] for w in (straight, resumed)]
    for key in ("objective/scores", "objective/kl", "loss/total", "loss/kl", "policy/ratio"):
        assert rows[0][-1][key] == rows[1][-1][key], key
    for row in rows[0]:
        assert row["objective/non_score_reward"] == 0.0 and row["objective/rlhf_reward"] == pytest.approx(
            row["objective/scores"]
        )
        assert row["loss/kl"] >= 0.0
    assert rows[0][-1]["loss/kl"] > 0.0  # the policy has left the reference


def test_grpo_refuses_a_group_of_one_and_an_adaptive_kl():
    from lmzoo.objectives import ppo

    with pytest.raises(ValueError, match="samples_per_prompt=1: grpo needs >= 2 samples per prompt"):
        ppo.PPOConfig(algorithm="grpo", samples_per_prompt=1)
    with pytest.raises(ValueError, match="kl_target=6.0: grpo keeps β = kl_coef fixed"):
        ppo.PPOConfig(algorithm="grpo", samples_per_prompt=4, kl_target=6.0)
    assert ppo.PPOConfig(algorithm="grpo", samples_per_prompt=4, epochs=2).epochs == 2  # clipped: may reuse a rollout


def test_eight_devices_give_the_numbers_of_one(stages, straight_ppo, tmp_path):
    job = {
        "workdir": str(tmp_path / "ppo8"),
        "data": stages["data"],
        "sft": stages["sft"],
        "rm": stages["rm"],
        "objective": straight_ppo["objective"],
        "variant": straight_ppo["variant"],
        "mesh": [2, 2, 2],
        "steps": 3,
        "npz": str(tmp_path / "state.npz"),
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "rl" / "ppo_devices.py"), "8", json.dumps(job)],
        check=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    eight = dict(np.load(job["npz"]))
    assert eight.keys() == straight_ppo["arrays"].keys()
    for key, value in straight_ppo["arrays"].items():
        np.testing.assert_allclose(eight[key], value, rtol=2e-4, atol=2e-5, err_msg=key)


def test_rloo_trains_and_evaluates_on_the_same_rollout_code(stages, tmp_path):
    config = ppo_config(stages["data"], stages["sft"], stages["rm"], steps=1, eval_every=1, checkpoint_every=1)
    config.objective.update(algorithm="rloo", samples_per_prompt=2, epochs=1)
    final = loop.train_and_evaluate(config, str(tmp_path / "rloo"))
    train = [r for r in _rows(tmp_path / "rloo") if r["split"] == "train"][0]
    assert train["tokens/response_len"] > 0 and np.isfinite(train["loss/policy"]) and train["objective/kl"] == 0.0
    assert all(train[f"time/{name}_ms"] > 0 for name in ("rollout", "scoring", "update"))  # logged per iteration
    assert final["loss"] == pytest.approx(
        -(final["score"] - config.objective.kl_coef * final["kl"]), rel=1e-4, abs=1e-5
    )


def test_the_ppo_policy_samples_like_its_decoder(straight_ppo):
    """eval.py --generate on a PPO run samples the trained policy: the decoder under the value head (or network)."""
    from lmzoo import decoding
    from lmzoo.evaluation.generation import sample_text

    run = run_lib.open_run(straight_ppo["workdir"])
    _, state = run_lib.restore_step(run, frozen=False)
    run.close()
    params = run.compiled.host_params(state)
    text = sample_text(run, params, "Human:", max_new_tokens=12, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    ids = run.tokenizer.encode("Human:")
    new = decoding.generate(
        run.model.decoder,
        params["decoder"],
        np.array([ids]),
        rng=jax.random.key(0),
        max_new_tokens=12,
        temperature=0.0,
        eos_id=run.tokenizer.eos_id,
        pad_id=run.tokenizer.pad_id or 0,
        vocab_size=run.tokenizer.vocab_size,
    )
    out = [int(t) for t in np.asarray(new[0])]
    assert text == run.tokenizer.decode(out[: out.index(run.tokenizer.eos_id)] if run.tokenizer.eos_id in out else out)


def test_every_alignment_stage_trains_the_llama_family(stages, tmp_path):
    """SFT -> reward model -> PPO (value head), GRPO and DPO with the Llama block (GQA, RoPE, a mixture of 3 experts)
    in place of GPT-2's, through the same objectives: none of them branches on the family, and each adds the expert
    layers' auxiliary losses to what it trains (their metrics in every training row)."""
    model = config_lib.model_section(
        "llama",
        vocab_size=258,
        max_len=64,
        emb_dim=32,
        num_heads=2,
        num_kv_heads=1,
        num_layers=1,
        mlp_dim=64,
        num_experts=3,
        experts_per_token=2,
    )

    def llama(config):
        config.model_name, config.model = "llama", model
        return config

    sft, rm = tmp_path / "sft", tmp_path / "rm"
    loop.train_and_evaluate(llama(stage_config("hh_sft", stages["data"], steps=2)), str(sft))
    rm_config = llama(stage_config("hh_rm", stages["data"], steps=2))
    rm_config.init_from = f"ckpt:{sft}"
    assert 0.0 <= loop.train_and_evaluate(rm_config, str(rm))["accuracy"] <= 1.0
    ppo = llama(ppo_config(stages["data"], str(sft), str(rm)))
    ppo.train.steps = 1
    assert np.isfinite(loop.train_and_evaluate(ppo, str(tmp_path / "ppo"))["score"])
    grpo = llama(ppo_config(stages["data"], str(sft), str(rm), {"algorithm": "grpo", "kl_target": 0.0}, "tiny,grpo"))
    grpo.train.steps = 1
    assert np.isfinite(loop.train_and_evaluate(grpo, str(tmp_path / "grpo"))["score"])
    dpo = llama(stage_config("hh_dpo", stages["data"], steps=1))
    dpo.objective.sft = f"ckpt:{sft}"
    assert np.isfinite(loop.train_and_evaluate(dpo, str(tmp_path / "dpo"))["loss"])
    for run in ("sft", "rm", "ppo", "grpo", "dpo"):
        trained = [row for row in _rows(tmp_path / run) if row["split"] == "train"]
        assert trained and all(row["moe/aux_loss"] > 0 and "expert_load/0_2" in row for row in trained), run
