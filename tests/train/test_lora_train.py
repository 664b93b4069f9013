"""LoRA through the loop (config.lora): adapters over a frozen init_from base, with gradient accumulation and several
steps per call, resume exactly; checkpoints hold the adapters alone and `lmzoo.load` gives the merged model."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import lmzoo
from lmzoo import lora, testing, weights
from lmzoo.convert import export
from lmzoo.models import build_model
from lmzoo.train import loop
from lmzoo.train import run as run_lib


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """An HF GPT-2 folder of the tiny config's shapes, random weights: the base the adapters train over."""
    config = testing.tiny_config()
    model = build_model(config.model_name, config.model.to_dict())
    params = jax.device_get(model.init(jax.random.key(7), jnp.zeros((1, 8), jnp.int32))["params"])
    folder = tmp_path_factory.mktemp("base")
    export.export_hf(config.model_name, config.model.to_dict(), jax.tree.map(np.asarray, nn.unbox(params)), str(folder))
    return folder


def lora_config(base_folder, **train):
    config = testing.tiny_config(grad_accum_steps=2, steps_per_call=2, **train)
    config.init_from = f"hf:{base_folder}"
    config.lora.targets, config.lora.rank, config.lora.alpha = "query|value|wo", 2, 4.0
    return config


def restored(workdir):
    run = run_lib.build(run_lib.load_saved(workdir), workdir)
    step, state, data_state = run.checkpointer.restore_latest(run.abstract_state)
    run.close()
    return step, jax.device_get(state)


def test_lora_trains_with_dropout_resumes_exactly_and_loads_merged(tmp_path, base_folder):
    """Adapters trained with input dropout 0.5: an exact resume; the first logged loss is the dropout-free run's (B
    starts at zero, so the dropped branch adds nothing) while the trained B is not; the merged model loads."""

    def dropped(**train):
        config = lora_config(base_folder, **train)
        config.lora.dropout = 0.5
        return config

    loop.train_and_evaluate(dropped(), str(tmp_path / "straight"))
    loop.train_and_evaluate(dropped(steps=2), str(tmp_path / "resumed"))
    loop.train_and_evaluate(dropped(), str(tmp_path / "resumed"))
    loop.train_and_evaluate(lora_config(base_folder), str(tmp_path / "no_dropout"))
    (step_a, a), (step_b, b) = restored(str(tmp_path / "straight")), restored(str(tmp_path / "resumed"))
    assert step_a == step_b == 4
    with_dropout, without = _train_losses(tmp_path / "straight"), _train_losses(tmp_path / "no_dropout")
    np.testing.assert_allclose(with_dropout[0], without[0], rtol=1e-6)
    b_with, b_without = (
        np.concatenate(
            [np.ravel(leaf) for path, leaf in traverse_util.flatten_dict(params).items() if path[-1] == "lora_b"]
        )
        for params in (a.params, restored(str(tmp_path / "no_dropout"))[1].params)
    )
    assert np.abs(b_with - b_without).max() > 0.1 * np.abs(b_without).max()  # B's gradient saw the dropped inputs
    jax.tree.map(np.testing.assert_array_equal, a, b)
    names = {path[-1] for path in traverse_util.flatten_dict(a.params)}
    assert names == {"lora_a", "lora_b"}  # the checkpoint holds the adapters, not the base
    assert any(
        np.abs(leaf).max() > 0 for path, leaf in traverse_util.flatten_dict(a.params).items() if path[-1] == "lora_b"
    )

    loaded = lmzoo.load(str(tmp_path / "straight"))
    base = run_lib.load_saved(str(tmp_path / "straight"))
    assert "kernel" in loaded.params["blocks"]["layer_0"]["attn"]["query"]
    expected = lora.merge(_base_params(base), a.params, lora.LoraConfig("query|value|wo", rank=2, alpha=4.0))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), loaded.params, jax.device_get(expected))


def _base_params(config):
    model = build_model(config.model_name, config.model.to_dict())
    fresh = jax.device_get(nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]))
    return weights.merge_pretrained(fresh, config.init_from, config.model_name, config.model.to_dict())


def test_lora_needs_a_base(tmp_path):
    config = testing.tiny_config()
    config.lora.targets = "query"
    with pytest.raises(ValueError, match="adapts a frozen base"):
        loop.train_and_evaluate(config, str(tmp_path))
    config.lora.targets, config.init_from, config.lora.dropout = "query", "hf:/nowhere", 1.0
    with pytest.raises(ValueError, match=r"dropout=1.0 must be in \[0, 1\)"):
        loop.train_and_evaluate(config, str(tmp_path))


