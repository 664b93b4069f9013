import gc
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from lmzoo import checkpoint, sharding, testing
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tiny_config(**train):
    return testing.tiny_config(**train)


def _params(workdir):
    run = run_lib.build(run_lib.load_saved(workdir), workdir)
    step, state, data_state = run.checkpointer.restore_latest(run.abstract_state)
    run.close()
    return step, jax.device_get(state), data_state


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step tiny run (checkpoints 2 and 4) and its final evaluation, trained once for the tests that read
    it; a test that writes into the run trains on a copy (`_copy`)."""
    run_dir = tmp_path_factory.mktemp("trained")
    return run_dir, loop.train_and_evaluate(_tiny_config(), str(run_dir))


def _copy(trained, tmp_path) -> pathlib.Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained[0], run_dir)
    return run_dir


def test_train_writes_checkpoints_logs_sample_and_eval(trained):
    run_dir, final = trained
    assert np.isfinite(final["loss"]) and final["loss"] < np.log(258)
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "perplexity", "learning_rate", "grad_norm", "tokens_per_sec"} <= set(rows[0])
    assert any(p.name.startswith("events") for p in (run_dir / "tb").iterdir())
    assert (run_dir / "sample.txt").read_text().startswith("def ")
    assert not (run_dir / "lock").exists()  # a finished run removes its lock file
    result = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), f"--workdir={run_dir}", "--max_batches=2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    line = json.loads(result.stdout.splitlines()[0])
    assert line["step"] == 4 and abs(line["loss"] - final["loss"]) < 1e-4
    assert {"perplexity", "bits_per_token", "bits_per_char"} <= set(line)

    def eval_step(step):
        args = [sys.executable, str(ROOT / "eval.py"), f"--workdir={run_dir}", f"--step={step}", "--max_batches=2"]
        return subprocess.run(args, capture_output=True, text=True, cwd=ROOT)

    earlier = eval_step(2)
    assert earlier.returncode == 0, earlier.stderr
    earlier_line = json.loads(earlier.stdout.splitlines()[0])
    assert earlier_line["step"] == 2 and earlier_line["loss"] != line["loss"]
    assert (run_dir / "eval_validation_step2_max2batches.json").exists()
    missing = eval_step(3)
    assert missing.returncode != 0 and "no checkpoint for step 3" in missing.stderr and "[2, 4]" in missing.stderr


def test_resume_is_exact(trained, tmp_path):
    """2 steps, stop, restart to 4 == 4 steps uninterrupted (params, optimizer state, rng, loader)."""
    loop.train_and_evaluate(_tiny_config(steps=2), str(tmp_path / "resumed"))
    loop.train_and_evaluate(_tiny_config(), str(tmp_path / "resumed"))
    step_a, state_a, data_a = _params(str(trained[0]))
    step_b, state_b, data_b = _params(str(tmp_path / "resumed"))
    assert step_a == step_b == 4 and data_a == data_b == {"step": 4}
    jax.tree.map(np.testing.assert_array_equal, state_a, state_b)


def test_rerun_without_the_extension_continues_as_last_configured(tmp_path, capsys):
    """Extended to 6 steps by a flag, the run rerun without it (the config's 4 steps) finishes as last configured
    instead of refusing the config file's own train.steps."""
    loop.train_and_evaluate(_tiny_config(steps=6), str(tmp_path))
    loop.train_and_evaluate(_tiny_config(), str(tmp_path))
    assert "continuing the run as last configured, to train.steps=6" in capsys.readouterr().out
    assert _params(str(tmp_path))[0] == 6


def test_grad_accumulation_matches_full_batch(tmp_path):
    a = loop.train_and_evaluate(_tiny_config(grad_accum_steps=1), str(tmp_path / "a"))
    b = loop.train_and_evaluate(_tiny_config(grad_accum_steps=2), str(tmp_path / "b"))
    _, state_a, _ = _params(str(tmp_path / "a"))
    _, state_b, _ = _params(str(tmp_path / "b"))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=2e-5), state_a.params, state_b.params)
    assert abs(a["loss"] - b["loss"]) < 1e-4


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    config = _tiny_config(steps=6)
    config.optim.learning_rate = 1e30
    config.optim.grad_clip = 0.0
    config.optim.warmup_steps = 0
    with pytest.raises(loop.NonFiniteLossError, match="last good checkpoint"):
        loop.train_and_evaluate(config, str(tmp_path))
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert all(s < 6 for s in steps)
    if steps:
        _, state, _ = _params(str(tmp_path))
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))


