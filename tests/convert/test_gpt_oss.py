"""Parity of lmzoo's llama family as gpt-oss (attention sinks, q/k/v/o biases, sliding and full layers rotating with
YaRN, a biased router, biased experts with a clamped SwiGLU) with HF GptOssForCausalLM through `lmzoo.convert.llama`,
`lmzoo.convert.gpt_oss`, `lmzoo.convert.hf` and `lmzoo.convert.export`, on random models of unusual shapes (6 query
heads of 8 on hidden 24, kv groups of 3 and 6, 5 experts of F 30, vocabulary 61, a window of 4 shorter than the
sequence, a SwiGLU limit the activations reach, left padding, tied and untied); the KV cache against the full forward;
MXFP4 against transformers' dequantization and a packed folder read to the same logits; the released shape."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_llama_hf as dense  # the padded batch, logits, differences and greedy decoding of the dense parity tests
import test_streamed_loading as streamed  # loading the way an accelerator's blocks are built
from safetensors.numpy import load_file, save_file

from lmzoo import config as config_lib
from lmzoo import decoding
from lmzoo.convert import export, hf, llama, mapping, quantized, safetensors_reader, tables
from lmzoo.models import build_model, make_config

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

TOL, VOCAB = dense.TOL, dense.VOCAB
CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
    "rope_theta": 1000.0,
}
# 6 query heads of 8 on hidden 24 in 2 kv heads, 5 experts of F 30 top-2, a window of 4, sliding then full; the
# SwiGLU limit 0.5 is within the random activations' range, so both clamps act.
SHAPE = {k: v for k, v in dense.SHAPE.items() if k not in ("rms_norm_eps", "max_position_embeddings")} | dict(
    num_key_value_heads=2,
    intermediate_size=30,
    num_local_experts=5,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    sliding_window=4,
    swiglu_limit=0.5,
    rope_parameters=YARN,
)
CASES = {
    "oss_yarn_kv2": {},
    # every layer full, no attention biases, plain rope, top-3, one kv head, the head tied to the embeddings
    "oss_full_nobias_top3_kv1_tied": dict(
        layer_types=["full_attention"] * 2,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        num_experts_per_tok=3,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
}
# The config.json of openai/gpt-oss-20b on the Hub (the keys lmzoo reads).
HUB_20B = dict(
    model_type="gpt_oss",
    architectures=["GptOssForCausalLM"],
    attention_bias=True,
    attention_dropout=0.0,
    head_dim=64,
    hidden_act="silu",
    hidden_size=2880,
    initializer_range=0.02,
    intermediate_size=2880,
    layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072,
    num_attention_heads=64,
    num_experts_per_tok=4,
    num_hidden_layers=24,
    num_key_value_heads=8,
    num_local_experts=32,
    quantization_config={"quant_method": "mxfp4"},
    rms_norm_eps=1e-05,
    rope_scaling={
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    rope_theta=150000,
    router_aux_loss_coef=0.9,
    sliding_window=128,
    swiglu_limit=7.0,
    tie_word_embeddings=False,
    vocab_size=201088,
)


def hf_config(case: str):
    return transformers.GptOssConfig(**SHAPE | CASES[case])


def random_hf_model(case: str, seed: int = 0):
    """A float32 GptOssForCausalLM in eval mode with every weight random: the RMSNorm scales, the sinks (wide, so they
    take a good share of each softmax), the router (wide, so the top-k is rarely a near tie), biases and experts."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM._from_config(
        hf_config(case), attn_implementation="eager", experts_implementation="eager"
    )
    model = model.float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("sinks") or name.endswith("router.weight"):
                param.normal_(0.0, 0.5 if "router" in name else 1.0)
            else:
                param.normal_(0.0, 0.15)
    return model


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_logits_generation_and_export_match_hf(tmp_path, case):
    """hf:FOLDER (sharded and read into scanned layers for the tied case) -> the same logits as HF's on left-padded
    rows, the same tensors back (gate_up_proj interleaved again), the same greedy tokens as HF's generate, and an
    export HF loads with those logits."""
    model = random_hf_model(case)
    scanned = case == "oss_full_nobias_top3_kv1_tied"
    model.save_pretrained(tmp_path / "hf", safe_serialization=True, **({"max_shard_size": "20KB"} if scanned else {}))
    config_json, state_dict = safetensors_reader.read_safetensors_dir(tmp_path / "hf")
    cfg = make_config("llama", llama.config_from_hf(config_json) | {"scan_layers": scanned})
    assert cfg.attention_sinks and llama.hf_model_type(cfg) == "gpt_oss"
    params, report = hf.convert_pretrained(f"hf:{tmp_path / 'hf'}", "llama", cfg, dense.target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    mlp = params["blocks"]["layers" if scanned else "layer_1"]["mlp"]
    assert mlp["wi_0"].shape[-3:] == (5, 24, 30) and mlp["wo_bias"].shape[-2:] == (5, 24)
    tokens, mask, positions = dense.padded_batch()
    ref = dense.hf_logits(model, tokens, mask, positions)
    diff = dense.max_diff(dense.lmzoo_logits(cfg, params, tokens, mask, positions), ref, mask)
    print(f"{case}: max |lmzoo - HF| logits {diff:.2e} (logit std {ref.std():.2f})")
    assert diff <= TOL, f"max |lmzoo - HF| logits = {diff:.3e} ({case}, logit std {ref.std():.2f})"

    back = llama.to_hf(params, cfg)
    if cfg.tie_embeddings:  # save_pretrained leaves the tied copy out
        np.testing.assert_array_equal(back.pop("lm_head.weight"), back["model.embed_tokens.weight"])
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], np.asarray(value), err_msg=key)

    dense.assert_greedy_tokens_equal(model, cfg, params, tokens, mask, 6, case)

    summary = export.export_hf("llama", cfg, params, str(tmp_path / "export"))
    assert (summary["model_type"], summary["architecture"]) == ("gpt_oss", "GptOssForCausalLM")
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), attn_implementation="eager", experts_implementation="eager"
    ).eval()
    assert type(exported) is type(model)
    diff = dense.max_diff(dense.hf_logits(exported, tokens, mask, positions), ref, mask)
    print(f"{case}: exported, max |from_pretrained - HF| logits {diff:.2e}")
    assert diff <= TOL, f"exported {case}: max |from_pretrained - HF| logits = {diff:.3e}"


