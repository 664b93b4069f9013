"""`convert_pretrained`: the HF checkpoint's config is checked against the target's, and what was loaded,
dropped and newly initialised is reported. Checkpoints are written by lmzoo's own exporters (no torch)."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from lmzoo.convert import bert, gpt2, hf, mapping, safetensors_reader
from lmzoo.models import build_model, make_config

GPT2 = dict(vocab_size=32, max_len=8, emb_dim=16, num_heads=2, num_layers=1, mlp_dim=32)
BERT = dict(vocab_size=32, max_len=8, emb_dim=16, num_heads=2, num_layers=2, mlp_dim=32, sentence_head=False)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 8)), jnp.int32)


def init_params(model_name: str, cfg, method: str | None = None):
    module = build_model(model_name, cfg)
    return nn.unbox(module.init(jax.random.key(1), TOKENS, method=method)["params"])


def save_gpt2(folder, **fields):
    """An HF GPT-2 checkpoint folder of a random lmzoo "gpt2" model with GPT2 | fields."""
    cfg = make_config("gpt2", GPT2 | fields)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(gpt2.config_to_hf(cfg)))
    save_file(gpt2.to_hf(init_params("gpt2", cfg), cfg), folder / "model.safetensors")
    return f"hf:{folder}"


def save_bert(folder, **fields):
    """An HF BertForMaskedLM / BertModel-with-pooler checkpoint folder of a random lmzoo "bert" model."""
    cfg = make_config("bert", BERT | fields)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(bert.config_to_hf(cfg, model_type="bert")))
    save_file(bert.to_hf(init_params("bert", cfg), cfg, model_type="bert"), folder / "model.safetensors")
    return f"hf:{folder}"


@pytest.mark.parametrize(
    ("checkpoint", "difference"),
    [
        (dict(num_layers=3), "num_layers: checkpoint 3, model 1"),
        (dict(activation="relu"), "activation: checkpoint 'relu', model 'gelu_tanh'"),
        (dict(layer_norm_epsilon=0.1), "layer_norm_epsilon: checkpoint 0.1, model 1e-05"),
    ],
)
def test_gpt2_config_difference_is_an_error(tmp_path, checkpoint, difference):
    spec = save_gpt2(tmp_path / "ckpt", **checkpoint)
    cfg = make_config("gpt2", GPT2)
    [(field, value)] = checkpoint.items()
    with pytest.raises(
        ValueError,
        match=rf"(?s){difference}.*fix: set config.model {field}={value!r}\nor .*--config.init_from_partial=True",
    ):
        hf.convert_pretrained(spec, "gpt2", cfg, init_params("gpt2", cfg))


def test_every_differing_field_is_listed(tmp_path):
    spec = save_gpt2(tmp_path / "ckpt", num_layers=3, activation="relu", layer_norm_epsilon=0.1, tie_embeddings=False)
    cfg = make_config("gpt2", GPT2)
    with pytest.raises(ValueError) as error:
        hf.convert_pretrained(spec, "gpt2", cfg, init_params("gpt2", cfg))
    differences = [line.split(":")[0].strip() for line in str(error.value).splitlines() if ": checkpoint " in line]
    assert differences == ["num_layers", "tie_embeddings", "activation", "layer_norm_epsilon"]


def test_partial_load_reports_dropped_layers(tmp_path, capsys):
    spec = save_gpt2(tmp_path / "ckpt", num_layers=3)
    _, source = safetensors_reader.read_safetensors_dir(spec.removeprefix("hf:"))
    cfg = make_config("gpt2", GPT2)
    target = init_params("gpt2", cfg)
    params, report = hf.convert_pretrained(spec, "gpt2", cfg, target, allow_partial=True)
    assert report.config_differences == ("num_layers: checkpoint 3, model 1",)
    assert report.initialised == ()
    assert len(report.loaded) == len(jax.tree.leaves(target)) == 20
    assert {path.split("/")[1] for path in report.dropped} == {"layer_1", "layer_2"} and len(report.dropped) == 32
    np.testing.assert_array_equal(
        params["blocks"]["layer_0"]["mlp"]["wo"]["kernel"], source["transformer.h.0.mlp.c_proj.weight"]
    )
    printed = capsys.readouterr().out
    assert (
        "loaded 20 parameters" in printed
        and "dropped from the checkpoint: blocks/layer_1/* (16), blocks/layer_2/* (16);" in printed
    )


def test_partial_load_reports_newly_initialised(tmp_path):
    """Tied checkpoint into an untied, scanned 2-layer model: lm_head and the misshapen stacked layers are new."""
    spec = save_gpt2(tmp_path / "ckpt")
    cfg = make_config("gpt2", GPT2 | dict(num_layers=2, tie_embeddings=False, scan_layers=True))
    target = init_params("gpt2", cfg)
    params, report = hf.convert_pretrained(spec, "gpt2", cfg, target, allow_partial=True)
    assert "lm_head/kernel" in report.initialised and "blocks/layers/attn/query/kernel" in report.initialised
    assert "blocks/layers/attn/query/kernel" in report.dropped  # the checkpoint's [1, ...] stack does not fit [2, ...]
    assert (
        sorted(report.loaded)
        == sorted(mapping.flatten(params))
        == ["ln_final/bias", "ln_final/scale", "wpe/embedding", "wte/embedding"]
    )
    assert len(report.loaded) + len(report.initialised) == len(jax.tree.leaves(target))


def test_matching_checkpoint_loads_everything(tmp_path):
    spec = save_gpt2(tmp_path / "ckpt", dropout_rate=0.3)  # regularisation is not compared
    cfg = make_config("gpt2", GPT2 | dict(scan_layers=True, param_dtype="bfloat16"))
    params, report = hf.convert_pretrained(spec, "gpt2", cfg, init_params("gpt2", cfg))
    assert not report.dropped and not report.initialised and not report.config_differences
    assert params["blocks"]["layers"]["attn"]["query"]["kernel"].dtype == jnp.bfloat16


def test_bert_config_difference_is_an_error(tmp_path):
    spec = save_bert(tmp_path / "ckpt", activation="relu", layer_norm_epsilon=1e-5)
    cfg = make_config("bert", BERT)
    with pytest.raises(
        ValueError, match=r"(?s)activation: checkpoint 'relu', model 'gelu'.*layer_norm_epsilon: checkpoint 1e-05"
    ):
        hf.convert_pretrained(spec, "bert", cfg, init_params("bert", cfg))


def test_bert_heads_dropped_freely_but_not_initialised(tmp_path):
    """A classifier backbone (encode only) drops the MLM head; a pooler the checkpoint lacks is an error."""
    spec = save_bert(tmp_path / "ckpt", pooler=False)
    cfg = make_config("bert", BERT | dict(pooler=False))
    _, report = hf.convert_pretrained(spec, "bert", cfg, init_params("bert", cfg, method="encode"))
    assert set(report.dropped) == {"mlm_dense/kernel", "mlm_dense/bias", "mlm_norm/scale", "mlm_norm/bias"}

    with_pooler = make_config("bert", BERT)
    target = init_params("bert", with_pooler, method="encode")
    with pytest.raises(ValueError, match=r"pooler/kernel: not in the checkpoint \(model expects \(16, 16\)\)"):
        hf.convert_pretrained(spec, "bert", with_pooler, target)
    params, report = hf.convert_pretrained(spec, "bert", with_pooler, target, allow_partial=True)
    assert report.initialised == ("pooler/bias", "pooler/kernel") and "pooler" not in params