def test_a_llama_lora_run_exports_its_adapters_in_peft_format(tmp_path):
    import pathlib

    from lmzoo import config as config_lib
    from lmzoo.cli import export as export_cli
    from lmzoo.lora import peft

    config = config_lib.load_config_file(pathlib.Path(__file__).resolve().parents[2] / "configs" / "llama.py", "tiny")
    model = build_model("llama", config.model.to_dict())
    fresh = jax.device_get(nn.unbox(model.init(jax.random.key(5), jnp.zeros((1, 8), jnp.int32))["params"]))
    export.export_hf("llama", config.model.to_dict(), jax.tree.map(np.asarray, fresh), str(tmp_path / "base"))
    config.init_from = f"hf:{tmp_path / 'base'}"
    config.lora.targets, config.lora.rank, config.lora.alpha = "query|value|wi_0", 2, 4.0
    config.train.update(steps=2, checkpoint_every=2)
    loop.train_and_evaluate(config, str(tmp_path / "run"))

    summary = export_cli.export_adapters(str(tmp_path / "run"), str(tmp_path / "adapter"))
    assert summary["step"] == 2 and summary["tensors"] == 2 * 3 * config.model.num_layers
    base = weights.merge_pretrained(fresh, config.init_from, "llama", config.model.to_dict())
    adapters, adapted = peft.load_peft(str(tmp_path / "adapter"), base, "llama", config.model.to_dict())
    merged = jax.device_get(lora.merge(base, adapters, adapted))
    loaded = lmzoo.load(str(tmp_path / "run"))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), loaded.params, merged)
    with pytest.raises(FileExistsError, match="is not empty"):
        export_cli.export_adapters(str(tmp_path / "run"), str(tmp_path / "adapter"))
    # ckpt: of a LoRA run (init_from of the next stage, DPO's sft) is the merged model, not the adapters
    from_ckpt = weights.read_params(f"ckpt:{tmp_path / 'run'}", "llama", config.model.to_dict(), fresh)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), jax.device_get(from_ckpt), merged)


def test_lora_refuses_a_base_that_leaves_parameters_fresh(tmp_path, base_folder):
    config = lora_config(base_folder)
    config.model.num_layers, config.init_from_partial = 2, True  # the base has 1 layer: layer_1 would stay random
    with pytest.raises(ValueError, match=r"leaves parameters that would stay as initialised \(blocks/layer_1/"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))


def _train_losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row.get("split") == "train"]


def test_a_scanned_stack_trains_the_same_adapters_and_resumes_exactly(tmp_path, base_folder):
    """LoRA's training form on scanned, rematerialised layers (each layer's projections apply its adapters inside the
    scan) through the loop: the losses of the per-layer stack's run, an exact resume, and `lmzoo.load` gives the
    merged model."""

    def scanned(**train):
        config = lora_config(base_folder, **train)
        config.model.scan_layers, config.model.remat_policy = True, "full"
        return config

    loop.train_and_evaluate(lora_config(base_folder), str(tmp_path / "per_layer"))
    loop.train_and_evaluate(scanned(), str(tmp_path / "straight"))
    loop.train_and_evaluate(scanned(steps=2), str(tmp_path / "resumed"))
    loop.train_and_evaluate(scanned(), str(tmp_path / "resumed"))
    np.testing.assert_allclose(_train_losses(tmp_path / "straight"), _train_losses(tmp_path / "per_layer"), rtol=1e-5)
    (_, a), (_, b) = restored(str(tmp_path / "straight")), restored(str(tmp_path / "resumed"))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    query = a.params["blocks"]["layers"]["attn"]["query"]
    assert query["lora_a"].shape[0] == 1  # stacked on the layers axis
    assert np.abs(query["lora_b"]).max() > 0  # B (zero at the start) trained: the scan ran on the adapters

    loaded = lmzoo.load(str(tmp_path / "straight"))
    base = run_lib.load_saved(str(tmp_path / "straight"))
    expected = lora.merge(_base_params(base), a.params, lora.LoraConfig("query|value|wo", rank=2, alpha=4.0))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), loaded.params, jax.device_get(expected))