def test_incompatible_checkpoint_names_parameters(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    config = _tiny_config(steps=6)
    config.model.mlp_dim = 48
    with pytest.raises(
        checkpoint.IncompatibleCheckpointError, match=r"mlp/wi/kernel: checkpoint \(32, 64\) vs model \(32, 48\)"
    ):
        loop.train_and_evaluate(config, str(run_dir))


def test_corrupt_latest_checkpoint_falls_back(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    for f in (run_dir / "checkpoints" / "4" / "state" / "d").iterdir():
        f.write_bytes(b"broken")
    step, _, data_state = _params(str(run_dir))
    assert step == 2 and data_state == {"step": 2}


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.model.emb_dimm=3", "valid keys of config.model"),
        ("--config.data.seq_len=64", "longer than the model's positions"),
        ("--config.model.vocab_size=100", "smaller than the tokenizer's vocabulary"),
        ("--config.data.source=local", "config.data.path is empty"),
        ("--config.data.source=local --config.data.path=/nonexistent", "does not exist"),
    ],
)
def test_bad_config_errors(tmp_path, override, message):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--config=configs/default.py:tiny",
            f"--workdir={tmp_path}",
            *override.split(),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode != 0
    assert message in result.stderr


def test_weight_decay_mask_spares_biases_norms_and_embeddings():
    from lmzoo.trainers import optim

    params = {"wte": {"embedding": 1}, "mlp": {"wi": {"kernel": 1, "bias": 1}}, "ln": {"scale": 1}, "mlm_bias": 1}
    mask = optim.weight_decay_mask(params, decay_embeddings=False)
    assert mask == {
        "wte": {"embedding": False},
        "mlp": {"wi": {"kernel": True, "bias": False}},
        "ln": {"scale": False},
        "mlm_bias": False,
    }
    assert optim.weight_decay_mask(params, decay_embeddings=True)["wte"]["embedding"] is True


def test_perplexity_and_bits_only_for_token_nll_losses():
    from lmzoo import metrics as metrics_lib
    from lmzoo import objectives

    total = {"loss": (np.float32(6.0), np.float32(3.0))}
    assert metrics_lib.summarize(total)["perplexity"] == pytest.approx(np.exp(2.0))
    assert set(metrics_lib.summarize(total, token_nll=False)) == {"loss"}
    not_nll = {
        "classify",
        "reward_model",
        "ppo",
        "grpo",
        "rloo",
        "dpo",
        "distill",
        "mlm_nsp",
        "mlm_sop",
        "elmo_classify",
    }
    for name in ("causal_lm", "sft", "mlm", "recurrent_lm", "bilm", "text_to_text", *not_nll):
        assert objectives.get(name).loss_is_token_nll == (name not in not_nll), name


def test_progress_bar_shows_the_loss_or_ppos_reward_kl_and_beta():
    import jax.numpy as jnp

    from lmzoo import metrics as metrics_lib
    from lmzoo.rl import policy_gradient

    supervised = {"loss": 2.5, "learning_rate": 1e-3, "grad_norm": 0.7, "tokens_per_sec": 1e4}
    assert loop.progress_postfix(supervised) == {"loss": "2.5", "learning_rate": "0.001"}
    mask = jnp.ones((2, 3))
    logprobs = jnp.log(jnp.full((2, 3), 0.5))
    _, metrics = policy_gradient.ppo_rollout_targets(
        jnp.array([1.0, 2.0]), jnp.array([True, True]), logprobs, logprobs - 0.1, jnp.zeros((2, 3)), mask, kl_coef=0.05
    )
    summary = metrics_lib.summarize(metrics, token_nll=False)  # a PPO step's rollout metrics, as the loop logs them
    assert loop.progress_postfix(summary) == {"reward": "1.5", "kl": "0.3", "beta": "0.05"}


