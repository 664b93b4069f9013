"""A workdir in a GCS bucket, on the fake-gcs-server of tests/storage/conftest.py (and in an S3 bucket on its
moto_server): train.py killed by SIGKILL while saving a checkpoint and resumed bit-exactly, eval.py and export reading
the bucket, the lease lock (a second run refused, a stale lock taken
over, a lost lease stopping its holder), run state committed object by object and cut short between two, and the
server stopped mid-run. Real processes where the case needs them."""

import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from lmzoo import metrics, storage, testing, weights, workdir
from lmzoo.cli import export as export_cli
from lmzoo.evaluation import plots
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env(**variables: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), **variables}


def _train_cmd(run_dir: str, *overrides: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "train.py"),
        "--config=configs/default.py:tiny",
        f"--workdir={run_dir}",
        *overrides,
    ]


def _step_folders(run_dir: str) -> list[int]:
    """Checkpoint steps with a folder in the bucket, finished or not."""
    try:
        return sorted(int(name) for name in storage.list_dir(f"{run_dir}/checkpoints") if name.isdigit())
    except FileNotFoundError:
        return []


def _committed_steps(run_dir: str) -> list[int]:
    """Checkpoint steps whose save finished: orbax on a bucket writes a step in place and commit_success.txt last."""
    return [
        step for step in _step_folders(run_dir) if storage.exists(f"{run_dir}/checkpoints/{step}/commit_success.txt")
    ]


def _rows(run_dir: str) -> list[dict]:
    """metrics.jsonl, every line parsed (a damaged line fails the test)."""
    return [json.loads(line) for line in storage.read_text(f"{run_dir}/metrics.jsonl").splitlines()]


def _final_state(run_dir: str):
    run = run_lib.build(run_lib.load_saved(run_dir), run_dir)
    step, state, data_state = run.checkpointer.restore_latest(run.abstract_state)
    run.close()
    return step, jax.device_get(state), data_state


def _lock_record(**fields) -> bytes:
    """A lock object as another run writes it."""
    record = {
        "pid": 4242,
        "host": "other-host",
        "command": "train.py --workdir=gs://...",
        "started": "2026-01-01T00:00:00Z",
        "token": "0123456789abcdef",
        "machine": "another-machine/1",
        "heartbeat": time.time(),
        "heartbeat_every_s": 10,
    }
    return json.dumps({**record, **fields}).encode()


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize("root", ["gs", "s3"], indirect=True)
def test_killed_run_resumes_bit_exactly_and_eval_and_export_read_the_bucket(root, tmp_path, caplog):
    killed, straight = f"{root}/killed", f"{root}/straight"
    every = ("--config.train.checkpoint_every=2", "--config.train.eval_every=1000")
    proc = subprocess.Popen(
        _train_cmd(killed, "--config.train.steps=1000", *every),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(),
    )
    deadline = time.time() + 240
    while not (_committed_steps(killed)[-1:] >= [4] and _step_folders(killed)[-1] > _committed_steps(killed)[-1]):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # while the save of the newest step folder is in flight
    proc.communicate()
    assert _step_folders(killed)[-1] > _committed_steps(killed)[-1]  # left unfinished, not committed
    assert len(_rows(killed)) >= 2 and storage.exists(f"{killed}/lock")  # whole rows; the lock left behind
    end = _step_folders(killed)[-1] + 4  # the resumed run saves the unfinished step again

    with caplog.at_level(logging.WARNING, logger="lmzoo.workdir"):
        loop.train_and_evaluate(testing.tiny_config(steps=end, checkpoint_every=2, eval_every=1000), killed)
    assert f"taking over the lock of pid {proc.pid} on " in caplog.text and "on this machine is gone" in caplog.text
    loop.train_and_evaluate(testing.tiny_config(steps=end, checkpoint_every=2, eval_every=1000), straight)
    step_a, state_a, data_a = _final_state(straight)
    step_b, state_b, data_b = _final_state(killed)
    assert step_a == step_b == end and data_a == data_b == {"step": end}
    jax.tree.map(np.testing.assert_array_equal, state_a, state_b)
    keys = [(row["split"], row["step"]) for row in _rows(killed)]
    assert sorted(keys) == sorted(set(keys)) and ("train", end) in keys
    assert not storage.exists(f"{killed}/lock")  # a run that ends deletes its lock object

    result = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), f"--workdir={killed}", "--max_batches=2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.splitlines()[0])
    assert line["step"] == end
    assert json.loads(storage.read_text(f"{killed}/eval_validation_max2batches.json")) == line
    summary = export_cli.export_workdir(killed, str(tmp_path / "hf"))
    assert summary["step"] == end and (tmp_path / "hf" / "model.safetensors").is_file()

    # Export into the bucket: the same files; refused over a non-empty prefix without --overwrite, or over the run.
    assert export_cli.export_workdir(killed, f"{root}/hf")["step"] == end
    for name in os.listdir(tmp_path / "hf"):
        assert storage.read_bytes(f"{root}/hf/{name}") == (tmp_path / "hf" / name).read_bytes(), name
    with pytest.raises(FileExistsError, match="is not empty"):
        export_cli.export_workdir(killed, f"{root}/hf")
    storage.write_text(f"{root}/hf/stale.txt", "from an older export")
    export_cli.export_workdir(killed, f"{root}/hf", overwrite=True)
    assert "stale.txt" not in storage.list_dir(f"{root}/hf")
    with pytest.raises(ValueError, match="holds the run's workdir"):
        export_cli.export_workdir(killed, root, overwrite=True)

    # Weights read from the bucket: the export as hf:gs://..., the run itself as ckpt:gs://...
    config = testing.tiny_config()
    from_bucket = weights.read_params(f"hf:{root}/hf", config.model_name, config.model.to_dict(), state_a.params)
    from_folder = weights.read_params(
        f"hf:{tmp_path / 'hf'}", config.model_name, config.model.to_dict(), state_a.params
    )
    jax.tree.map(np.testing.assert_array_equal, from_bucket, from_folder)
    jax.tree.map(np.testing.assert_array_equal, weights.read_params(f"ckpt:{killed}", "", None, None), state_b.params)


