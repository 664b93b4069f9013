"""Parity of lmzoo's llama family with experts (`layers.mlp.MoeBlock`, dropless) with HF MixtralForCausalLM and
Qwen2MoeForCausalLM through `lmzoo.convert.llama`, `lmzoo.convert.hf` and `lmzoo.convert.export`, on random models
of unusual shapes (5 experts of F 40 on hidden 24, 6 query heads of head_dim 8, 2 kv heads, vocabulary 61), and the
HF MoE configs lmzoo refuses, blamed on the folder's config.json."""

import json

import jax
import numpy as np
import pytest
import test_llama_hf as dense  # the padded batch, logits and differences of the dense parity tests
import test_streamed_loading as streamed  # loading the way an accelerator's blocks are built
from safetensors.numpy import save_file

from lmzoo.convert import export, hf, llama, mapping, safetensors_reader, tables
from lmzoo.models import make_config

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

TOL, VOCAB = dense.TOL, dense.VOCAB
# the dense parity tests' shape (6 query heads of 8 on hidden 24) with 2 kv heads; the experts' F is set per family
SHAPE = {k: v for k, v in dense.SHAPE.items() if k != "intermediate_size"} | dict(num_key_value_heads=2)
MIXTRAL = dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=40)
# intermediate_size is the dense layers' F, which an all-sparse Qwen2-MoE does not use.
QWEN2_MOE = dict(
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=40,
    shared_expert_intermediate_size=32,
    intermediate_size=56,
)
CASES = {
    "mixtral": ("mixtral", MIXTRAL),
    "mixtral_top3_window4_kv1_tied": (
        "mixtral",
        MIXTRAL | dict(num_experts_per_tok=3, sliding_window=4, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    "qwen2_moe": ("qwen2_moe", QWEN2_MOE),  # norm_topk_prob False: the top-k probabilities as they are
    "qwen2_moe_norm_topk_no_qkv_bias": ("qwen2_moe", QWEN2_MOE | dict(norm_topk_prob=True, qkv_bias=False)),
}
HF_CLASSES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe"}


def hf_config(case: str):
    model_type, overrides = CASES[case]
    return getattr(transformers, f"{HF_CLASSES[model_type]}Config")(**SHAPE | overrides)


def random_hf_model(case: str, seed: int = 0):
    """A float32 *ForCausalLM of `case` in eval mode with every weight random: RMSNorm scales, biases, the routers
    (wide, so the top-k is rarely a near tie), the experts, the shared expert and its gate."""
    torch.manual_seed(seed)
    model_type = CASES[case][0]
    model = getattr(transformers, f"{HF_CLASSES[model_type]}ForCausalLM")._from_config(
        hf_config(case), attn_implementation="eager"
    )
    model = model.float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.15)
    return model


def saved(model, folder, **kwargs):
    """(config.json dict, lazy state dict) of `model` saved as safetensors: experts one tensor each."""
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return safetensors_reader.read_safetensors_dir(folder)


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_logits_generation_and_export_match_hf(tmp_path, case):
    model = random_hf_model(case)
    config_json, state_dict = saved(model, tmp_path / "hf")
    cfg = make_config("llama", llama.config_from_hf(config_json))
    assert cfg.moe_form == "dropless" and cfg.num_experts == 5
    params = llama.from_hf(state_dict, cfg)
    assert params["blocks"]["layer_1"]["mlp"]["wi_0"].shape == (5, 24, 40)
    tokens, mask, positions = dense.padded_batch()
    ref = dense.hf_logits(model, tokens, mask, positions)
    diff = dense.max_diff(dense.lmzoo_logits(cfg, params, tokens, mask, positions), ref, mask)
    print(f"{case}: max |lmzoo - HF| logits {diff:.2e}")
    assert diff <= TOL, f"max |lmzoo - HF| logits = {diff:.3e} ({case}, logit std {ref.std():.2f})"

    back = llama.to_hf(params, cfg)
    if cfg.tie_embeddings:  # save_pretrained leaves the tied copy out
        np.testing.assert_array_equal(back.pop("lm_head.weight"), back["model.embed_tokens.weight"])
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], np.asarray(value), err_msg=key)

    dense.assert_greedy_tokens_equal(model, cfg, params, tokens, mask, 6, case)

    summary = export.export_hf("llama", cfg, params, str(tmp_path / "export"))
    assert summary["model_type"] == CASES[case][0]
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), attn_implementation="eager"
    ).eval()
    assert type(exported) is type(model)
    diff = dense.max_diff(dense.hf_logits(exported, tokens, mask, positions), ref, mask)
    print(f"{case}: exported, max |from_pretrained - HF| logits {diff:.2e}")
    assert diff <= TOL, f"exported {case}: max |from_pretrained - HF| logits = {diff:.3e}"


