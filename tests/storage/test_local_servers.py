"""docs/SCALING.md's lines that start the GCS and S3 servers on this machine, make a bucket on each and train there
(issue 55): run as written, on free ports, with none of the session's own server variables."""

import importlib.util
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import pytest

from tests.storage.conftest import _CLIENT_VARIABLES, _fake_gcs_server_binary

ROOT = pathlib.Path(__file__).resolve().parents[2]
INTRO = "To try a bucket on this machine"


def _documented_lines() -> list[str]:
    """The indented lines of the code block after SCALING.md's paragraph that starts with INTRO."""
    after = (ROOT / "docs" / "SCALING.md").read_text().split(INTRO, 1)[1].split("\n\n", 2)[1]
    assert all(line.startswith("    ") for line in after.splitlines()), after
    return [line[4:] for line in after.splitlines()]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow  # two servers and two short runs
def test_the_documented_servers_start_take_a_bucket_and_a_run():
    missing = _fake_gcs_server_binary()
    if isinstance(missing, str) or importlib.util.find_spec("moto") is None or shutil.which("curl") is None:
        pytest.skip(missing if isinstance(missing, str) else "needs moto[server] (requirements-test.txt) and curl")
    lines = _documented_lines()
    assert any(line.startswith("python train.py") and "gs://my-bucket" in line for line in lines)
    assert any(line.startswith("python train.py") and "s3://my-bucket" in line for line in lines)
    script = "\n".join(lines)
    for documented in ("4443", "4444"):  # ports another process may hold here
        script = re.sub(rf"\b{documented}\b", str(_free_port()), script)
    env = {k: v for k, v in os.environ.items() if k not in _CLIENT_VARIABLES and not k.startswith("AWS_")}
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sys.path])
    result = subprocess.run(
        ["bash", "-c", f"set -e\ntrap 'kill %1 %2' EXIT\n{script}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for scheme in ("gs", "s3"):
        assert f"checkpoints: {scheme}://my-bucket/runs/tiny/checkpoints (steps [2, 4])" in result.stdout, result.stdout
