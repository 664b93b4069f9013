"""Parity of lmzoo's llama family with `qk_norm` (a per-head RMSNorm of queries and keys before the rotation) with HF
Qwen3ForCausalLM and Qwen3MoeForCausalLM through `lmzoo.convert.llama`, `lmzoo.convert.hf` and `lmzoo.convert.export`,
on random models of unusual shapes: head_dim set apart from hidden / heads (6 heads of 8 on hidden 24, 5 heads of 6),
kv groups of 1, 2, 3 and 6 query heads, vocabulary 61, left padding, tied and untied heads, experts of F 30 routed
top-2 and top-3 with and without norm_topk_prob. Also the HF configs refused, the released shapes of configs/qwen3.py
against their Hub config.json, and LoRA adapters through PEFT on a Qwen3."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_llama_hf as dense  # the padded batch, logits, differences and greedy decoding of the dense parity tests

from lmzoo import config as config_lib
from lmzoo import lora
from lmzoo.convert import export, hf, llama, safetensors_reader, tables
from lmzoo.lora import peft
from lmzoo.models import build_model, make_config

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

TOL, VOCAB = dense.TOL, dense.VOCAB
CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
SHAPE = dense.SHAPE  # 6 query heads of head_dim 8 on hidden 24, 2 layers, vocabulary 61
# F 30: not a multiple of 4 floats, which torch's grouped_mm wants; HF's experts run in their eager loop
# (`experts_implementation="eager"`), token by token as HF routes them. intermediate_size is the dense layers' F,
# which an all-sparse Qwen3-MoE does not use.
QWEN3_MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=30, intermediate_size=56)
CASES = {
    "qwen3_kv2": ("qwen3", dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # 5 query heads of 6 (30 wide on hidden 24) sharing one kv head, the head tied to the embeddings
    "qwen3_5x6_kv1_tied": (
        "qwen3",
        dict(num_attention_heads=5, head_dim=6, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    # every layer slides (max_window_layers 0), kv groups of 2
    "qwen3_window4_kv3": (
        "qwen3",
        dict(num_key_value_heads=3, use_sliding_window=True, sliding_window=4, max_window_layers=0),
    ),
    "qwen3_moe_kv2": ("qwen3_moe", QWEN3_MOE | dict(num_key_value_heads=2)),  # top-2 probabilities as they are
    "qwen3_moe_top3_norm_kv1_tied": (
        "qwen3_moe",
        QWEN3_MOE | dict(num_experts_per_tok=3, norm_topk_prob=True, num_key_value_heads=1, tie_word_embeddings=True),
    ),
}
HF_CLASSES = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}
# The config.json files of Qwen/Qwen3-0.6B and Qwen/Qwen3-30B-A3B on the Hub (the keys lmzoo reads).
HUB = {
    "qwen3_0_6b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        attention_bias=False,
        attention_dropout=0.0,
        head_dim=128,
        hidden_act="silu",
        hidden_size=1024,
        initializer_range=0.02,
        intermediate_size=3072,
        max_position_embeddings=40960,
        max_window_layers=28,
        num_attention_heads=16,
        num_hidden_layers=28,
        num_key_value_heads=8,
        rms_norm_eps=1e-6,
        rope_scaling=None,
        rope_theta=1000000,
        sliding_window=None,
        tie_word_embeddings=True,
        use_sliding_window=False,
        vocab_size=151936,
    ),
    "qwen3_30b_a3b": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        attention_bias=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        head_dim=128,
        hidden_act="silu",
        hidden_size=2048,
        initializer_range=0.02,
        intermediate_size=6144,
        max_position_embeddings=40960,
        max_window_layers=48,
        mlp_only_layers=[],
        moe_intermediate_size=768,
        norm_topk_prob=True,
        num_attention_heads=32,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_scaling=None,
        rope_theta=1000000.0,
        router_aux_loss_coef=0.001,
        sliding_window=None,
        tie_word_embeddings=False,
        use_sliding_window=False,
        vocab_size=151936,
    ),
}


def hf_config(case: str):
    model_type, overrides = CASES[case]
    return getattr(transformers, f"{HF_CLASSES[model_type]}Config")(**SHAPE | overrides)


def random_hf_model(case: str, seed: int = 0):
    """A float32 *ForCausalLM of `case` in eval mode with every weight random: the RMSNorm scales (q_norm and k_norm
    too), the routers (wide, so the top-k is rarely a near tie) and the experts."""
    torch.manual_seed(seed)
    model_class = getattr(transformers, f"{HF_CLASSES[CASES[case][0]]}ForCausalLM")
    model = model_class._from_config(hf_config(case), attn_implementation="eager", experts_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.15)
    return model


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_logits_generation_and_export_match_hf(tmp_path, case):
    """hf:FOLDER (sharded and read into scanned layers for the top-3 MoE) -> the same logits as HF's on left-padded
    rows, the same tensors back, the same greedy tokens as HF's generate, and an export HF loads with those logits."""
    model = random_hf_model(case)
    scanned = case == "qwen3_moe_top3_norm_kv1_tied"
    model.save_pretrained(tmp_path / "hf", safe_serialization=True, **({"max_shard_size": "20KB"} if scanned else {}))
    config_json, state_dict = safetensors_reader.read_safetensors_dir(tmp_path / "hf")
    cfg = make_config("llama", llama.config_from_hf(config_json) | {"scan_layers": scanned})
    assert cfg.qk_norm and llama.hf_model_type(cfg) == CASES[case][0]
    params, report = hf.convert_pretrained(f"hf:{tmp_path / 'hf'}", "llama", cfg, dense.target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    attn = params["blocks"]["layers" if scanned else "layer_1"]["attn"]
    assert attn["query_norm"]["scale"].shape[-1] == attn["key_norm"]["scale"].shape[-1] == cfg.head_size
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
    assert summary["model_type"] == CASES[case][0]
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), attn_implementation="eager", experts_implementation="eager"
    ).eval()
    assert type(exported) is type(model)
    diff = dense.max_diff(dense.hf_logits(exported, tokens, mask, positions), ref, mask)
    print(f"{case}: exported, max |from_pretrained - HF| logits {diff:.2e}")
    assert diff <= TOL, f"exported {case}: max |from_pretrained - HF| logits = {diff:.3e}"


