"""A bucket that does not exist (gs://, s3://) and S3 without credentials, as train.py and eval.py meet them (issue
55): one line that names the bucket or the missing credentials, exit status 2, no traceback; a truncated checkpoint
file: one warning line as train.py and eval.py fall back to the previous step. And the storage deadline's variable read as a user
gives it."""

import json
import os
import pathlib
import subprocess
import sys
import types
import uuid

import pytest

from lmzoo import checkpoint, storage, testing
from lmzoo.train import loop
from tests.storage.conftest import _create_bucket

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = {"train.py": ROOT / "train.py", "eval.py": ROOT / "eval.py"}


def _run(script: str, workdir: str, env: dict) -> str:
    """The one `error:` line of `script` on `workdir`, which must exit with status 2 and no traceback."""
    extra = ["--config=configs/default.py:tiny"] if script == "train.py" else []
    result = subprocess.run(
        [sys.executable, str(SCRIPTS[script]), *extra, f"--workdir={workdir}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return errors[0]


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("kind", ["gs", "s3"])
def test_a_bucket_that_does_not_exist_is_named(object_storage, kind, script):
    if not object_storage[kind].startswith("http://"):
        pytest.skip(object_storage[kind])
    bucket = f"{kind}://lmzoo-missing-{uuid.uuid4().hex[:8]}"
    line = _run(script, f"{bucket}/run", dict(os.environ))
    assert line.startswith(f"error: {bucket}: no such bucket (needed for {bucket}/run/"), line


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize("script", SCRIPTS)
def test_s3_without_credentials_is_named(object_storage, script):
    if not object_storage["s3"].startswith("http://"):
        pytest.skip(object_storage["s3"])
    bucket = f"lmzoo-{uuid.uuid4().hex[:16]}"
    _create_bucket("s3", object_storage["s3"], bucket)
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance role to ask on this machine (botocore would wait for it)
    line = _run(script, f"s3://{bucket}/run", env)
    assert line.startswith(f"error: s3://{bucket}/run/"), line
    assert "no AWS credentials were found (NoCredentialsError): set AWS_ACCESS_KEY_ID" in line, line


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf"])
def test_a_storage_deadline_that_is_not_a_positive_number_is_refused(monkeypatch, value):
    monkeypatch.setenv(storage.DEADLINE_VARIABLE, value)
    with pytest.raises(ValueError, match=f"{storage.DEADLINE_VARIABLE}='{value}': give the seconds"):
        storage.deadline_seconds()


def test_the_storage_deadline_bounds_the_request_timeout(monkeypatch):
    monkeypatch.delenv(storage.DEADLINE_VARIABLE, raising=False)
    assert storage.deadline_seconds() == 30 and storage.request_timeout_seconds() == 10
    monkeypatch.setenv(storage.DEADLINE_VARIABLE, "6")
    assert storage.deadline_seconds() == 6 and storage.request_timeout_seconds() == 2


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("root", ["local", "gs"], indirect=True)
def test_a_truncated_checkpoint_falls_back_with_one_warning_line(root, script):
    run_dir = f"{root}/run"
    loop.train_and_evaluate(testing.tiny_config(steps=4), run_dir)
    largest = max(storage.find_files(f"{run_dir}/checkpoints/4/state"), key=lambda file: storage.stat(file)[0])
    storage.write_bytes(largest, storage.read_bytes(largest)[: storage.stat(largest)[0] // 2])
    flags = ["--config=configs/default.py:tiny", "--config.train.steps=6"] if script == "train.py" else []
    result = subprocess.run(
        [sys.executable, str(SCRIPTS[script]), f"--workdir={run_dir}", *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.strip()]
    said = [line for line in said if not line.startswith("train:") and "google_auth_provider" not in line]
    assert len(said) == 1 and f"checkpoint {run_dir}/checkpoints/4 is unreadable (" in said[0], result.stderr
    assert said[0].endswith("; trying the previous one") and "See full TensorStore details" not in said[0]
    if script == "train.py":
        assert f"resumed from {run_dir}/checkpoints/2\n" in result.stdout
    else:
        assert json.loads(result.stdout.splitlines()[0])["step"] == 2


def test_reports_of_orbax_coroutines_left_by_a_failed_read_are_dropped(monkeypatch):
    """Python's "Exception ignored in: <coroutine ...>" of orbax's coroutines collected after a damaged checkpoint was
    met are dropped; others, and any before, are reported."""
    source = "async def read():\n    pass\n"
    orbax_made, mine_made = {}, {}
    exec(compile(source, "/site-packages/orbax/checkpoint/fake.py", "exec"), orbax_made)  # as if orbax's
    exec(compile(source, "/elsewhere/mine.py", "exec"), mine_made)
    reported = []
    hook = checkpoint._drop_abandoned_coroutine_reports(reported.append)
    for abandoned in (False, True):
        monkeypatch.setattr(checkpoint._ORBAX_NOISE, "futures_abandoned", abandoned)
        for function in (orbax_made["read"], mine_made["read"]):
            coroutine = function()
            hook(types.SimpleNamespace(object=coroutine, exc_value=RuntimeError("late")))
            coroutine.close()
    assert [report.object.cr_code.co_filename for report in reported] == [
        "/site-packages/orbax/checkpoint/fake.py",
        "/elsewhere/mine.py",
        "/elsewhere/mine.py",
    ]


@pytest.mark.parametrize("abandoned", [False, True])
def test_a_process_that_abandoned_a_save_exits_with_its_status_and_without_finalizing(abandoned):
    """`checkpoint.exit_past_abandoned_saves`: once a save was abandoned, the process ends with the given status, its
    output flushed and no exit handler run (a finalizing interpreter aborts on the abandoned save's threads, still in
    the bucket clients' C++ code: tests/storage/test_bucket_outage.py met it as exit status -6); otherwise it returns
    and the process exits as usual."""
    program = (
        "import atexit, sys\n"
        "from lmzoo import checkpoint\n"
        "atexit.register(lambda: print('finalized', flush=True))\n"
        f"if {abandoned}:\n"
        "    checkpoint._exit_without_waiting_for_saves()\n"
        "print('error: the line a stopped run prints', file=sys.stderr)\n"
        "print('kept', end='')\n"
        "checkpoint.exit_past_abandoned_saves(2)\n"
        "sys.exit(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT)
    assert result.stderr.endswith("error: the line a stopped run prints\n"), result.stderr
    if abandoned:
        assert (result.returncode, result.stdout) == (2, "kept")
    else:
        assert (result.returncode, result.stdout) == (3, "keptfinalized\n")
    # A message for a code (`sys.exit("...")`): printed, status 1, as Python does
    message = program.replace("exit_past_abandoned_saves(2)", "exit_past_abandoned_saves('stopped: a message')")
    result = subprocess.run([sys.executable, "-c", message], capture_output=True, text=True, cwd=ROOT)
    if abandoned:
        assert (result.returncode, result.stdout) == (1, "kept")
        assert result.stderr.endswith("error: the line a stopped run prints\nstopped: a message\n"), result.stderr
