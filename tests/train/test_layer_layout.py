"""A checkpoint written with one `config.model.scan_layers` loads into a model of the other (issue 54: the base-size
configs now scan their layers, and runs they wrote before still resume): restored, its parameters, AdamW moments,
step and rng equal the saved ones layer by layer; a resume trains on from them as it would in the saved layout; and
`init_from=ckpt:` reads its weights across layouts too."""

import json
import shutil

import flax.linen as nn
import jax
import numpy as np
import pytest

from lmzoo import models, testing, weights
from lmzoo.train import loop
from lmzoo.train import run as run_lib


def _config(scan: bool, steps: int = 2):
    config = testing.tiny_config(steps=steps, sample_tokens=0)
    config.model.num_layers, config.model.scan_layers = 2, scan
    return config


@pytest.fixture(scope="module", params=[False, True], ids=["looped", "scanned"])
def trained(request, tmp_path_factory):
    """(its scan_layers, the workdir) of a 2-step run of a 2-layer model, checkpointed at step 2."""
    run_dir = tmp_path_factory.mktemp("looped" if not request.param else "scanned")
    loop.train_and_evaluate(_config(request.param), str(run_dir))
    return request.param, run_dir


def _per_layer(state) -> dict[str, np.ndarray]:
    """Every array of a state (or params) tree by path, a scanned stack's leaves [L, ...] split into "layer_{i}"
    paths as a looped model names them: the two layouts compared leaf by leaf, without lmzoo's relayout."""
    flat = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(state)):
        key = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        if "/layers/" in key:
            flat |= {key.replace("/layers/", f"/layer_{i}/"): np.asarray(part) for i, part in enumerate(leaf)}
        else:
            flat[key] = np.asarray(leaf)
    return flat


def _restore_latest(config, run_dir) -> tuple[int, dict]:
    run = run_lib.build(config, str(run_dir), batches=False)
    try:
        step, state, data_state = run.checkpointer.restore_latest(run.abstract_state)
    finally:
        run.close()
    assert data_state == {"step": step}
    return step, _per_layer(state.replace(frozen={}))


def _assert_same(actual: dict, expected: dict, **tolerance) -> None:
    assert actual.keys() == expected.keys() and any("/layer_1/" in key for key in expected)
    for key in expected:
        np.testing.assert_allclose(actual[key], expected[key], err_msg=key, **tolerance)


def test_a_checkpoint_restores_into_the_other_layout_as_saved(trained):
    scan, run_dir = trained
    saved_step, saved = _restore_latest(_config(scan), run_dir)
    step, relaid = _restore_latest(_config(not scan), run_dir)
    assert step == saved_step == 2
    assert any(key.startswith("opt_state/") and "/mu/" in key and "/layer_1/" in key for key in saved)
    _assert_same(relaid, saved, rtol=0, atol=0)


def test_a_run_resumes_in_the_other_layout_and_trains_as_it_would_in_its_own(trained, tmp_path, capsys):
    scan, run_dir = trained
    finals = {}
    for resumed_scan in (scan, not scan):
        workdir = tmp_path / f"scan_{resumed_scan}"
        shutil.copytree(run_dir, workdir)
        loop.train_and_evaluate(_config(resumed_scan, steps=3), str(workdir))
        assert f"resumed from {workdir / 'checkpoints' / '2'}" in capsys.readouterr().out
        assert json.loads((workdir / "config.json").read_text())["model"]["scan_layers"] is resumed_scan
        finals[resumed_scan] = _restore_latest(_config(resumed_scan, steps=3), workdir)
    assert finals[scan][0] == finals[not scan][0] == 3
    _assert_same(finals[not scan][1], finals[scan][1], rtol=1e-5, atol=1e-7)  # a scan sums as a loop does, nearly


def test_init_from_reads_a_checkpoint_of_the_other_layout(trained):
    scan, run_dir = trained
    config = _config(not scan)
    model = models.build_model(config.model_name, config.model.to_dict())
    fresh = jax.tree.map(np.asarray, nn.unbox(model.init(jax.random.key(1), np.zeros((1, 8), np.int32))["params"]))
    merged = weights.merge_pretrained(fresh, f"ckpt:{run_dir}", config.model_name, config.model.to_dict())
    saved = _restore_latest(_config(scan), run_dir)[1]
    expected = {key.removeprefix("params/"): value for key, value in saved.items() if key.startswith("params/")}
    _assert_same(_per_layer(merged), expected, rtol=0, atol=0)