def test_config_fields_and_round_trip():
    fields = {case: llama.config_from_hf(hf_config(case).to_dict()) for case in CASES}
    assert all(f["qk_norm"] and not f["qkv_bias"] for f in fields.values())
    assert (fields["qwen3_kv2"]["head_dim"], fields["qwen3_kv2"]["num_kv_heads"]) == (8, 2)
    assert fields["qwen3_kv2"]["rope_theta"] == 1e6 and fields["qwen3_kv2"]["num_experts"] == 0
    tied = fields["qwen3_5x6_kv1_tied"]
    assert (tied["num_heads"], tied["head_dim"], tied["num_kv_heads"], tied["tie_embeddings"]) == (5, 6, 1, True)
    assert fields["qwen3_window4_kv3"]["sliding_window"] == 4
    moe = fields["qwen3_moe_kv2"]
    assert (moe["num_experts"], moe["experts_per_token"], moe["expert_mlp_dim"], moe["mlp_dim"]) == (5, 2, 30, 56)
    assert moe["shared_expert_mlp_dim"] == 0 and not moe["renormalize_expert_weights"]
    top3 = fields["qwen3_moe_top3_norm_kv1_tied"]
    assert top3["experts_per_token"] == 3 and top3["renormalize_expert_weights"]
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the Hub's files say num_experts.
    assert "num_local_experts" in hf_config("qwen3_moe_kv2").to_dict()
    moe_window = QWEN3_MOE | dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4)
    fields["qwen3_moe_window"] = llama.config_from_hf(transformers.Qwen3MoeConfig(**SHAPE | moe_window).to_dict())
    assert fields["qwen3_moe_window"]["sliding_window"] == 4
    model_types = {case: model_type for case, (model_type, _) in CASES.items()} | {"qwen3_moe_window": "qwen3_moe"}
    for case, case_fields in fields.items():
        cfg = make_config("llama", case_fields)
        assert llama.hf_model_type(cfg) == model_types[case], case
        assert llama.config_from_hf(llama.config_to_hf(cfg)) == case_fields, case
    # Qwen3Config's head_dim is 128 where config.json leaves it out, not hidden_size / heads.
    no_head_dim = {k: v for k, v in hf_config("qwen3_kv2").to_dict().items() if k != "head_dim"}
    assert llama.config_from_hf(no_head_dim)["head_dim"] == 128