@pytest.mark.slow  # subprocesses
def test_second_run_on_a_bucket_workdir_is_refused_naming_the_holder(gcs_bucket):
    run_dir = f"{gcs_bucket}/run"
    with workdir.lock(run_dir):
        result = subprocess.run(_train_cmd(run_dir), capture_output=True, text=True, cwd=ROOT, env=_env())
    assert result.returncode == 2, result.stderr
    refusal = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(refusal) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"workdir '{run_dir}' is in use by pid {os.getpid()} on " in refusal[0]
    assert re.search(r"\(last heartbeat \d+ s ago; .*use another --workdir", refusal[0])
    with pytest.raises(FileNotFoundError):
        storage.list_dir(run_dir)  # the refused run wrote nothing; the holder deleted its lock


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize("root", ["gs", "s3"], indirect=True)
def test_stale_lock_is_taken_over_with_a_warning_and_a_live_one_refused(root, caplog):
    run_dir, lock_object = f"{root}/run", f"{root}/run/lock"
    storage.write_bytes(lock_object, _lock_record(heartbeat=time.time() - 5))
    with pytest.raises(workdir.WorkdirLockedError, match=r"in use by pid 4242 on other-host.*last heartbeat \d+ s ago"):
        workdir.lock(run_dir)
    storage.write_bytes(lock_object, _lock_record(heartbeat=time.time() - 3600))
    with caplog.at_level(logging.WARNING, logger="lmzoo.workdir"), workdir.lock(run_dir) as held:
        assert held.stale_holder.pid == 4242
        assert json.loads(storage.read_bytes(lock_object))["pid"] == os.getpid()
    assert "taking over the lock of pid 4242 on other-host" in caplog.text
    assert re.search(r"its last heartbeat was 36\d\d s ago \(stale after 60 s\)", caplog.text)
    assert not storage.exists(lock_object)


