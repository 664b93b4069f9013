"""What a careless user sees (issue 10): one writer per workdir, run state that a failed start never
replaces, config values checked before any work, checkpoint damage told from config changes and I/O
errors, failed saves, SIGTERM and Ctrl-C. Real processes where the case needs them; a disk-full or
failing disk is an LD_PRELOAD shim that fails open(2) of matching paths."""

import errno
import gc
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from lmzoo import checkpoint, testing, workdir
from lmzoo import config as config_lib
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}


def _train_cmd(run_dir, *overrides: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "train.py"),
        "--config=configs/default.py:tiny",
        f"--workdir={run_dir}",
        *overrides,
    ]


def _steps(run_dir) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _snapshot(run_dir) -> dict[str, bytes]:
    """Every file of the run state a start may write (config and tokenizer), by relative path."""
    files = [run_dir / "config.json", *sorted((run_dir / "tokenizer").rglob("*"))]
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step tiny run (checkpoints 2 and 4); tests copy it before changing it."""
    run_dir = tmp_path_factory.mktemp("trained")
    loop.train_and_evaluate(testing.tiny_config(), str(run_dir))
    return run_dir


def _copy(trained, tmp_path) -> pathlib.Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    return run_dir


def test_second_run_stops_naming_the_process_that_holds_the_workdir(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom lmzoo import workdir\nheld = workdir.lock(sys.argv[1])\nprint('locked', flush=True)\ntime.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(workdir.WorkdirLockedError, match=f"in use by pid {holder.pid} on .*use another --workdir"):
            loop.train_and_evaluate(testing.tiny_config(), str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock"]


@pytest.mark.parametrize(
    "override, error, message",
    [
        (
            {"model": {"mlp_dim": 48}},
            checkpoint.IncompatibleCheckpointError,
            r"mlp/wi/kernel: checkpoint \(32, 64\) vs model \(32, 48\)",
        ),
        (
            {"optim": {"learning_rate": 3e-4}},
            ValueError,
            r"optim.learning_rate: 0.001 -> 0.0003\n.*pass a new --workdir",
        ),
        ({"model": {"activation": "relu"}}, ValueError, r"model.activation: 'gelu_tanh' -> 'relu'"),
    ],
)
def test_resume_that_changes_training_is_refused_and_leaves_the_run_state(trained, tmp_path, override, error, message):
    run_dir = _copy(trained, tmp_path)
    before = _snapshot(run_dir)
    config = testing.tiny_config()
    for section, fields in override.items():
        config[section].update(fields)
    with pytest.raises(error, match=message):
        loop.train_and_evaluate(config, str(run_dir))
    assert _snapshot(run_dir) == before
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")]
    assert _steps(run_dir) == [2, 4]


def _char_config(tmp_path, name: str, text: str):
    (tmp_path / name).write_text(text)
    config = testing.tiny_config()
    config.data.source, config.data.path, config.data.tokenizer.kind = "local", str(tmp_path / name), "char"
    config.train.sample_tokens = 0
    return config


def test_failed_first_start_writes_nothing_and_its_tokenizer_is_not_reused(tmp_path):
    run_dir = tmp_path / "run"
    too_short = _char_config(tmp_path, "short.txt", "abc " * 8)  # the training split is shorter than a window
    with pytest.raises(ValueError, match="fewer than seq_len"):
        loop.train_and_evaluate(too_short, str(run_dir))
    assert not run_dir.exists()  # the failed start created the workdir and left nothing behind
    # a run that committed its tokenizer and died before any checkpoint: the next run builds its own
    with workdir.StagedRunState(run_dir) as stage:
        run_lib.build(_char_config(tmp_path, "abc.txt", "abc " * 200), str(run_dir), stage)
        stage.commit()
    final = loop.train_and_evaluate(_char_config(tmp_path, "other.txt", "Fed xyz. " * 200), str(run_dir))
    assert final["loss"] > 0
    assert "F" in json.loads((run_dir / "tokenizer" / "spec.json").read_text())["chars"]


@pytest.mark.parametrize(
    "section, field, value, message",
    [
        ("train", "batch_size", 0, "config.train.batch_size=0: must be a positive integer"),
        ("train", "keep_checkpoints", 0, "config.train.keep_checkpoints=0: must be a positive integer"),
        ("train", "log_every", 0, "config.train.log_every=0: must be a positive integer"),
        (
            "data",
            "path",
            "/etc/hostname",
            "config.data.path='/etc/hostname': is ignored by config.data.source='python_stdlib'",
        ),
        (
            "sharding",
            "mesh_shape",
            (2, 1, 1),
            "config.sharding.mesh_shape=(2, 1, 1): mesh shape (2, 1, 1) needs 2 devices",
        ),
    ],
)
def test_bad_values_are_refused_before_any_work(tmp_path, section, field, value, message):
    config = testing.tiny_config()
    config[section][field] = value
    with pytest.raises(ValueError) as raised:
        loop.train_and_evaluate(config, str(tmp_path))
    assert message in str(raised.value)
    assert list(tmp_path.iterdir()) == []  # the workdir was empty and is empty again


def test_batch_not_divisible_by_the_devices_is_refused_naming_the_field(tmp_path):
    cmd = _train_cmd(tmp_path / "run", "--config.distributed.cpu_devices_per_process=8", "--config.eval.batch_size=12")
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-3:] == [
        "error: invalid config values:",
        "  config.train.batch_size=4: must be a multiple of 8 (grad_accum_steps=1 x 8 data-parallel devices); "
        "set --config.train.batch_size=8, or keep the batch sizes and shard the model over the other devices: "
        "--config.sharding.mesh_shape='(4,1,2)'",
        "  config.eval.batch_size=12: must be a multiple of the 8 data-parallel devices; set --config.eval.batch_size=8, "
        "or keep the batch sizes and shard the model over the other devices: --config.sharding.mesh_shape='(4,1,2)'",
    ]
    assert not (tmp_path / "run").exists()


def test_a_run_whose_batches_split_traces_its_model_once(tmp_path, monkeypatch):
    """Issue 54: the state is traced once to check the layout, and that trace is what the trainer is compiled from;
    the trace with no mesh that finds a mesh to suggest is made only for a batch size that does not split."""
    from lmzoo.trainers import base as trainers_base

    traced = []
    original = trainers_base.traced_state
    monkeypatch.setattr(
        trainers_base, "traced_state", lambda *a, **k: traced.append(k.get("sizes")) or original(*a, **k)
    )
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    config = testing.tiny_config(sample_tokens=0)
    config.data.source, config.data.path, config.data.tokenizer = "local", str(corpus), {"kind": "char"}
    run_lib.build(config, str(tmp_path / "run")).close()
    assert traced == [(1, 1, 1, 1)]


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown config variant 'tinyy' in 'tinyy'; known variants: tiny"):
        config_lib.check_overrides(["--config=configs/default.py:tinyy"], default=str(ROOT / "configs" / "default.py"))


def test_missing_metadata_falls_back_to_the_previous_step_naming_the_file(trained, tmp_path, caplog):
    run_dir = _copy(trained, tmp_path)
    (run_dir / "checkpoints" / "4" / "state" / "_METADATA").unlink()
    run = run_lib.build(run_lib.load_saved(str(run_dir)), str(run_dir))
    try:
        step, _, data_state = run.checkpointer.restore_latest(run.abstract_state)
    finally:
        run.close()
    assert step == 2 and data_state == {"step": 2}
    assert "checkpoints/4/state/_METADATA: no parameter metadata" in caplog.text


def test_every_checkpoint_damaged_stops_and_deletes_nothing(trained, tmp_path, caplog):
    run_dir = _copy(trained, tmp_path)
    for step in (2, 4):
        for f in (run_dir / "checkpoints" / str(step) / "state" / "d").iterdir():
            f.write_bytes(b"broken")
    with pytest.raises(
        checkpoint.CheckpointReadError, match="no checkpoint in .* could be restored; nothing was deleted"
    ):
        loop.train_and_evaluate(testing.tiny_config(steps=6), str(run_dir))
    assert _steps(run_dir) == [2, 4]
    # orbax's abandoned futures report their exceptions through asyncio whenever they are collected, often after
    # the run's own message: such a report is dropped once a restore met damage.
    logging.getLogger("asyncio").error("Future exception was never retrieved\nfuture: <Future finished ...>")
    assert not [r for r in caplog.records if "exception was never retrieved" in r.getMessage()]


def test_a_chosen_damaged_step_drops_the_reports_of_abandoned_futures(trained, tmp_path, caplog):
    run_dir = _copy(trained, tmp_path)
    for f in (run_dir / "checkpoints" / "4" / "state" / "d").iterdir():
        f.write_bytes(b"broken")
    # As in a fresh process: futures earlier tests abandoned are collected (and reported) now, not during this test.
    gc.collect()
    checkpoint._ORBAX_NOISE.futures_abandoned = False  # left set, as the failure leaves it
    run = run_lib.build(run_lib.load_saved(str(run_dir)), str(run_dir))
    try:
        with pytest.raises(checkpoint.CheckpointReadError, match="checkpoints/4 cannot be read"):
            run.checkpointer.restore_step(4, run.abstract_state)
    finally:
        run.close()
    logging.getLogger("asyncio").error("Task exception was never retrieved\nfuture: <Task finished ...>")
    assert not [r for r in caplog.records if "exception was never retrieved" in r.getMessage()]


def test_io_error_on_restore_stops_without_falling_back(trained, tmp_path, failing_open):
    run_dir = _copy(trained, tmp_path)
    env = {
        **ENV,
        "LD_PRELOAD": str(failing_open),
        "FAILFS_MATCH": f"{run_dir}/checkpoints/4/",
        "FAILFS_ERRNO": str(errno.EIO),
    }
    result = subprocess.run(
        _train_cmd(run_dir, "--config.train.steps=6"), capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: reading checkpoint {run_dir}/checkpoints/4 failed with an I/O error (OSError: [Errno 5] Input/output error"
        )
    )
    assert _steps(run_dir) == [2, 4] and "resumed" not in result.stdout


def test_disk_full_stops_training_at_once_with_the_cause(tmp_path, failing_open):
    run_dir = tmp_path / "run"
    env = {
        **ENV,
        "LD_PRELOAD": str(failing_open),
        "FAILFS_MATCH": f"{run_dir}/checkpoints/4.",
        "FAILFS_ERRNO": str(errno.ENOSPC),
    }
    cmd = _train_cmd(run_dir, "--config.train.steps=12", "--config.train.eval_every=12")
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.returncode == 2
    lines = [
        line
        for line in result.stderr.replace("\r", "\n").splitlines()
        if line.strip() and not line.startswith("train:")
    ]
    assert lines == [
        f"error: saving a checkpoint in {run_dir}/checkpoints failed: the disk is full (No space left on device). "
        "Training stopped; the previous checkpoints [2] are intact. Fix the cause and rerun the same command to resume."
    ]
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert _steps(run_dir) == [2] and max(logged) <= 6  # stopped at the next step or, at the latest, the next save


def _start_endless_run(run_dir):
    """train.py of 100,000 steps with no checkpoint or evaluation due, returned once it has logged a step."""
    cmd = _train_cmd(
        run_dir,
        "--config.train.steps=100000",
        "--config.train.checkpoint_every=100000",
        "--config.train.eval_every=100000",
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    deadline = time.time() + 120
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    return proc


@pytest.mark.parametrize(
    "signum, status, reason", [(signal.SIGTERM, 75, "preempted"), (signal.SIGINT, 130, "interrupted")]
)
def test_sigterm_and_ctrl_c_save_then_exit_with_their_status(tmp_path, signum, status, reason):
    run_dir = tmp_path / "run"
    proc = _start_endless_run(run_dir)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, stderr
    stopped = [line for line in stderr.splitlines() if line.startswith(f"{reason}: saved checkpoint ")]
    assert len(stopped) == 1 and f"(exit status {status})" in stopped[0], stderr
    assert "Traceback" not in stderr
    assert _steps(run_dir) == [int(stopped[0].split()[3])]


def test_second_ctrl_c_aborts_at_once_without_saving(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start_endless_run(run_dir)
    proc.send_signal(signal.SIGINT)
    for line in proc.stderr:
        if line.startswith("Ctrl-C: saving a checkpoint"):
            proc.send_signal(signal.SIGINT)
            break
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGINT, stderr
    assert "second Ctrl-C: aborted without saving" in stderr and "interrupted: saved checkpoint" not in stderr
    assert _steps(run_dir) == []


def test_metrics_have_each_step_once_after_a_resume(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "4")  # as if killed after logging step 4, before its checkpoint landed
    loop.train_and_evaluate(testing.tiny_config(), str(run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = [(row["split"], row["step"]) for row in rows]
    assert sorted(keys) == sorted(set(keys)) and ("train", 4) in keys


def test_train_py_from_another_folder_prints_start_and_end_summaries(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config=configs/default.py:tiny"],  # workdir: runs/default_tiny
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for expected in (
        "model gpt2: 17,888 trained parameters",
        "data python_stdlib the Python standard library: training split of ",
        "per step: 4 sequences x 32 tokens = 128 tokens",
        "mesh data=1, fsdp=1, expert=1, tensor=1",
        f"checkpoints: {tmp_path}/runs/default_tiny/checkpoints (steps [2, 4])",
        f"metrics: {tmp_path}/runs/default_tiny/metrics.jsonl",
        f"evaluate: python eval.py --workdir={tmp_path}/runs/default_tiny",
        "final validation over the first 2 batches (config.eval.max_batches=2), 4,096 tokens: ",
    ):
        assert expected in out, out


def test_start_summary_reports_a_decay_past_the_last_step(trained):
    config = run_lib.load_saved(str(trained))
    config.train.steps = 3
    run = run_lib.build(config, str(trained))
    try:
        summary = loop.start_summary(run, run.train_loader(), 0)
    finally:
        run.close()
    assert "note: optim.decay_steps=4 > train.steps=3: the run ends before the learning rate decays" in summary
    assert "pass --config.optim.decay_steps=3 to decay fully" in summary


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--config.train.stepz=3"],
            "error: unknown config key 'train.stepz' in '--config.train.stepz=3'; valid keys of config.train: ",
        ),
        (
            ["--config=configs/default.py:tinyy"],
            "error: unknown config variant 'tinyy' in 'tinyy'; known variants: tiny",
        ),
    ],
)
def test_command_line_mistakes_are_one_line_errors(tmp_path, args, message):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, cwd=tmp_path, env=ENV
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message) and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "runs").exists()


def test_disk_still_full_on_rerun_names_the_workdir_and_the_unfinished_checkpoint(trained, tmp_path, failing_open):
    run_dir = _copy(trained, tmp_path)
    partial = run_dir / "checkpoints" / "6.orbax-checkpoint-tmp-1700000000"
    partial.mkdir()
    (partial / "part").write_bytes(b"x" * 100)
    env = {**ENV, "LD_PRELOAD": str(failing_open), "FAILFS_MATCH": f"{run_dir}/.", "FAILFS_ERRNO": str(errno.ENOSPC)}
    result = subprocess.run(
        _train_cmd(run_dir, "--config.train.steps=6"), capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: the disk holding {run_dir} is full (No space left on device: "), line
    assert f"can be deleted: ['{partial}']; free space, then rerun the same command" in line
    assert _steps(run_dir) == [2, 4] and partial.exists()