@pytest.mark.parametrize("variant", list(HUB))
def test_released_shapes_are_the_hub_configs(variant):
    """configs/qwen3.py's released variants are what `init_from=hf:Qwen/...` reads (no field differs), with the
    parameter counts of their docstring."""
    config = config_lib.load_config_file(CONFIGS / "qwen3.py", variant)
    cfg = make_config("llama", config.model.to_dict())
    hub_fields = llama.config_from_hf(HUB[variant])
    assert hf.differing_fields(hub_fields, cfg) == [], variant
    assert llama.hf_model_type(cfg) == HUB[variant]["model_type"]
    shapes = dense.target_params(cfg)
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
    assert count == {"qwen3_0_6b": 596_049_920, "qwen3_30b_a3b": 30_532_122_624}[variant]


def test_unsupported_configs_are_refused_naming_the_field():
    qwen3 = {"model_type": "qwen3", **{k: v for k, v in SHAPE.items() if v is not None}}
    qwen3_moe = {"model_type": "qwen3_moe", **{k: v for k, v in SHAPE.items() if v is not None}, **QWEN3_MOE}
    refused = {
        r"attention_bias=True": qwen3 | {"attention_bias": True},
        r"hidden_act='gelu'": qwen3_moe | {"hidden_act": "gelu"},
        r"qwen3 config has use_sliding_window=True with max_window_layers=1": qwen3
        | {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        r"rope_type 'yarn'": qwen3 | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        r"qwen3_moe config has decoder_sparse_step=2 and mlp_only_layers=\[\]: layers \[0\] are dense": qwen3_moe
        | {"decoder_sparse_step": 2},
        r"mlp_only_layers=\[1\]: layers \[1\] are dense": qwen3_moe | {"mlp_only_layers": [1]},
        r"num_experts=0": qwen3_moe | {"num_experts": 0},
        r"num_experts_per_tok=6 with num_experts=5": qwen3_moe | {"num_experts_per_tok": 6},
        r"lacks \['moe_intermediate_size'\]": {k: v for k, v in qwen3_moe.items() if k != "moe_intermediate_size"},
        r"Qwen3MoeForTokenClassification": qwen3_moe | {"architectures": ["Qwen3MoeForTokenClassification"]},
    }
    for message, config in refused.items():
        with pytest.raises(tables.ConfigError, match=message):
            llama.config_from_hf(config)
    # lmzoo models with q/k norms that HF has no class for are refused on export, naming the fields to set.
    base = llama.config_from_hf(qwen3)
    for extra in ({"qkv_bias": True}, {"num_experts": 4, "expert_mlp_dim": 8, "shared_expert_mlp_dim": 8}):
        with pytest.raises(ValueError, match=r"qk_norm.*no HF counterpart.*qkv_bias=False"):
            export.hf_model_type("llama", make_config("llama", base | extra))


@pytest.mark.parity
def test_lmzoo_lora_adapters_load_into_peft_on_qwen3(tmp_path):
    """Rank-4 adapters on the seven projections of a Qwen3 (`query|key|value|out|wi_0|wi_1|wo`: the head norms are no
    target), written as PEFT's and loaded onto the HF model: the same logits as lmzoo's merged model."""
    hf_peft = pytest.importorskip("peft", reason="PEFT parity needs peft (pip install -r requirements-test.txt)")
    model = random_hf_model("qwen3_kv2")
    cfg = make_config("llama", llama.config_from_hf(model.config.to_dict()))
    params = llama.from_hf(dense.numpy_state_dict(model), cfg)
    config = lora.LoraConfig("query|key|value|out|wi_0|wi_1|wo", rank=4, alpha=8.0)
    tokens = jnp.zeros((1, 4), jnp.int32)
    abstract = jax.eval_shape(build_model("llama", cfg).init, jax.random.key(0), tokens)["params"]
    adapters = nn.unbox(lora.init_adapters(jax.random.key(0), abstract, config))
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(lambda x: rng.normal(0.0, 0.05, x.shape).astype(np.float32), adapters)
    summary = peft.save_peft(str(tmp_path), adapters, config, "llama", cfg)
    assert summary["tensors"] == 2 * 7 * 2
    assert summary["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    tokens, mask, positions = dense.padded_batch()
    merged = lora.merge(params, adapters, config)
    ours = dense.lmzoo_logits(cfg, merged, tokens, mask, positions)
    theirs = dense.hf_logits(hf_peft.PeftModel.from_pretrained(model, str(tmp_path)).eval(), tokens, mask, positions)
    diff = dense.max_diff(ours, theirs, mask)
    moved = dense.max_diff(ours, dense.lmzoo_logits(cfg, params, tokens, mask, positions), mask)
    print(f"qwen3 lmzoo LoRA -> PEFT: max |PEFT - lmzoo| logits {diff:.2e} (the adapters move them by {moved:.2f})")
    assert diff <= TOL and moved > 0.1