@pytest.mark.parity
def test_sharded_checkpoint_loads_into_scanned_layers(tmp_path):
    """hf:PATH through `hf.convert_pretrained`: a sharded Qwen2-MoE folder, streamed into scanned layers (experts
    stacked per layer, then layers), the same logits, and back to the same tensors."""
    model = random_hf_model("qwen2_moe", seed=1)
    _, state_dict = saved(model, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg = make_config("llama", llama.config_from_hf(model.config.to_dict()) | {"scan_layers": True})
    params, report = hf.convert_pretrained(f"hf:{tmp_path}", "llama", cfg, dense.target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    layers = params["blocks"]["layers"]["mlp"]
    assert layers["wi_0"].shape == (2, 5, 24, 40) and layers["wo"].shape == (2, 5, 40, 24)
    assert layers["shared_gate"]["kernel"].shape == (2, 24)
    tokens, mask, positions = dense.padded_batch()
    diff = dense.max_diff(
        dense.lmzoo_logits(cfg, params, tokens, mask, positions), dense.hf_logits(model, tokens, mask, positions), mask
    )
    print(f"qwen2_moe scanned: max |lmzoo - HF| logits {diff:.2e}")
    assert diff <= TOL, f"max |lmzoo(scan) - HF| logits = {diff:.3e}"
    back = llama.to_hf(params, cfg)
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], np.asarray(value), err_msg=key)


def test_experts_assembled_on_the_device_equal_the_host_load(tmp_path, monkeypatch):
    """An accelerator's way (`mapping._place_in_pieces`, taken here on the CPU device) with 100-byte pieces: the
    experts, stacked per layer and then per layer stack, are put on the device expert by expert in ranges of rows,
    as stored, and equal the host load bit for bit."""
    model = random_hf_model("mixtral", seed=2).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg = make_config(
        "llama", llama.config_from_hf(model.config.to_dict()) | {"scan_layers": True, "param_dtype": "float32"}
    )
    shapes = dense.target_params(cfg)
    host, _ = hf.convert_pretrained(f"hf:{tmp_path}", "llama", cfg, shapes)
    loaded, inserts = streamed.load_as_an_accelerator(monkeypatch, f"hf:{tmp_path}", "llama", cfg, shapes)
    flat_host = mapping.flatten(host)
    for path, leaf in mapping.flatten(loaded).items():
        np.testing.assert_array_equal(np.asarray(leaf), flat_host[path], err_msg=path)
    experts = loaded["blocks"]["layers"]["mlp"]["wi_0"].shape  # [layers, experts, D, F]
    assert any(block.shape == experts and relayout is not None for block, _, relayout in inserts), (
        "experts converted on the host"
    )


@pytest.mark.parity
def test_lmzoo_model_exports_to_mixtral(tmp_path):
    """An lmzoo-made MoE (scanned layers, mlp_dim 56 unused beside expert_mlp_dim 40, top-3, random weights) ->
    MixtralForCausalLM folder -> from_pretrained: its logits."""
    shape = dict(vocab_size=VOCAB, max_len=32, emb_dim=24, num_heads=6, num_kv_heads=2, head_dim=8, num_layers=2)
    experts = dict(mlp_dim=56, num_experts=5, experts_per_token=3, expert_mlp_dim=40)
    cfg = make_config("llama", shape | experts | dict(scan_layers=True, norm_epsilon=1e-5))
    rng = np.random.default_rng(2)

    def randomised(path, leaf):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return 1.0 + 0.2 * rng.standard_normal(leaf.shape, np.float32)
        return (0.5 if "router" in name else 0.15) * rng.standard_normal(leaf.shape, np.float32)

    params = jax.tree_util.tree_map_with_path(randomised, dense.target_params(cfg))
    tokens, mask, positions = dense.padded_batch()
    ours = dense.lmzoo_logits(cfg, params, tokens, mask, positions)
    summary = export.export_hf("llama", cfg, params, str(tmp_path))
    assert (summary["model_type"], summary["architecture"]) == ("mixtral", "MixtralForCausalLM")
    config_json = json.loads((tmp_path / "config.json").read_text())
    moe_keys = ("intermediate_size", "num_local_experts", "num_experts_per_tok")
    assert {key: config_json[key] for key in moe_keys} == dict(zip(moe_keys, (40, 5, 3), strict=True))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    diff = dense.max_diff(dense.hf_logits(exported, tokens, mask, positions), ours, mask)
    print(f"lmzoo-made mixtral: max |from_pretrained - lmzoo| logits {diff:.2e}")
    assert diff <= TOL, f"exported lmzoo model: max |from_pretrained - lmzoo| logits = {diff:.3e}"


