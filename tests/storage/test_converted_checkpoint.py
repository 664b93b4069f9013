"""`python -m lmzoo.cli.convert`: a HuggingFace folder converted once into an lmzoo checkpoint (locally and in a GCS
bucket), which `ckpt:` then restores straight into the target's shardings, equal bit for bit to `hf:`'s conversion."""

import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import config as config_lib
from lmzoo import storage, weights
from lmzoo.cli import convert
from lmzoo.convert import export
from lmzoo.models import build_model, make_config
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tiny_llama_hf(folder: pathlib.Path):
    """configs/llama.py:tiny and an HF folder of random weights of its model."""
    config = config_lib.load_config_file(ROOT / "configs" / "llama.py", "tiny")
    model = build_model("llama", make_config("llama", config.model.to_dict()))
    params = nn.unbox(model.init(jax.random.key(7), jnp.zeros((1, 4), jnp.int32))["params"])
    params = jax.tree.map(
        lambda x: x + 0.01 * np.random.default_rng(1).standard_normal(x.shape).astype(x.dtype), params
    )
    export.export_hf("llama", config.model.to_dict(), jax.device_get(params), str(folder))
    return config


@pytest.mark.parametrize("where", ["local", "gs"])
def test_converted_checkpoint_restores_sharded_and_equals_the_hf_conversion(where, tmp_path, request):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("gcs_bucket")
    config = _tiny_llama_hf(tmp_path / "hf")
    summary = convert.convert(config, f"hf:{tmp_path / 'hf'}", f"{root}/converted")
    assert summary["parameters"] > 0 and storage.exists(f"{root}/converted/checkpoints/0")

    run = run_lib.build(config, str(tmp_path / "target"), batches=False)
    target = run.compiled.abstract_state.params
    run.close()
    restored = weights.read_params(f"ckpt:{root}/converted", "llama", config.model.to_dict(), target)
    converted = weights.read_params(f"hf:{tmp_path / 'hf'}", "llama", config.model.to_dict(), target)
    for ours, theirs, like in zip(
        jax.tree.leaves(restored), jax.tree.leaves(converted), jax.tree.leaves(target), strict=True
    ):
        assert isinstance(ours, jax.Array) and ours.sharding == like.sharding and ours.dtype == like.dtype
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert weights.saved_config(f"{root}/converted")["converted_from"] == f"hf:{tmp_path / 'hf'}"


def test_convert_refuses_a_folder_with_checkpoints_in_one_line(tmp_path):
    _tiny_llama_hf(tmp_path / "hf")
    command = [
        sys.executable, "-m", "lmzoo.cli.convert", "--config=configs/llama.py:tiny", f"--from=hf:{tmp_path / 'hf'}",
        f"--out={tmp_path / 'converted'}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    first = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1].startswith("error: --out=")
    assert "holds checkpoints already" in again.stderr and "Traceback" not in again.stderr


def test_convert_after_a_failure_runs_again_from_any_folder(tmp_path):
    """Issue 55: a failed conversion leaves no empty checkpoints/ that would refuse the corrected command, and
    `--config=configs/...` is found from outside the repository, as train.py finds it."""
    _tiny_llama_hf(tmp_path / "hf")
    out = tmp_path / "converted"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}

    def convert_with(config: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "lmzoo.cli.convert", config, f"--from=hf:{tmp_path / 'hf'}", f"--out={out}"]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env)

    failed = convert_with("--config=configs/default.py:tiny")  # a GPT-2 config for Llama weights
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert failed.stderr.splitlines() == [
        f"error: {tmp_path / 'hf'}/config.json: HF config has model_type='llama'; the gpt2 converter reads only "
        "'gpt2' checkpoints"
    ]
    assert not out.exists()
    corrected = convert_with("--config=configs/llama.py:tiny")
    assert corrected.returncode == 0, corrected.stderr[-2000:]
    assert storage.exists(out / "checkpoints" / "0")
