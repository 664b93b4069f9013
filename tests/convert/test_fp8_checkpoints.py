"""Fine-grained FP8 checkpoints (DeepSeek-V3 as released, Qwen3-*-FP8) read by dequantizing on load
(`lmzoo.convert.quantized.Fp8Blocks`): the dequantization against a hand computation on partial blocks and boxes of
the lazy leaf; tiny random DeepSeek-V3 and Qwen3-MoE folders whose linear weights this test quantizes to
float8_e4m3fn in blocks of 16 x 8 (several a weight, the last ones partial; the reader takes the size from
config.json), sharded with weights and scales in different files, read to the logits of HF's model holding this
test's own dequantization of them (torch), and an accelerator's way of loading them; the released configs; the
refusals."""

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest
import test_deepseek_v3 as deepseek_tests  # the random DeepSeek-V3 models, padded batch, logits and tolerance
import test_llama_hf as dense  # the padded batch, logits and differences of the dense parity tests
import test_qwen3_hf as qwen3_tests  # the random Qwen3 models and the released Qwen3 configs
import test_streamed_loading as streamed  # loading the way an accelerator's blocks are built

from lmzoo.convert import deepseek, hf, llama, mapping, quantized, safetensors_reader, tables
from lmzoo.models import make_config

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

BLOCK = [16, 8]  # rows, columns: not square, so a transposed block size would show
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}
# The quantization_config of deepseek-ai/DeepSeek-V3 and Qwen/Qwen3-*-FP8 on the Hub.
RELEASED_FP8 = FP8 | {"weight_block_size": [128, 128]}
E4M3_MAX = 448.0  # float8_e4m3fn's largest magnitude


