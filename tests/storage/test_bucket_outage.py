"""A bucket's server that dies, or stops answering, under a train.py that saves checkpoints (issue 55): the run stops
within the documented time (storage.deadline_seconds(), set small here) with one line naming the last committed
checkpoint, and a rerun once the server is back resumes from it exactly. fake-gcs-server killed (SIGKILL: it keeps its
objects in a folder and is started again) or frozen (SIGSTOP, then SIGCONT), and moto_server frozen (it keeps its
objects in memory, so it cannot be killed and brought back)."""

import hashlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import uuid

import jax
import numpy as np
import pytest

from lmzoo import storage, testing
from lmzoo.train import loop
from lmzoo.train import run as run_lib
from tests.storage.conftest import _create_bucket, _free_port, _start

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN_PY = ROOT / "train.py"
DEADLINE_S = 6  # LMZOO_STORAGE_DEADLINE_S of the runs below: requests time out after 2 s
STOPPED_WITHIN_S = 30  # from the outage to the process's exit: about twice the deadline, and Python's exit
EVERY = ("--config.train.checkpoint_every=5", "--config.train.log_every=5", "--config.train.eval_every=100000")


def _train_cmd(run_dir: str, steps: int) -> list[str]:
    return [
        sys.executable,
        str(TRAIN_PY),
        "--config=configs/default.py:tiny",
        f"--workdir={run_dir}",
        f"--config.train.steps={steps}",
        *EVERY,
    ]


def _committed_steps(run_dir: str) -> list[int]:
    try:
        names = storage.list_dir(f"{run_dir}/checkpoints")
    except FileNotFoundError:
        return []
    steps = sorted(int(name) for name in names if name.isdigit())
    return [step for step in steps if storage.exists(f"{run_dir}/checkpoints/{step}/commit_success.txt")]


def _saving_run(run_dir: str, env: dict) -> subprocess.Popen:
    """train.py saving every 5 steps, returned once it committed two checkpoints."""
    proc = subprocess.Popen(
        _train_cmd(run_dir, 100_000),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**env, storage.DEADLINE_VARIABLE: str(DEADLINE_S)},
    )
    deadline = time.time() + 180
    while len(_committed_steps(run_dir)) < 2:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    return proc


def _stopped(proc: subprocess.Popen, outage: float) -> tuple[float, int, int | None]:
    """(seconds from the outage to the exit, the last committed step its one line names, the step in flight it
    names)."""
    _, stderr = proc.communicate(timeout=300)
    took = time.monotonic() - outage
    assert proc.returncode == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert "rerun the same command once the bucket answers, to resume" in errors[0], errors[0]
    named = re.search(r"the last committed checkpoint is step (\d+) \(", errors[0])
    in_flight = re.search(r"the save of step (\d+) was in flight", errors[0])
    assert named, errors[0]
    print(f"stopped {took:.1f} s after the outage: {errors[0]}")
    return took, int(named.group(1)), int(in_flight.group(1)) if in_flight else None


def _digest(workdir: str) -> str:
    """The newest checkpoint of `workdir` that restores: its step, data state and a hash of the whole train state."""
    run = run_lib.build(run_lib.load_saved(workdir), workdir)
    step, state, data_state = run.checkpointer.restore_latest(run.abstract_state)
    run.close()
    state_hash = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(state)):
        state_hash.update(np.ascontiguousarray(leaf).tobytes())
    return f"{step} {data_state} {state_hash.hexdigest()}"


def _resumes_exactly(run_dir: str, named: int, in_flight: int | None, env: dict, tmp_path) -> None:
    """The server is back: the step named is committed (or the one in flight, whose requests a frozen server carried
    out once it answered again), and a rerun resumes from the newest and ends where an uninterrupted run does. The
    bucket is read in a subprocess: orbax's clients in this process (etils.epath's, cached by fsspec) would keep this
    test's server, which the next tests do not have."""
    committed = _committed_steps(run_dir)
    assert named in committed and committed[-1] in (named, in_flight), (committed, named, in_flight)
    end = committed[-1] + 2
    rerun = subprocess.run(_train_cmd(run_dir, end), capture_output=True, text=True, cwd=ROOT, env=env)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resumed from {run_dir}/checkpoints/{committed[-1]}\n" in rerun.stdout

    straight = str(tmp_path / "straight")
    loop.train_and_evaluate(
        testing.tiny_config(steps=end, checkpoint_every=5, log_every=5, eval_every=100_000), straight
    )
    read = f"from tests.storage.test_bucket_outage import _digest; print(_digest({run_dir!r}))"
    resumed = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, cwd=ROOT, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip().splitlines()[-1] == _digest(straight) and _digest(straight).startswith(f"{end} ")


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize("outage", ["killed", "frozen"])
def test_gcs_server_gone_mid_run_stops_it_within_the_deadline_and_the_rerun_resumes(
    stoppable_gcs_server, outage, monkeypatch, tmp_path
):
    server = stoppable_gcs_server
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    env = {**os.environ, "TENSORSTORE_GCS_HTTP_URL": server.url, "PYTHONPATH": str(ROOT)}
    run_dir = f"{server.bucket}/run"
    proc = _saving_run(run_dir, env)
    if outage == "killed":
        server.process.kill()
        outage_began = time.monotonic()
        server.process.wait()
        took, named, in_flight = _stopped(proc, outage_began)
        server.start()
    else:
        server.process.send_signal(signal.SIGSTOP)  # connections are still accepted; nothing answers
        outage_began = time.monotonic()
        try:
            took, named, in_flight = _stopped(proc, outage_began)
        finally:
            server.process.send_signal(signal.SIGCONT)
    assert took <= STOPPED_WITHIN_S, took

    _resumes_exactly(run_dir, named, in_flight, env, tmp_path)


@pytest.fixture
def frozen_s3(object_storage, tmp_path_factory, monkeypatch):
    """A moto_server of the test's own (freezing the session's would stall the other tests) with a bucket: yields
    (its process, the bucket as s3://NAME), the test's environment pointing at it."""
    if not object_storage["s3"].startswith("http://"):
        pytest.skip(object_storage["s3"])
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    server = _start(command, url, tmp_path_factory.mktemp("moto") / "moto_server.log")
    bucket = f"lmzoo-{uuid.uuid4().hex[:16]}"
    _create_bucket("s3", url, bucket)
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    yield server, f"s3://{bucket}"
    server.send_signal(signal.SIGCONT)
    server.terminate()
    server.wait(timeout=10)


@pytest.mark.slow  # subprocesses
def test_s3_server_frozen_mid_run_stops_it_within_the_deadline_and_the_rerun_resumes(frozen_s3, tmp_path):
    server, bucket = frozen_s3
    run_dir = f"{bucket}/run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = _saving_run(run_dir, env)
    server.send_signal(signal.SIGSTOP)  # connections are still accepted; nothing answers
    outage = time.monotonic()
    try:
        took, named, in_flight = _stopped(proc, outage)
    finally:
        server.send_signal(signal.SIGCONT)
    assert took <= STOPPED_WITHIN_S, took

    _resumes_exactly(run_dir, named, in_flight, env, tmp_path)
