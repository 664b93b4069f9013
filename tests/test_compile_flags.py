"""The suite compiles with lmzoo.testing.FAST_COMPILE_XLA_FLAGS (XLA's quickest CPU pipeline); users run XLA's
default one. The same run trained under each gives the same losses, so what the suite checks holds for the programs
users compile."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from lmzoo import config as config_lib
from lmzoo import testing
from lmzoo.train import loop

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The Llama block (RoPE, grouped-query attention, RMSNorm, SwiGLU) with AdamW, clipping and a cosine schedule.
CONFIG_FILE, VARIANT = "configs/llama.py", "tiny"


def _train_losses(workdir: pathlib.Path) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row["split"] == "train"]


@pytest.mark.slow  # a train.py process
def test_the_default_xla_pipeline_trains_to_the_losses_the_suite_sees(tmp_path):
    fast_flags = os.environ["LMZOO_TEST_FAST_XLA_FLAGS"].split()  # those of FAST_COMPILE_XLA_FLAGS this XLA knows
    assert fast_flags and all(flag in os.environ["XLA_FLAGS"].split() for flag in fast_flags)
    config = config_lib.load_config_file(ROOT / CONFIG_FILE, VARIANT)
    config.train.log_every, config.train.sample_tokens = 1, 0
    loop.train_and_evaluate(config, str(tmp_path / "suite"))

    env = {**os.environ, "XLA_FLAGS": " ".join(testing.default_pipeline_xla_flags()), "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "train.py",
        f"--config={CONFIG_FILE}:{VARIANT}",
        f"--workdir={tmp_path / 'default'}",
        "--config.train.log_every=1",
        "--config.train.sample_tokens=0",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

    suite, default = _train_losses(tmp_path / "suite"), _train_losses(tmp_path / "default")
    assert len(suite) == len(default) == config.train.steps
    # Equal here bit for bit; the pipelines may fuse or contract float operations differently on other CPUs.
    np.testing.assert_allclose(default, suite, rtol=1e-5)


def test_flags_this_xla_does_not_know_are_left_out():
    """XLA ends a process (exit 1) whose XLA_FLAGS name an unknown flag: under pytest's capture the whole run ends
    with no output (tests/test_gpu.py ended so under the GPU machine's jax 0.11.2)."""
    known = testing.FAST_COMPILE_XLA_FLAGS[0]
    assert testing.accepted_xla_flags([known, "--xla_no_such_flag=true"]) == [known]