@pytest.mark.parametrize("scan_layers", [False, True], ids=["looped", "scanned"])
def test_kv_cache_decoding_equals_the_full_forward(scan_layers):
    """With sinks in every softmax: a 4-token chunk, then one token at a time to position 10 (past the window of 4):
    the cached logits equal the full forward pass's; greedy `generate` picks the full forward's argmax each step."""
    model = random_hf_model("oss_yarn_kv2", seed=1)
    cfg = make_config("llama", llama.config_from_hf(model.config.to_dict()) | {"scan_layers": scan_layers})
    params = llama.from_hf(dense.numpy_state_dict(model), cfg)
    if scan_layers:
        layers = [params["blocks"].pop(f"layer_{i}") for i in range(cfg.num_layers)]
        params["blocks"] = {"layers": jax.tree.map(lambda *xs: np.stack(xs), *layers)}
    lm = build_model("llama", cfg)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 10))
    full = jax.jit(lm.apply)({"params": params}, tokens)
    cache = jax.jit(lambda: lm.init(jax.random.key(0), jnp.zeros((2, 10), jnp.int32), decode=True)["cache"])()
    step = jax.jit(
        lambda cache, chunk, positions: lm.apply(
            {"params": params, "cache": cache}, chunk, positions=positions, decode=True, mutable=["cache"]
        )
    )
    out, variables = step(cache, tokens[:, :4], np.broadcast_to(np.arange(4), (2, 4)))
    pieces = [out]
    for t in range(4, 10):
        out, variables = step(variables["cache"], tokens[:, t : t + 1], np.full((2, 1), t))
        pieces.append(out)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5)

    prompt = tokens[:, :5]
    new = np.asarray(decoding.generate(lm, params, prompt, rng=jax.random.key(0), max_new_tokens=5, temperature=0.0))
    logits = jax.jit(lm.apply)({"params": params}, np.concatenate([prompt, new], axis=1))
    np.testing.assert_array_equal(np.argmax(logits[:, 4:-1], axis=-1), new)


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 blocks [..., G, 16] (every code) and scales [..., G] from 2 ** -7 to 2 ** -3."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (*shape, 16), dtype=np.uint8), rng.integers(120, 125, shape, dtype=np.uint8)


