"""Parity of lmzoo's llama family with Gemma 3's fields (layer kinds, sandwich norms, scaled embeddings, q/k norms,
GeGLU, query_pre_attn_scalar) with HF Gemma3ForCausalLM through `lmzoo.convert.llama`, `lmzoo.convert.hf` and
`lmzoo.convert.export`, on random models of unusual shapes: head_dim set apart from hidden / heads (6 heads of 8 on
hidden 24, 5 heads of 6 on hidden 20; Gemma3TextConfig refuses heads that do not divide hidden_size), kv groups of 1,
2 and 3 query heads, vocabulary 61, sliding layers and global ones 5:1 and 1:1 with windows of 4 and 3 positions (less
than the 12 of the batch and the 16 of greedy decoding), linear rope scaling on the global layers, left padding, tied
and untied heads, scanned and looped layers. Also the norms' 1 + w through an accelerator's load of a bfloat16
checkpoint, the HF configs refused, the released shapes of configs/gemma3.py against their Hub config.json, and LoRA
adapters through PEFT on a Gemma 3."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_llama_hf as dense  # the padded batch, logits, differences and greedy decoding of the dense parity tests
import test_streamed_loading as streamed  # an accelerator's way of loading, taken on the CPU device

from lmzoo import config as config_lib
from lmzoo import lora
from lmzoo.convert import export, hf, llama, mapping, safetensors_reader, tables
from lmzoo.lora import peft
from lmzoo.models import build_model, make_config

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

TOL, VOCAB = dense.TOL, dense.VOCAB
CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
SLIDING, FULL = "sliding_attention", "full_attention"
# 6 query heads of head_dim 8 on hidden 24, vocabulary 61; Gemma's switches on top.
SHAPE = dense.SHAPE | dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=12)
ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 1e4}, FULL: {"rope_type": "default", "rope_theta": 1e6}}
CASES = {
    # Gemma 3's 5:1 (layer 6 global), a window of 4, the global layers' rotation scaled linearly by 8, as 4B's
    "gemma3_5to1_window4_linear_kv2_tied": dict(
        num_hidden_layers=6,
        num_key_value_heads=2,
        sliding_window=4,
        layer_types=[SLIDING] * 5 + [FULL],
        rope_parameters=ROPE | {FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
        tie_word_embeddings=True,
    ),
    # 5 query heads of 6 (30 wide on hidden 20: Gemma3TextConfig wants heads dividing hidden_size) sharing one kv
    # head, 1:1, untied
    "gemma3_1to1_window3_5x6_kv1": dict(
        hidden_size=20,
        num_attention_heads=5,
        head_dim=6,
        num_key_value_heads=1,
        sliding_window=3,
        layer_types=[SLIDING, FULL],
        rope_parameters=ROPE,
        tie_word_embeddings=False,
    ),
    # every layer local: no layer kinds to lmzoo, Mistral's rolling window cache in a looped stack
    "gemma3_all_sliding_kv3_tied": dict(
        num_key_value_heads=3,
        sliding_window=4,
        layer_types=[SLIDING, SLIDING],
        rope_parameters=ROPE,
        tie_word_embeddings=True,
    ),
}
# The config.json of google/gemma-3-1b-it on the Hub (transformers 4.50's keys), and the text_config of
# google/gemma-3-4b-it, whose other keys are Gemma3TextConfig's defaults.
HUB = {
    "gemma3_1b": dict(
        architectures=["Gemma3ForCausalLM"],
        attention_bias=False,
        attention_dropout=0.0,
        attn_logit_softcapping=None,
        bos_token_id=2,
        cache_implementation="hybrid",
        eos_token_id=[1, 106],
        final_logit_softcapping=None,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        hidden_size=1152,
        initializer_range=0.02,
        intermediate_size=6912,
        max_position_embeddings=32768,
        model_type="gemma3_text",
        num_attention_heads=4,
        num_hidden_layers=26,
        num_key_value_heads=1,
        pad_token_id=0,
        query_pre_attn_scalar=256,
        rms_norm_eps=1e-06,
        rope_local_base_freq=10000,
        rope_scaling=None,
        rope_theta=1000000,
        sliding_window=512,
        sliding_window_pattern=6,
        torch_dtype="bfloat16",
        use_cache=True,
        vocab_size=262144,
    ),
    "gemma3_4b": dict(
        hidden_size=2560,
        intermediate_size=10240,
        model_type="gemma3_text",
        num_hidden_layers=34,
        rope_scaling={"factor": 8.0, "rope_type": "linear"},
        sliding_window=1024,
    ),
}


def hf_config(case: str):
    return transformers.Gemma3TextConfig(**SHAPE | CASES[case])


def random_hf_model(case: str, seed: int = 0):
    """A float32 Gemma3ForCausalLM of `case` in eval mode with every weight random, the RMSNorm weights (q_norm and
    k_norm too; HF scales by 1 + weight) spread around 0."""
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM._from_config(hf_config(case), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 0.15)
    return model


def assert_state_dicts_equal(back: dict, state_dict: dict) -> None:
    """HF tensors back from lmzoo equal the originals: exactly, but for the norm weights, which went through lmzoo's
    float32 1 + w and lose what 1 + w rounds away (a few 1e-8)."""
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        if "norm" in key:
            np.testing.assert_allclose(back[key], np.asarray(value), rtol=0, atol=1.2e-7, err_msg=key)
        else:
            np.testing.assert_array_equal(back[key], np.asarray(value), err_msg=key)


@pytest.mark.parity
@pytest.mark.parametrize("scanned", [False, True], ids=["looped", "scanned"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_generation_and_export_match_hf(tmp_path, case, scanned):
    """hf:FOLDER (sharded and streamed into scanned layers, or into looped ones) -> the same logits as HF's on
    left-padded rows, the same tensors back, the same greedy tokens as HF's generate past the window, and an export
    HF loads with those logits."""
    model = random_hf_model(case)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True, **({"max_shard_size": "20KB"} if scanned else {}))
    config_json, state_dict = safetensors_reader.read_safetensors_dir(tmp_path / "hf")
    cfg = make_config("llama", llama.config_from_hf(config_json) | {"scan_layers": scanned})
    assert llama.hf_model_type(cfg) == "gemma3_text" and cfg.sandwich_norms and cfg.embed_scale and cfg.qk_norm
    params, report = hf.convert_pretrained(f"hf:{tmp_path / 'hf'}", "llama", cfg, dense.target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    layer = params["blocks"]["layers" if scanned else "layer_1"]
    assert {"ln_attn", "ln_attn_out", "ln_mlp", "ln_mlp_out"} <= set(layer)
    scale = layer["attn"]["query_norm"]["scale"]  # HF's weight w as the factor 1 + w
    np.testing.assert_array_equal(
        scale[1] if scanned else scale, 1.0 + model.model.layers[1].self_attn.q_norm.weight.detach().numpy()
    )
    tokens, mask, positions = dense.padded_batch()
    ref = dense.hf_logits(model, tokens, mask, positions)
    diff = dense.max_diff(dense.lmzoo_logits(cfg, params, tokens, mask, positions), ref, mask)
    print(
        f"{case} {'scanned' if scanned else 'looped'}: max |lmzoo - HF| logits {diff:.2e} (logit std {ref.std():.2f})"
    )
    assert diff <= TOL, f"max |lmzoo - HF| logits = {diff:.3e} ({case}, logit std {ref.std():.2f})"

    back = llama.to_hf(params, cfg)
    if cfg.tie_embeddings:  # save_pretrained leaves the tied copy out
        np.testing.assert_array_equal(back.pop("lm_head.weight"), back["model.embed_tokens.weight"])
    assert_state_dicts_equal(back, state_dict)

    dense.assert_greedy_tokens_equal(model, cfg, params, tokens, mask, 10, case)

    summary = export.export_hf("llama", cfg, params, str(tmp_path / "export"))
    assert summary["model_type"] == "gemma3_text"
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), attn_implementation="eager"
    ).eval()
    assert type(exported) is type(model)
    diff = dense.max_diff(dense.hf_logits(exported, tokens, mask, positions), ref, mask)
    print(f"{case} {'scanned' if scanned else 'looped'}: exported, max |from_pretrained - HF| logits {diff:.2e}")
    assert diff <= TOL, f"exported {case}: max |from_pretrained - HF| logits = {diff:.3e}"


def test_config_fields_and_round_trip():
    fields = {case: llama.config_from_hf(hf_config(case).to_dict()) for case in CASES}
    assert all(f["qk_norm"] and f["sandwich_norms"] and f["embed_scale"] for f in fields.values())
    assert all(f["mlp_activation"] == "gelu_tanh" and f["query_pre_attn_scalar"] == 12.0 for f in fields.values())
    five = fields["gemma3_5to1_window4_linear_kv2_tied"]
    assert five["layer_types"] == (SLIDING,) * 5 + (FULL,) and five["sliding_window"] == 4
    assert (five["rope_theta"], five["sliding_rope_theta"]) == (1e6, 1e4)
    assert (five["rope_scaling_factor"], five["rope_scaling_type"]) == (8.0, "linear") and five["tie_embeddings"]
    one = fields["gemma3_1to1_window3_5x6_kv1"]
    assert (one["num_heads"], one["head_dim"], one["num_kv_heads"], one["tie_embeddings"]) == (5, 6, 1, False)
    assert one["layer_types"] == (SLIDING, FULL) and one["rope_scaling_factor"] == 0.0
    # kinds all alike are no kinds: every layer slides, rotating with the sliding layers' base
    alike = fields["gemma3_all_sliding_kv3_tied"]
    assert (alike["layer_types"], alike["sliding_window"], alike["rope_theta"]) == ((), 4, 1e4)
    assert alike["sliding_rope_theta"] == 0.0
    for case, case_fields in fields.items():
        cfg = make_config("llama", case_fields)
        assert llama.hf_model_type(cfg) == "gemma3_text", case
        assert llama.config_from_hf(llama.config_to_hf(cfg)) == case_fields, case
    # the keys a gemma3_text config.json may leave out are Gemma3TextConfig's defaults
    sparse = {"model_type": "gemma3_text", **{k: v for k, v in dense.SHAPE.items() if v is not None}}
    defaults = llama.config_from_hf({k: v for k, v in sparse.items() if k != "head_dim"})
    assert (defaults["head_dim"], defaults["query_pre_attn_scalar"], defaults["tie_embeddings"]) == (256, 256.0, True)
    assert defaults["layer_types"] == () and defaults["sliding_window"] == 4096  # 2 layers of a 6-layer pattern: local
    assert defaults["rope_theta"] == 1e4  # local layers rotate with rope_local_base_freq's default
    # the other model types state Gemma's fields at their defaults, so a target that sets them differs
    llama_fields = llama.config_from_hf(
        {"model_type": "llama", **{k: v for k, v in dense.SHAPE.items() if v is not None}}
    )
    gemma_like = make_config("llama", llama_fields | {"embed_scale": True})
    assert hf.differing_fields(llama_fields, gemma_like) == ["embed_scale"]


@pytest.mark.parametrize("variant", list(HUB))
def test_released_shapes_are_the_hub_configs(variant):
    """configs/gemma3.py's released variants are what `init_from=hf:google/...` reads (no field differs; 4B's text
    config through Gemma3TextConfig, as transformers completes it), with the parameter counts of its docstring."""
    config = config_lib.load_config_file(CONFIGS / "gemma3.py", variant)
    cfg = make_config("llama", config.model.to_dict())
    hub = HUB[variant] if variant == "gemma3_1b" else transformers.Gemma3TextConfig(**HUB[variant]).to_dict()
    hub_fields = llama.config_from_hf(hub)
    assert hf.differing_fields(hub_fields, cfg) == [], variant
    assert llama.hf_model_type(cfg) == "gemma3_text"
    shapes = dense.target_params(cfg)
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
    assert count == {"gemma3_1b": 999_885_952, "gemma3_4b": 3_880_263_168}[variant]


def test_unsupported_configs_are_refused_naming_the_field():
    gemma = hf_config("gemma3_5to1_window4_linear_kv2_tied").to_dict()
    ropes = gemma["rope_parameters"]
    refused = {
        r"model_type='gemma3'.*multimodal.*use a text-only checkpoint": gemma
        | {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
        r"attn_logit_softcapping=50.0; lmzoo's llama does not soft-cap": gemma | {"attn_logit_softcapping": 50.0},
        r"final_logit_softcapping=30.0": gemma | {"final_logit_softcapping": 30.0},
        r"use_bidirectional_attention=True": gemma | {"use_bidirectional_attention": True},
        r"hidden_activation='gelu_fast'; lmzoo's llama implements 'gelu_new'": gemma
        | {"hidden_activation": "gelu_fast"},
        r"layer_types 'chunked_attention'": gemma | {"layer_types": [SLIDING] * 5 + ["chunked_attention"]},
        r"6 layer_types for num_hidden_layers=5": gemma | {"num_hidden_layers": 5},
        r"rope_parameters\['full_attention'\] rope_type 'yarn'": gemma
        | {"rope_parameters": ropes | {FULL: {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}},
        r"rope_parameters\['sliding_attention'\] rope_type 'linear'; lmzoo's llama implements 'default'": gemma
        | {"rope_parameters": ropes | {SLIDING: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
        r"no rope_parameters\['sliding_attention'\]": gemma | {"rope_parameters": {FULL: ropes[FULL]}},
        r"sliding_attention layers with sliding_window=None": gemma | {"sliding_window": None},
        r"attention_bias=True": gemma | {"attention_bias": True},
        r"Gemma3ForSequenceClassification": gemma | {"architectures": ["Gemma3ForSequenceClassification"]},
    }
    for message, config in refused.items():
        with pytest.raises(tables.ConfigError, match=message):
            llama.config_from_hf(config)
    # lmzoo models with some of Gemma's fields that HF has no class for are refused on export, naming the fields.
    base = llama.config_from_hf(gemma)
    for extra in ({"sandwich_norms": False}, {"qkv_bias": True}, {"num_experts": 4, "mlp_activation": "silu"}):
        with pytest.raises(ValueError, match=r"no HF counterpart: Gemma3ForCausalLM.*sandwich_norms=True"):
            export.hf_model_type("llama", make_config("llama", base | extra))


@pytest.mark.parity
def test_bfloat16_norms_gain_one_on_the_host_and_on_an_accelerator(tmp_path, monkeypatch):
    """A bfloat16 checkpoint's norm weights w become float32 1 + w exactly, read on the host and assembled on the device
    as an accelerator does (the offset added there, after the cast), in scanned layers; the other tensors as stored."""
    model = random_hf_model("gemma3_5to1_window4_linear_kv2_tied").to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    cfg = make_config("llama", llama.config_from_hf(model.config.to_dict()) | {"scan_layers": True})
    shapes = dense.target_params(cfg)
    host, _ = hf.convert_pretrained(f"hf:{tmp_path}", "llama", cfg, shapes)
    device, inserts = streamed.load_as_an_accelerator(monkeypatch, f"hf:{tmp_path}", "llama", cfg, shapes)
    assert any(relayout is not None and relayout.offset == 1.0 for _, _, relayout in inserts)
    flat_host = mapping.flatten(host)
    for path, leaf in mapping.flatten(device).items():
        np.testing.assert_array_equal(np.asarray(leaf), flat_host[path], err_msg=path)
    weights = {name: param.detach().float().numpy() for name, param in model.named_parameters()}
    np.testing.assert_array_equal(
        flat_host["blocks/layers/ln_mlp_out/scale"][5],
        1.0 + weights["model.layers.5.post_feedforward_layernorm.weight"],
    )
    np.testing.assert_array_equal(flat_host["norm/scale"], 1.0 + weights["model.norm.weight"])
    np.testing.assert_array_equal(
        flat_host["blocks/layers/mlp/wo/kernel"][2], weights["model.layers.2.mlp.down_proj.weight"].T
    )


@pytest.mark.parity
def test_lmzoo_lora_adapters_load_into_peft_on_gemma3(tmp_path):
    """Rank-4 adapters on the seven projections of a Gemma 3 (`query|key|value|out|wi_0|wi_1|wo`: the norms are no
    target), written as PEFT's and loaded onto the HF model: the same logits as lmzoo's merged model."""
    hf_peft = pytest.importorskip("peft", reason="PEFT parity needs peft (pip install -r requirements-test.txt)")
    model = random_hf_model("gemma3_5to1_window4_linear_kv2_tied")
    cfg = make_config("llama", llama.config_from_hf(model.config.to_dict()))
    params = llama.from_hf(dense.numpy_state_dict(model), cfg)
    config = lora.LoraConfig("query|key|value|out|wi_0|wi_1|wo", rank=4, alpha=8.0)
    tokens = jnp.zeros((1, 4), jnp.int32)
    abstract = jax.eval_shape(build_model("llama", cfg).init, jax.random.key(0), tokens)["params"]
    adapters = nn.unbox(lora.init_adapters(jax.random.key(0), abstract, config))
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(lambda x: rng.normal(0.0, 0.05, x.shape).astype(np.float32), adapters)
    summary = peft.save_peft(str(tmp_path), adapters, config, "llama", cfg)
    assert summary["tensors"] == 6 * 7 * 2
    assert summary["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    tokens, mask, positions = dense.padded_batch()
    merged = lora.merge(params, adapters, config)
    ours = dense.lmzoo_logits(cfg, merged, tokens, mask, positions)
    theirs = dense.hf_logits(hf_peft.PeftModel.from_pretrained(model, str(tmp_path)).eval(), tokens, mask, positions)
    diff = dense.max_diff(ours, theirs, mask)
    moved = dense.max_diff(ours, dense.lmzoo_logits(cfg, params, tokens, mask, positions), mask)
    print(f"gemma3 lmzoo LoRA -> PEFT: max |PEFT - lmzoo| logits {diff:.2e} (the adapters move them by {moved:.2f})")
    assert diff <= TOL and moved > 0.1