def test_several_steps_per_call_equal_single_steps_and_resume_mid_run(tmp_path):
    """steps_per_call=3 runs calls of 3, 2 and 2 steps (a save at step 5 ends a call) and reaches the state of 7
    single steps; stopped at 5 and resumed, it reaches the same again."""
    every = dict(steps=7, log_every=7, eval_every=7, checkpoint_every=5)
    loop.train_and_evaluate(_tiny_config(**every), str(tmp_path / "single"))
    loop.train_and_evaluate(_tiny_config(**every, steps_per_call=3), str(tmp_path / "scan"))
    loop.train_and_evaluate(_tiny_config(**{**every, "steps": 5}, steps_per_call=3), str(tmp_path / "resumed"))
    loop.train_and_evaluate(_tiny_config(**every, steps_per_call=3), str(tmp_path / "resumed"))
    step, single, _ = _params(str(tmp_path / "single"))
    for name in ("scan", "resumed"):
        other_step, other, data = _params(str(tmp_path / name))
        assert other_step == step == 7 and data == {"step": 7}
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), single, other)
    rows = {
        n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
        for n in ("single", "scan")
    }
    train = {n: [r for r in rows[n] if r["split"] == "train"] for n in rows}
    assert [r["step"] for r in train["scan"]] == [r["step"] for r in train["single"]] == [5, 7]
    for a, b in zip(train["single"], train["scan"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert loop.call_size(0, _tiny_config(**every).train, 3) == 3
    assert [loop.call_size(s, _tiny_config(**every).train, 3) for s in (3, 5, 6)] == [2, 2, 1]


def test_sigterm_in_a_garbage_collector_callback_still_stops_the_start(capfd):
    """A signal handler that runs inside a gc callback has its exception dropped by Python: the start stops anyway,
    at the latest when it ends, and the dropped exception is not printed."""

    def sigterm_during_collection(phase, info):
        if phase == "start":
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(loop.TrainingStopped, match="stopped by SIGTERM while starting") as stopped:
        with loop._sigterm_stops_start():
            gc.callbacks.append(sigterm_during_collection)
            try:
                gc.collect()
            finally:
                gc.callbacks.remove(sigterm_during_collection)
    assert stopped.value.exit_code == 143
    assert "Exception ignored" not in capfd.readouterr().err


def test_the_first_call_compiles_while_the_state_is_made_and_no_call_compiles_again(tmp_path, monkeypatch):
    compiled = []
    original = loop.StepPrograms.compile

    def recording(self, fn, state, batch):
        kinds = {type(leaf).__name__ for leaf in jax.tree.leaves(state)}
        compiled.append((threading.current_thread().name, kinds))
        return original(self, fn, state, batch)

    monkeypatch.setattr(loop.StepPrograms, "compile", recording)
    loop.train_and_evaluate(_tiny_config(), str(tmp_path / "run"))
    # One program for the 4 steps (one shape), compiled on its thread from the state's shapes, not its arrays.
    assert compiled == [("lmzoo-start", {"ShapeDtypeStruct"})]
    loop.train_and_evaluate(_tiny_config(steps=6), str(tmp_path / "run"))  # a resume: the same, while it restores
    assert compiled[1:] == [("lmzoo-start", {"ShapeDtypeStruct"})]


def test_a_program_compiled_ahead_is_compiled_again_for_arrays_it_does_not_fit(tmp_path):
    run = run_lib.build(_tiny_config(), str(tmp_path))
    try:
        state, _ = run_lib.restore_or_init(run)
        batch = sharding.put_batch(run.train_loader().batch(0), run.compiled.batch_sharding)
        programs = loop.StepPrograms(run)
        weak = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding), run.abstract_state)
        weak = weak.replace(
            step=jax.ShapeDtypeStruct((), jax.numpy.int32, sharding=state.step.sharding, weak_type=True)
        )
        ahead = programs.compile(run.compiled.step, weak, batch)
        with run.context():
            program = programs.program(run.compiled.step, state, batch)
            assert program is not ahead  # the state's step is not weakly typed: compiled again
            state, metrics = program(state, batch)
            assert np.isfinite(float(jax.device_get(metrics["loss"][0])))
            again = programs.program(run.compiled.step, state, batch)
        assert again is program
    finally:
        run.close()


def test_the_configs_sharding_rules_replace_the_tables_entries_also_as_a_saved_config_gives_them(tmp_path):
    """config.sharding.rules as the command line gives them (tuples) and as a saved config.json gives them back
    (lists) replace those entries of `sharding.LOGICAL_AXIS_RULES` in the run's rules; an unknown logical axis is
    refused, named."""
    config = _tiny_config()
    default = dict(sharding.LOGICAL_AXIS_RULES)
    for given in ((("vocab", None), ("mlp", None)), [["vocab", None], ["mlp", None]]):
        config.sharding.rules = given
        run = run_lib.build(config, str(tmp_path / "run"))
        run.close()
        rules = dict(run.compiled.rules)
        assert rules == {**default, "vocab": None, "mlp": None} and default["vocab"] == "tensor"
    config.sharding.rules = (("vocabulary", None),)
    with pytest.raises(ValueError, match="unknown logical axis 'vocabulary'"):
        run_lib.build(config, str(tmp_path / "run"))