def block_scales(scale_inv: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """scale_inv [r, c] repeated over each BLOCK of rows x columns, cut to `shape` [R, C]."""
    rows, columns = BLOCK
    return scale_inv.repeat_interleave(rows, 0).repeat_interleave(columns, 1)[: shape[0], : shape[1]]


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [R, C] float32 -> (float8_e4m3fn [R, C], scale_inv [ceil(R / 16), ceil(C / 8)] float32), each block
    scaled so its largest magnitude is E4M3's largest, as DeepSeek quantizes."""
    rows, columns = BLOCK
    padded = torch.nn.functional.pad(weight, (0, -weight.shape[1] % columns, 0, -weight.shape[0] % rows))
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // columns, columns)
    scale_inv = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    return (weight / block_scales(scale_inv, weight.shape)).to(torch.float8_e4m3fn), scale_inv


def fp8_folders(model, folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(an FP8 folder, its dense twin) of `model`: in the FP8 one every *_proj.weight (the routers, embeddings, norms
    and lm_head left as they are, as in the released files) is quantized beside its weight_scale_inv, written in two
    shards (each weight and its scale in different files), config.json with quantization_config; the dense one holds
    the same tensors with those weights dequantized here, weight.float() * scale_inv per block, and no
    quantization_config: the reference HF reads."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(folder / "dense", safe_serialization=True)
    config_json = json.loads((folder / "dense" / "config.json").read_text())
    tensors = load_file(str(folder / "dense" / "model.safetensors"))
    fp8 = {}
    for key, value in tensors.items():
        if key.endswith("proj.weight"):
            weight, scale_inv = quantize_fp8(value)
            fp8[key], fp8[key + "_scale_inv"] = weight, scale_inv
            tensors[key] = weight.float() * block_scales(scale_inv, weight.shape)
        else:
            fp8[key] = value
    save_file(tensors, str(folder / "dense" / "model.safetensors"), metadata={"format": "pt"})
    (folder / "fp8").mkdir()
    (folder / "fp8" / "config.json").write_text(json.dumps(config_json | {"quantization_config": FP8}))
    weight_map = {key: f"model-0000{index % 2 + 1}-of-00002.safetensors" for index, key in enumerate(sorted(fp8))}
    for shard in set(weight_map.values()):
        shard_tensors = {key: fp8[key] for key, name in weight_map.items() if name == shard}
        save_file(shard_tensors, str(folder / "fp8" / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "fp8" / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder / "fp8", folder / "dense"


def test_fp8_blocks_dequantize_each_block_times_its_scale():
    """A [300, 200] weight in blocks of 128 x 128 and 128 x 64 (the last ones partial): `dequantize_fp8_blocks` is
    each block times its scale, and every box of `Fp8Blocks`, block edges inside it or not, that box of it."""
    rng = np.random.default_rng(0)
    weight = rng.uniform(-E4M3_MAX, E4M3_MAX, (300, 200)).astype(ml_dtypes.float8_e4m3fn)
    for block in ((128, 128), (128, 64)):
        scale_inv = rng.uniform(1e-4, 1e-2, (3, -(-200 // block[1]))).astype(np.float32)
        expected = np.empty((300, 200), np.float32)
        for i in range(scale_inv.shape[0]):
            for j in range(scale_inv.shape[1]):
                rows, columns = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
                expected[rows, columns] = weight[rows, columns].astype(np.float32) * scale_inv[i, j]
        whole = quantized.dequantize_fp8_blocks(weight, scale_inv, block)
        assert whole.dtype == np.float32
        np.testing.assert_array_equal(whole, expected)
        leaf = quantized.Fp8Blocks(weight, scale_inv, block, "mlp.down_proj")
        assert leaf.shape == (300, 200) and leaf.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(leaf), expected)
        for box in ((slice(5, 299), slice(3, 131)), (slice(127, 129), slice(63, 65)), (slice(256, 300),), ()):
            np.testing.assert_array_equal(leaf[box], expected[box], err_msg=f"{block} {box}")


def test_fp8_pairs_are_read_dense_and_bad_pairs_refused_naming_the_tensor():
    weight = np.ones((300, 200), ml_dtypes.float8_e4m3fn)
    scale_inv = np.full((3, 2), 0.5, np.float32)
    state = {"mlp.up_proj.weight": weight, "mlp.up_proj.weight_scale_inv": scale_inv, "norm.weight": scale_inv}
    read = quantized.read_fp8_blocks(state, (128, 128))
    assert sorted(read) == ["mlp.up_proj.weight", "norm.weight"] and read["norm.weight"] is scale_inv
    np.testing.assert_array_equal(np.asarray(read["mlp.up_proj.weight"]), np.full((300, 200), 0.5, np.float32))
    with pytest.raises(ValueError, match=r"mlp.up_proj.weight_scale_inv without its mlp.up_proj.weight"):
        quantized.read_fp8_blocks({"mlp.up_proj.weight_scale_inv": scale_inv}, (128, 128))
    misshapen = r"mlp.up_proj.weight \(300, 200\) and mlp.up_proj.weight_scale_inv \(3, 2\) do not pair.*\(3, 4\)"
    with pytest.raises(ValueError, match=misshapen):
        quantized.read_fp8_blocks(state, (128, 64))
    with pytest.raises(ValueError, match=r"mlp.up_proj.weight has dtype float32.*expected float8_e4m3fn"):
        quantized.read_fp8_blocks(state | {"mlp.up_proj.weight": weight.astype(np.float32)}, (128, 128))


def loads_as_its_dense_twin(tests, family, model_name, cfg, reference, fp8_folder, dense_folder):
    """Reads `fp8_folder` into `cfg`'s `model_name` model (`family`: its convert module; `tests`: the family's parity
    test module, whose batch, logits and tolerance these are): all its tensors, the logits of `reference` (HF's model
    of the dense twin), and exactly the dense twin's tensors back. Returns the params."""
    params, report = hf.convert_pretrained(f"hf:{fp8_folder}", model_name, cfg, tests.target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    tokens, mask, positions = tests.padded_batch()
    ref = tests.hf_logits(reference, tokens, mask, positions)
    diff = tests.max_diff(tests.lmzoo_logits(cfg, params, tokens, mask, positions), ref, mask)
    print(f"fp8 {model_name}: max |lmzoo - HF| logits {diff:.2e} (logit std {ref.std():.2f})")
    assert diff <= tests.TOL, f"fp8 {model_name}: max |lmzoo - HF| logits = {diff:.3e}"
    _, dense_state = safetensors_reader.read_safetensors_dir(dense_folder)
    back = family.to_hf(params, cfg)
    assert sorted(back) == sorted(dense_state)
    for key, value in dense_state.items():
        np.testing.assert_array_equal(back[key], np.asarray(value), err_msg=key)
    return params


@pytest.mark.parity
def test_an_fp8_deepseek_v3_folder_loads_to_the_logits_of_its_dequantized_weights(tmp_path):
    """DeepSeek-V3 (query latent, YaRN, grouped experts) in FP8 blocks of 16 x 8, read into scanned layers: the logits
    of HF's model holding the test's dequantization of the weights, and exactly those weights back."""
    fp8_folder, dense_folder = fp8_folders(deepseek_tests.random_hf_model("v3_yarn"), tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(dense_folder), attn_implementation="eager", experts_implementation="eager"
    ).eval()
    config_json, state_dict = safetensors_reader.read_safetensors_dir(fp8_folder)
    scales = [key for key in state_dict if key.endswith("weight_scale_inv")]
    assert len(scales) > 30 and state_dict[scales[0]].dtype == np.float32
    assert state_dict[scales[0].removesuffix("_scale_inv")].dtype == ml_dtypes.float8_e4m3fn
    cfg = make_config("deepseek", deepseek.config_from_hf(config_json) | {"scan_layers": True})
    loads_as_its_dense_twin(deepseek_tests, deepseek, "deepseek", cfg, reference, fp8_folder, dense_folder)


@pytest.mark.parity
def test_an_fp8_qwen3_moe_folder_loads_to_the_logits_of_its_dequantized_weights(tmp_path, monkeypatch):
    """Qwen3-MoE in FP8 blocks of 16 x 8 (the router unquantized): the logits of HF's model holding the test's
    dequantization of the weights, exactly those weights back, and the same parameters loaded the accelerator's way
    (100-byte ranges of rows, each dequantized from its own rows and scales), bit for bit."""
    fp8_folder, dense_folder = fp8_folders(qwen3_tests.random_hf_model("qwen3_moe_kv2"), tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(dense_folder), attn_implementation="eager", experts_implementation="eager"
    ).eval()
    config_json, state_dict = safetensors_reader.read_safetensors_dir(fp8_folder)
    assert "model.layers.0.mlp.gate.weight_scale_inv" not in state_dict
    leaf = quantized.read_fp8_blocks(state_dict, BLOCK)["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(leaf, quantized.Fp8Blocks) and leaf.row_axis == 0  # read by ranges of its rows
    cfg = make_config("llama", llama.config_from_hf(config_json))
    params = loads_as_its_dense_twin(dense, llama, "llama", cfg, reference, fp8_folder, dense_folder)
    shapes = dense.target_params(cfg)

    loaded, _ = streamed.load_as_an_accelerator(monkeypatch, f"hf:{fp8_folder}", "llama", cfg, shapes)
    flat_host = mapping.flatten(params)
    for path, value in mapping.flatten(loaded).items():
        np.testing.assert_array_equal(np.asarray(value), flat_host[path], err_msg=str(path))

    # An FP8 weight whose scale is missing is not read as if it were dense.
    del state_dict["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight .*dtype float8_e4m3fn"):
        llama.checkpoint_sources(config_json, state_dict)


def test_released_fp8_configs_read_as_their_dense_copies():
    """DeepSeek-V3's and Qwen3's configs with the Hub's FP8 quantization_config give the fields of their bf16 copies."""
    released = deepseek_tests.HUB | {"quantization_config": RELEASED_FP8}
    assert deepseek.config_from_hf(released) == deepseek.config_from_hf(deepseek_tests.HUB)
    for variant, config in qwen3_tests.HUB.items():
        fp8 = config | {"quantization_config": RELEASED_FP8}
        assert llama.config_from_hf(fp8) == llama.config_from_hf(config), variant


def test_other_quantizations_are_refused_naming_the_key():
    qwen3 = {"model_type": "qwen3", **{k: v for k, v in qwen3_tests.SHAPE.items() if v is not None}}
    deepseek_v3 = {"model_type": "deepseek_v3", **{k: v for k, v in deepseek_tests.SHAPE.items() if v is not None}}
    refused = {
        r"quantization_config.quant_method='awq'; lmzoo reads qwen3 unquantized or with quant_method 'fp8'": {
            "quant_method": "awq"
        },
        r"quantization_config.fmt='e5m2'; lmzoo reads FP8 with fmt 'e4m3'": FP8 | {"fmt": "e5m2"},
        r"quantization_config.activation_scheme='static'; lmzoo reads FP8 with activation_scheme 'dynamic'": FP8
        | {"activation_scheme": "static"},
        r"quantization_config.weight_block_size=None; lmzoo reads FP8 in blocks": {"quant_method": "fp8"},
        r"quantization_config.weight_block_size=\[128\]": FP8 | {"weight_block_size": [128]},
    }
    for message, quantization in refused.items():
        with pytest.raises(tables.ConfigError, match=message):
            llama.config_from_hf(qwen3 | {"quantization_config": quantization})
        with pytest.raises(tables.ConfigError, match=message.replace("qwen3", "deepseek_v3")):
            deepseek.config_from_hf(deepseek_v3 | {"quantization_config": quantization})
    # gpt-oss is read in MXFP4 only
    gpt_oss = qwen3 | {"model_type": "gpt_oss", "num_local_experts": 5, "num_experts_per_tok": 2}
    with pytest.raises(tables.ConfigError, match=r"gpt_oss config has quantization_config.quant_method='fp8'.*'mxfp4'"):
        llama.config_from_hf(gpt_oss | {"quantization_config": FP8})