@pytest.mark.parametrize("root", ["gs", "s3"], indirect=True)
def test_of_runs_taking_over_one_stale_lock_one_wins(root):
    run_dir = f"{root}/run"
    storage.write_bytes(f"{run_dir}/lock", _lock_record(heartbeat=time.time() - 3600))
    start, outcomes = threading.Barrier(4), []

    def take():
        start.wait()
        try:
            outcomes.append(workdir.lock(run_dir))
        except workdir.WorkdirLockedError as refused:
            outcomes.append(refused)

    takers = [threading.Thread(target=take) for _ in range(4)]
    for taker in takers:
        taker.start()
    for taker in takers:
        taker.join()
    held = [outcome for outcome in outcomes if isinstance(outcome, workdir.LeaseLock)]
    assert len(held) == 1, outcomes
    for refused in outcomes:
        if refused is not held[0]:
            assert f"in use by pid {os.getpid()}" in str(refused) or "kept changing" in str(refused)
    assert json.loads(storage.read_bytes(f"{run_dir}/lock"))["token"] == held[0].token
    held[0].release()


@pytest.mark.parametrize("root", ["gs", "s3"], indirect=True)
def test_heartbeat_renews_and_a_holder_whose_lock_was_taken_stops(root, monkeypatch):
    monkeypatch.setattr(workdir, "HEARTBEAT_SECONDS", 0.1)
    lock_object = f"{root}/run/lock"
    held = workdir.lock(f"{root}/run")
    first = json.loads(storage.read_bytes(lock_object))["heartbeat"]
    time.sleep(0.5)
    assert json.loads(storage.read_bytes(lock_object))["heartbeat"] > first
    held.check()
    storage.write_bytes(lock_object, _lock_record())  # as a run that found the lock stale would
    with pytest.raises(workdir.LeaseLostError, match="replaced or deleted by another run"):
        deadline = time.time() + 10
        while time.time() < deadline:
            held.check()
            time.sleep(0.05)
    held.release()
    assert json.loads(storage.read_bytes(lock_object))["pid"] == 4242  # the loser leaves the new holder's object