def test_mxfp4_dequantization_equals_transformers():
    """`quantized.Mxfp4` (the HF kernel [E, C, R] of blocks [E, R, C / 32, 16] and scales [E, R, C / 32]), whole and a
    box of it, equals transformers' `convert_moe_packed_tensors` on random blocks with every code and scales from
    2 ** -127 to 2 ** 8."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 2, 16), dtype=np.uint8)
    scales = rng.integers(0, 136, (3, 10, 2), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    leaf = quantized.Mxfp4(blocks, scales, "experts.down_proj")
    assert leaf.shape == tuple(theirs.shape) == (3, 64, 10)
    np.testing.assert_array_equal(np.asarray(leaf), theirs.numpy())
    np.testing.assert_array_equal(leaf[(slice(1, 3), slice(37, 50), slice(2, 9))], theirs.numpy()[1:3, 37:50, 2:9])
    low, high = blocks[0, 0, 0, 0] & 15, blocks[0, 0, 0, 0] >> 4  # byte 0: values 0 (low nibble) and 1
    expected = quantized.FP4_VALUES[[low, high]] * np.float32(2.0 ** (int(scales[0, 0, 0]) - 127))
    np.testing.assert_array_equal(quantized.dequantize_mxfp4(blocks, scales)[0, 0, :2], expected)
    with pytest.raises(ValueError, match=r"do not pair"):
        quantized.Mxfp4(blocks, scales[:, :, :1], "experts.down_proj")


def packed_folder(folder: pathlib.Path):
    """(the HF model, config.json dict) of a folder as openai/gpt-oss-20b's (hidden and F 32, one MXFP4 block): the
    experts' kernels as random blocks and scales, quantization_config mxfp4; the model holds transformers'
    dequantization of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(2)
    config = transformers.GptOssConfig(**SHAPE | dict(hidden_size=32, intermediate_size=32))
    model = transformers.GptOssForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.5 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)
    tensors = load_file(str(folder / "model.safetensors"))
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name, rows in (("gate_up_proj", 64), ("down_proj", 32)):
                blocks, scales = random_mxfp4((5, rows, 1), seed=10 * i + rows)
                packed = (torch.from_numpy(blocks), torch.from_numpy(scales))
                getattr(layer.mlp.experts, name).copy_(convert_moe_packed_tensors(*packed, dtype=torch.float32))
                key = f"model.layers.{i}.mlp.experts.{name}"
                del tensors[key]
                tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config_json = json.loads((folder / "config.json").read_text())
    config_json["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (folder / "config.json").write_text(json.dumps(config_json))
    return model, config_json


@pytest.mark.parity
def test_a_packed_mxfp4_folder_loads_to_the_same_logits(tmp_path):
    """The packed folder: transformers reads it (dequantizing) as the model it was made from, and lmzoo's load of it
    through `init_from` (its config.json replacing configs/gpt_oss.py:tiny's model, scanned layers kept) gives the
    same logits; the export is dense and HF reads it to the same logits."""
    model, config_json = packed_folder(tmp_path)
    # transformers reads the folder as the model it was made from (its MXFP4 dequantized on the CPU)
    packed = transformers.GptOssForCausalLM.from_pretrained(
        str(tmp_path),
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    theirs = dict(packed.named_parameters())
    for name, param in model.named_parameters():
        np.testing.assert_array_equal(theirs[name].detach().float().numpy(), param.detach().numpy(), err_msg=name)

    # from_pretrained: configs/gpt_oss.py:tiny's model (D 128, 8 experts, scanned) is a default the folder replaces
    config = config_lib.load_config_file(CONFIGS / "gpt_oss.py", "tiny")
    with config.unlocked():
        config.init_from = f"hf:{tmp_path}"
    changes = config_lib.take_pretrained_fields(config)
    assert changes["emb_dim"] == (128, 32) and changes["num_experts"] == (8, 5) and "attention_sinks" not in changes
    cfg = make_config("llama", config.model.to_dict())
    assert cfg.scan_layers and cfg.swiglu_limit == 0.5 and cfg.rope_original_max_len == 16
    params, report = hf.convert_pretrained(config.init_from, "llama", cfg, dense.target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    tokens, mask, positions = dense.padded_batch()
    ref = dense.hf_logits(model, tokens, mask, positions)
    ours = dense.lmzoo_logits(cfg, params, tokens, mask, positions)
    diff = dense.max_diff(ours, ref, mask)
    print(f"mxfp4 folder: max |lmzoo - HF| logits {diff:.2e} (logit std {ref.std():.2f})")
    assert diff <= TOL, f"mxfp4 folder: max |lmzoo - HF| logits = {diff:.3e}"
    export.export_hf("llama", cfg, params, str(tmp_path / "export"))
    assert "quantization_config" not in json.loads((tmp_path / "export" / "config.json").read_text())
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), attn_implementation="eager", experts_implementation="eager"
    ).eval()
    diff = dense.max_diff(dense.hf_logits(exported, tokens, mask, positions), ref, mask)
    assert diff <= TOL, f"mxfp4 folder exported dense: max |from_pretrained - HF| logits = {diff:.3e}"


def test_experts_assembled_on_the_device_equal_the_host_load(tmp_path, monkeypatch):
    """An accelerator's way (`mapping._place_in_pieces`, taken here on the CPU device, in 100-byte pieces) through the
    interleaved halves of gate_up_proj (dense, bf16) and through MXFP4 blocks: the same parameters as the host load,
    bit for bit, into scanned layers."""
    dense_model = random_hf_model("oss_yarn_kv2", seed=3).to(torch.bfloat16)
    dense_model.save_pretrained(tmp_path / "dense", safe_serialization=True)
    packed_folder(tmp_path / "packed")
    for folder in ("dense", "packed"):
        config_json, _ = safetensors_reader.read_safetensors_dir(tmp_path / folder)
        cfg = make_config("llama", llama.config_from_hf(config_json) | {"scan_layers": True})
        shapes = dense.target_params(cfg)
        host, _ = hf.convert_pretrained(f"hf:{tmp_path / folder}", "llama", cfg, shapes)
        loaded, inserts = streamed.load_as_an_accelerator(monkeypatch, f"hf:{tmp_path / folder}", "llama", cfg, shapes)
        flat_host = mapping.flatten(host)
        for path, leaf in mapping.flatten(loaded).items():
            np.testing.assert_array_equal(np.asarray(leaf), flat_host[path], err_msg=f"{folder}: {path}")
        experts = loaded["blocks"]["layers"]["mlp"]["wi_1"].shape  # [layers, experts, D, F]
        assert any(block.shape == experts for block, _, _ in inserts), folder


def test_config_fields_and_round_trip():
    fields = {case: llama.config_from_hf(hf_config(case).to_dict()) for case in CASES}
    oss = fields["oss_yarn_kv2"]
    assert oss["attention_sinks"] and oss["qkv_bias"] and oss["out_bias"] and oss["router_bias"] and oss["expert_bias"]
    assert oss["layer_types"] == ("sliding_attention", "full_attention") and oss["sliding_window"] == 4
    assert (oss["rope_scaling_type"], oss["rope_scaling_factor"], oss["rope_original_max_len"]) == ("yarn", 4.0, 16)
    assert not oss["rope_truncate"] and oss["rope_theta"] == 1000.0 and oss["sliding_rope_theta"] == 0.0
    assert (oss["num_experts"], oss["experts_per_token"], oss["mlp_dim"], oss["expert_mlp_dim"]) == (5, 2, 30, 0)
    assert oss["renormalize_expert_weights"] and (oss["swiglu_limit"], oss["swiglu_alpha"]) == (0.5, 1.702)
    plain = fields["oss_full_nobias_top3_kv1_tied"]
    assert plain["layer_types"] == () and plain["sliding_window"] == 0 and plain["rope_scaling_factor"] == 0.0
    assert not plain["qkv_bias"] and not plain["out_bias"] and plain["tie_embeddings"]
    for case, case_fields in fields.items():
        cfg = make_config("llama", case_fields)
        assert llama.hf_model_type(cfg) == "gpt_oss", case
        assert llama.config_from_hf(llama.config_to_hf(cfg)) == case_fields, case
    # GptOssConfig's defaults where config.json leaves keys out: YaRN x32 of 4,096, sliding and full in turn.
    bare = {"model_type": "gpt_oss", **{k: v for k, v in SHAPE.items() if v is not None and k != "rope_parameters"}}
    bare = {k: v for k, v in bare.items() if k not in ("sliding_window", "swiglu_limit")}
    defaults = llama.config_from_hf(bare)
    assert (defaults["rope_scaling_factor"], defaults["rope_original_max_len"], defaults["rope_theta"]) == (
        32.0,
        4096,
        150_000.0,
    )
    assert defaults["sliding_window"] == 128 and defaults["swiglu_limit"] == 7.0 and defaults["norm_epsilon"] == 1e-5


def test_yarn_rotation_is_hf_s():
    """The YaRN frequencies and table scale of the llama's rotation (`embeddings.Rotary.yarn`) are HF's rope init's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for truncate in (False, True):
        config = hf_config("oss_yarn_kv2")
        config.rope_parameters = YARN | {"truncate": truncate}
        inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        rotary = make_config("llama", llama.config_from_hf(config.to_dict())).rotary()
        np.testing.assert_allclose(rotary.inverse_frequencies(8), inv_freq.numpy(), rtol=1e-6)
        assert rotary.yarn.table_scale == pytest.approx(scale)


def test_unsupported_configs_are_refused_naming_the_field():
    base = {"model_type": "gpt_oss", **{k: v for k, v in SHAPE.items() if v is not None}}
    refused = {
        r"quant_method='bitsandbytes'": base | {"quantization_config": {"quant_method": "bitsandbytes"}},
        r"layer_types 'chunked_attention'": base | {"layer_types": ["chunked_attention", "full_attention"]},
        r"rope_type 'llama3'": base | {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
        r"rope_parameters.mscale=1.0": base | {"rope_parameters": YARN | {"mscale": 1.0}},
        r"swiglu_limit=0.0": base | {"swiglu_limit": 0.0},
        r"lacks \['num_experts_per_tok'\]": {k: v for k, v in base.items() if k != "num_experts_per_tok"},
    }
    for message, config in refused.items():
        with pytest.raises(tables.ConfigError, match=message):
            llama.config_from_hf(config)
    fields = llama.config_from_hf(base)
    # lmzoo models with some of gpt-oss's fields but not all have no HF class: refused on export, naming them.
    for extra, named in (
        ({"router_bias": False}, r"router_bias=True"),
        ({"out_bias": False}, r"out_bias=True"),
        ({"num_experts": 0}, r"num_experts > 0"),
        ({"qk_norm": True}, r"qk_norm=False"),
    ):
        with pytest.raises(ValueError, match=rf"no HF counterpart but GptOssForCausalLM.*{named}"):
            export.hf_model_type("llama", make_config("llama", fields | extra))
    dense_fields = {k: v for k, v in fields.items() if k not in ("num_experts",)} | {"num_experts": 0}
    with pytest.raises(ValueError, match=r"attention_sinks"):
        llama.hf_model_type(make_config("llama", dense_fields | {"attention_sinks": False, "out_bias": True}))


@pytest.mark.parametrize("variant", ["gpt_oss_20b", "gpt_oss_120b"])
def test_released_shapes(variant):
    """configs/gpt_oss.py's released variants: gpt-oss-20b is what `init_from=hf:openai/gpt-oss-20b` reads (no field
    differs), with the parameter counts of the docstring (OpenAI's 21B / 3.6B active and 117B / 5.1B)."""
    config = config_lib.load_config_file(CONFIGS / "gpt_oss.py", variant)
    cfg = make_config("llama", config.model.to_dict())
    assert llama.hf_model_type(cfg) == "gpt_oss"
    if variant == "gpt_oss_20b":
        assert hf.differing_fields(llama.config_from_hf(HUB_20B), cfg) == []
    shapes = dense.target_params(cfg)
    total = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
    layer = shapes["blocks"]["layers"]["mlp"]
    experts = sum(int(np.prod(leaf.shape)) for name, leaf in layer.items() if name != "router")
    active = total - experts * (cfg.num_experts - cfg.experts_per_token) // cfg.num_experts
    assert (total, active) == {
        "gpt_oss_20b": (20_914_757_184, 4_187_440_704),
        "gpt_oss_120b": (116_829_156_672, 5_711_982_912),
    }[variant]


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_attention_sinks_join_each_softmax_on_every_platform(platform):
    """`layers.attention.dot_product_attention` with sinks [N] equals softmax over [logits, sink] with the sink's
    column dropped (grouped heads, a padding mask, the causal flag) in the form each platform's seam picks for it
    (the explicit one: the fused kernels have no sink); sinks far below every logit are plain attention."""
    from lmzoo import kernels
    from lmzoo.layers import attention

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 5, n, 4)).astype(np.float32) for n in (6, 2, 2))
    sinks = rng.standard_normal(6).astype(np.float32)
    mask = np.ones((2, 1, 5, 5), bool)
    mask[1, ..., :2] = False
    call = dict(bias=None, is_causal=True, scale=0.5, dropout_rate=0.0, dropout_rng=None)
    with kernels.use_platform(platform):
        assert kernels.attention_form(q, k, mask=mask, bias=None, dropout=False, sinks=True) == "explicit"
        ours = attention.dot_product_attention(q, k, v, mask=mask, sinks=jnp.asarray(sinks), **call)
        plain = attention.dot_product_attention(q, k, v, mask=mask, sinks=jnp.full(6, -1e9), **call)
    keys, values = np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2)
    logits = np.einsum("BTNH,BSNH->BNTS", q, keys) * 0.5
    allowed = mask & np.tril(np.ones((5, 5), bool))
    logits = np.where(allowed, logits, -np.inf)
    joined = np.concatenate([logits, np.broadcast_to(sinks[None, :, None, None], (2, 6, 5, 1))], axis=-1)
    probs = np.exp(joined - joined.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., :-1]
    np.testing.assert_allclose(ours, np.einsum("BNTS,BSNH->BTNH", probs, values), atol=1e-6)
    without = np.asarray(attention.dot_product_attention(q, k, v, mask=mask, **call))
    seen = allowed.any(-1)[:, 0]  # [B, T]: a query with no key (row 1's first two) gives 0 beside a sink
    np.testing.assert_allclose(np.asarray(plain)[seen], without[seen], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(ours)[~seen], 0.0)


def test_the_engine_decodes_as_generate():
    """Three prompts through 2 slots, 4 steps a chunk, replies of up to 7 tokens past the window of 4, sinks in every
    softmax: every reply of the generation engine is `decoding.generate`'s, token for token."""
    from lmzoo.serving import engine
    from tests.serving.test_engine import greedy_references, prompts

    model = random_hf_model("oss_yarn_kv2", seed=4)
    cfg = make_config("llama", llama.config_from_hf(model.config.to_dict()))
    params = llama.from_hf(dense.numpy_state_dict(model), cfg)
    lm = build_model("llama", cfg)
    eng = engine.Engine(lm, params, slots=2, chunk=4, length=24)
    chosen = prompts(VOCAB, lengths=(5, 3, 9))
    requests = [engine.Request(p, max_tokens=3 + 2 * i, temperature=0.0) for i, p in enumerate(chosen)]
    tickets = eng.generate(requests)
    expected = greedy_references(lm, params, [r.prompt for r in requests], [r.max_tokens for r in requests])
    assert [t.outputs[0].tokens for t in tickets] == expected