def test_config_fields_and_round_trip():
    fields = {case: llama.config_from_hf(hf_config(case).to_dict()) for case in CASES}
    mixtral, qwen = fields["mixtral"], fields["qwen2_moe"]
    assert (mixtral["num_experts"], mixtral["experts_per_token"], mixtral["mlp_dim"]) == (5, 2, 40)
    assert mixtral["expert_mlp_dim"] == 0 and mixtral["renormalize_expert_weights"] and not mixtral["qkv_bias"]
    assert fields["mixtral_top3_window4_kv1_tied"]["sliding_window"] == 4
    assert (qwen["expert_mlp_dim"], qwen["shared_expert_mlp_dim"], qwen["mlp_dim"]) == (40, 32, 56)
    assert qwen["qkv_bias"] and not qwen["renormalize_expert_weights"]
    normed = fields["qwen2_moe_norm_topk_no_qkv_bias"]
    assert normed["renormalize_expert_weights"] and not normed["qkv_bias"]
    qwen_window = QWEN2_MOE | dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 2)
    fields["qwen2_moe_window"] = llama.config_from_hf(transformers.Qwen2MoeConfig(**SHAPE | qwen_window).to_dict())
    assert fields["qwen2_moe_window"]["sliding_window"] == 4
    model_types = {case: model_type for case, (model_type, _) in CASES.items()} | {"qwen2_moe_window": "qwen2_moe"}
    for case, case_fields in fields.items():
        cfg = make_config("llama", case_fields)
        assert llama.hf_model_type(cfg) == model_types[case], case
        assert llama.config_from_hf(llama.config_to_hf(cfg)) == case_fields, case
    # A dense checkpoint says it has no experts, so a target with experts is told so.
    dense = {"model_type": "llama", **{k: v for k, v in SHAPE.items() if v is not None}, "intermediate_size": 40}
    assert llama.config_from_hf(dense)["num_experts"] == 0


def test_bad_moe_configs_are_refused_naming_the_field():
    mixtral = {"model_type": "mixtral", **{k: v for k, v in SHAPE.items() if v is not None}, **MIXTRAL}
    qwen = {"model_type": "qwen2_moe", **{k: v for k, v in SHAPE.items() if v is not None}, **QWEN2_MOE}
    refused = {
        r"num_experts_per_tok=6 with num_local_experts=5": mixtral | {"num_experts_per_tok": 6},
        r"num_experts_per_tok=0": qwen | {"num_experts_per_tok": 0},
        r"num_local_experts=0": mixtral | {"num_local_experts": 0},
        r"router_jitter_noise=0.1": mixtral | {"router_jitter_noise": 0.1},
        r"lacks \['num_local_experts'\]": {k: v for k, v in mixtral.items() if k != "num_local_experts"},
        r"lacks \['shared_expert_intermediate_size'\]": {
            k: v for k, v in qwen.items() if k != "shared_expert_intermediate_size"
        },
        r"decoder_sparse_step=2 and mlp_only_layers=\[\]: layers \[0\] are dense": qwen | {"decoder_sparse_step": 2},
        r"mlp_only_layers=\[1\]: layers \[1\] are dense": qwen | {"mlp_only_layers": [1]},
        r"shared_expert_intermediate_size': 0.*shared expert": qwen | {"shared_expert_intermediate_size": 0},
        r"max_window_layers=28: only some layers slide": qwen | {"use_sliding_window": True, "sliding_window": 4},
        r"hidden_act='gelu'": mixtral | {"hidden_act": "gelu"},
    }
    for message, config in refused.items():
        with pytest.raises(tables.ConfigError, match=message):
            llama.config_from_hf(config)
    # Lmzoo models HF has no class for are refused on export, naming the field to set.
    cfg = make_config("llama", llama.config_from_hf(mixtral) | {"qkv_bias": True})
    with pytest.raises(ValueError, match=r"no HF counterpart.*shared_expert_mlp_dim"):
        export.hf_model_type("llama", cfg)


def test_folder_errors_blame_config_json_and_name_missing_experts(tmp_path):
    """A bad MoE config.json is blamed on that file; a checkpoint missing an expert's tensor names it; a
    transformers 5 in-memory state dict (experts fused) is told how to get the files' layout."""
    model = random_hf_model("mixtral")
    config_json, state_dict = saved(model, tmp_path / "ok")
    arrays = {name: np.asarray(tensor) for name, tensor in state_dict.items()}
    cfg = make_config("llama", llama.config_from_hf(config_json))
    for name, broken in {
        "top_k": (config_json | {"num_experts_per_tok": 7}, arrays),
        "missing": (
            config_json,
            {k: v for k, v in arrays.items() if k != "model.layers.1.block_sparse_moe.experts.3.w2.weight"},
        ),
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(broken[0]))
        save_file(broken[1], str(folder / "model.safetensors"))
    with pytest.raises(tables.ConfigError, match=r"num_experts_per_tok=7 with num_local_experts=5") as error:
        hf.convert_pretrained(f"hf:{tmp_path / 'top_k'}", "llama", cfg, dense.target_params(cfg))
    assert str(error.value).startswith(f"{tmp_path / 'top_k'}/config.json: HF mixtral config has"), error.value
    with pytest.raises(ValueError, match=r"missing keys \['layers.1.block_sparse_moe.experts.3.w2.weight'\]"):
        hf.convert_pretrained(f"hf:{tmp_path / 'missing'}", "llama", cfg, dense.target_params(cfg))
    fused = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    with pytest.raises(ValueError, match=r"(?s)unexpected keys.*experts.gate_up_proj.*save_pretrained"):
        llama.from_hf(fused, cfg)