def test_holder_stops_when_its_lock_cannot_be_renewed(stoppable_gcs_server, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", stoppable_gcs_server.url)
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", stoppable_gcs_server.url)
    monkeypatch.setattr(workdir, "HEARTBEAT_SECONDS", 0.1)
    monkeypatch.setattr(workdir, "GIVE_UP_SECONDS", 1.0)
    monkeypatch.setattr(workdir, "RELEASE_WAIT_SECONDS", 0.5)
    held = workdir.lock(f"{stoppable_gcs_server.bucket}/run")
    stoppable_gcs_server.stop()
    time.sleep(1.5)
    with pytest.raises(workdir.LeaseLostError, match=r"could not be renewed for \d+ s.*Rerun the same command"):
        held.check()
    held.release()  # gives up waiting for the bucket


def test_metric_writer_on_a_bucket_rotates_event_files_and_drops_rows_past_a_resume(gcs_bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "EVENT_FILE_BYTES", 1000)
    run_dir = f"{gcs_bucket}/run"
    writer = metrics.MetricWriter(run_dir)
    for step in range(1, 41):
        writer.write(step, {"loss": 1.0 / step}, "train")
    writer.close()
    first_files = storage.list_dir(f"{run_dir}/tb")
    assert len(first_files) > 1  # a new file begun each time one passed 1000 bytes
    resumed = metrics.MetricWriter(run_dir, resume_step=30)  # as a run resumed from step 30 would
    for step in range(31, 36):
        resumed.write(step, {"loss": 2.0}, "train")
    resumed.close()
    assert [(row["step"], row["loss"]) for row in _rows(run_dir)] == [(step, 1.0 / step) for step in range(1, 31)] + [
        (step, 2.0) for step in range(31, 36)
    ]
    files = storage.list_dir(f"{run_dir}/tb")
    assert set(first_files) < set(files) and files == sorted(files, key=lambda name: name.rsplit(".", 1)[-1])
    with storage.local_copy(f"{run_dir}/tb") as events:
        shutil.copytree(events, tmp_path / "tb")
    assert plots.read_events(str(tmp_path))["loss"]["train"] == [
        (step, pytest.approx(1.0 / step)) for step in range(1, 31)
    ] + [(step, 2.0) for step in range(31, 36)]


class _KilledHere(BaseException):
    """Stands for SIGKILL at one point of a run (a BaseException: nothing in the run catches it)."""


def _killed_after_writing(monkeypatch, name: str) -> None:
    """Makes storage.write_bytes stop the run just after it wrote a bucket object whose path ends with `name` (not
    the local staging copy it was made from)."""
    write_bytes = storage.write_bytes

    def write_then_die(user_path, data):
        write_bytes(user_path, data)
        if storage.is_remote(user_path) and os.fspath(user_path).endswith(name):
            raise _KilledHere(name)

    monkeypatch.setattr(storage, "write_bytes", write_then_die)


def test_start_cut_between_run_state_objects_is_handled_by_the_next(gcs_bucket, monkeypatch):
    """Run state goes to a bucket object by object (tokenizer, data.json, config.json last): a first start cut after
    its tokenizer leaves no config.json and no checkpoint, and the next start trains as if it were the first; a resumed
    start cut before its config.json leaves the last one, and the next resumes."""
    cut, straight = f"{gcs_bucket}/cut", f"{gcs_bucket}/straight"
    _killed_after_writing(monkeypatch, "/tokenizer/spec.json")
    with pytest.raises(_KilledHere):
        loop.train_and_evaluate(testing.tiny_config(), cut)
    monkeypatch.undo()
    assert storage.list_dir(cut) == ["tokenizer"]  # no config.json, data.json or checkpoint
    loop.train_and_evaluate(testing.tiny_config(), cut)
    loop.train_and_evaluate(testing.tiny_config(), straight)
    step_a, state_a, _ = _final_state(straight)
    step_b, state_b, _ = _final_state(cut)
    assert step_a == step_b == 4
    jax.tree.map(np.testing.assert_array_equal, state_a, state_b)

    config_before = storage.read_bytes(f"{cut}/config.json")
    _killed_after_writing(monkeypatch, "/data.json")
    with pytest.raises(_KilledHere):
        loop.train_and_evaluate(testing.tiny_config(steps=6), cut)
    monkeypatch.undo()
    assert storage.read_bytes(f"{cut}/config.json") == config_before
    loop.train_and_evaluate(testing.tiny_config(steps=6), cut)
    assert _committed_steps(cut) == [2, 4, 6]


@pytest.mark.slow  # subprocesses
def test_server_stopped_mid_run_stops_it_with_one_error_line_and_keeps_what_was_committed(
    stoppable_gcs_server, monkeypatch
):
    server = stoppable_gcs_server
    env = _env(STORAGE_EMULATOR_HOST=server.url, TENSORSTORE_GCS_HTTP_URL=server.url)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    run_dir = f"{server.bucket}/run"
    first = subprocess.run(_train_cmd(run_dir), capture_output=True, text=True, cwd=ROOT, env=env)
    assert first.returncode == 0, first.stderr
    run_state = ("config.json", "data.json", "tokenizer/spec.json")
    rows_before = _rows(run_dir)

    endless = (
        "--config.train.steps=100000",
        "--config.train.checkpoint_every=100000",
        "--config.train.eval_every=100000",
    )
    proc = subprocess.Popen(
        _train_cmd(run_dir, *endless), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    deadline = time.time() + 120
    while max(row["step"] for row in _rows(run_dir)) <= 4:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    committed_state = {name: storage.read_bytes(f"{run_dir}/{name}") for name in run_state}
    rows_committed = _rows(run_dir)
    server.stop()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {run_dir}/") and "the bucket's server did not answer" in last, stderr
    assert "rerun the same command once the bucket answers" in last and "Traceback" not in stderr, stderr

    server.start()
    assert _committed_steps(run_dir) == [2, 4]
    assert {name: storage.read_bytes(f"{run_dir}/{name}") for name in run_state} == committed_state
    rows = _rows(run_dir)
    assert rows[: len(rows_committed)] == rows_committed and rows[: len(rows_before)] == rows_before
    rerun = subprocess.run(
        _train_cmd(run_dir, "--config.train.steps=6"), capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert rerun.returncode == 0, rerun.stderr
    assert f"resumed from {run_dir}/checkpoints/4" in rerun.stdout
    assert _committed_steps(run_dir) == [2, 4, 6]
