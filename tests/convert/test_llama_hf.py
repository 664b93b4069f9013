"""Parity of lmzoo's llama family with HF LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM through
`lmzoo.convert.llama`, `lmzoo.convert.hf` and `lmzoo.convert.export`, on random models of unusual shapes."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from lmzoo.convert import export, hf, llama
from lmzoo.decoding import generate
from lmzoo.models import build_model, make_config

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

TOL = 1e-4
VOCAB = 61
# 6 query heads of head_dim 8 on hidden_size 24 (not 24 / 6), an odd vocabulary.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=24,
    num_attention_heads=6,
    head_dim=8,
    num_hidden_layers=2,
    intermediate_size=40,
    max_position_embeddings=32,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "llama_kv2": ("llama", dict(num_key_value_heads=2)),
    "llama_kv1_tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    # wavelengths above 16 positions are scaled (all but the fastest pair of the 8-dim head)
    "llama3_rope": (
        "llama",
        dict(num_key_value_heads=2, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, **LLAMA3}),
    ),
    "mistral_window4": ("mistral", dict(num_key_value_heads=2, sliding_window=4)),
    "qwen2_bias_kv1": (
        "qwen2",
        dict(num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
}
HF_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def random_hf_model(case: str, seed: int = 0):
    """A float32 *ForCausalLM of `case` in eval mode with every weight random (RMSNorm scales and biases too)."""
    model_type, overrides = CASES[case]
    torch.manual_seed(seed)
    prefix = HF_CLASSES[model_type]
    config = getattr(transformers, f"{prefix}Config")(**SHAPE | overrides)
    model = getattr(transformers, f"{prefix}ForCausalLM")._from_config(config, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 0.15)
    return model


def numpy_state_dict(model) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}


def lmzoo_config(model, **overrides):
    return make_config("llama", {**llama.config_from_hf(model.config.to_dict()), **overrides})


def target_params(cfg):
    model = build_model("llama", cfg)
    return nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))


def padded_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens [3, 12], left-padding mask (row 1: 3 pads, row 2: 7) and the positions counted from the first real token."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 12), dtype=np.int64)
    mask = np.ones_like(tokens)
    mask[1, :3] = mask[2, :7] = 0
    return tokens, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def hf_logits(model, tokens, mask, positions) -> np.ndarray:
    with torch.no_grad():
        return model(
            torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(positions)
        ).logits.numpy()


def lmzoo_logits(cfg, params, tokens, mask, positions) -> np.ndarray:
    model = build_model("llama", cfg)
    return np.asarray(
        model.apply({"params": params}, jnp.asarray(tokens), positions=jnp.asarray(positions), segment_ids=mask)
    )


def assert_greedy_tokens_equal(model, cfg, params, tokens, mask, new_tokens: int, case: str) -> None:
    """lmzoo's greedy `generate` and HF's `generate` give the same `new_tokens` tokens after tokens[:, 4:10] (rows with
    0, 0 and 3 left pads)."""
    prompts, prompt_mask = tokens[:, 4:10], mask[:, 4:10]
    ours = generate(
        build_model("llama", cfg),
        params,
        prompts,
        prompt_mask=prompt_mask,
        rng=jax.random.key(0),
        max_new_tokens=new_tokens,
        temperature=0.0,
    )
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(prompts),
            attention_mask=torch.from_numpy(prompt_mask),
            max_new_tokens=new_tokens,
            do_sample=False,
        )
    np.testing.assert_array_equal(np.asarray(ours), out[:, prompts.shape[1] :].numpy(), err_msg=case)


def max_diff(ours, theirs, mask) -> float:
    """Max |ours - theirs| over the real (unpadded) positions."""
    return float(np.max(np.abs(ours - theirs)[mask.astype(bool)]))


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_logits_generation_and_export_match_hf(tmp_path, case):
    model = random_hf_model(case)
    cfg = lmzoo_config(model)
    params = llama.from_hf(numpy_state_dict(model), cfg)
    tokens, mask, positions = padded_batch()
    ref = hf_logits(model, tokens, mask, positions)
    diff = max_diff(lmzoo_logits(cfg, params, tokens, mask, positions), ref, mask)
    print(f"{case}: max |lmzoo - HF| logits {diff:.2e}")
    assert diff <= TOL, f"max |lmzoo - HF| logits = {diff:.3e} ({case}, logit std {ref.std():.2f})"

    assert_greedy_tokens_equal(model, cfg, params, tokens, mask, 10, case)

    summary = export.export_hf("llama", cfg, params, str(tmp_path))
    assert summary["model_type"] == CASES[case][0]
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert type(exported) is type(model)
    diff = max_diff(hf_logits(exported, tokens, mask, positions), ref, mask)
    assert diff <= TOL, f"exported {case}: max |from_pretrained - HF| logits = {diff:.3e}"


@pytest.mark.parity
def test_config_fields_of_the_cases():
    fields = {case: llama.config_from_hf(random_hf_model(case).config.to_dict()) for case in CASES}
    assert fields["llama_kv2"]["num_kv_heads"] == 2 and fields["llama_kv2"]["head_dim"] == 8
    assert fields["llama_kv1_tied"]["tie_embeddings"] and fields["llama_kv1_tied"]["num_kv_heads"] == 1
    assert fields["llama3_rope"]["rope_scaling_factor"] == 8.0 and fields["llama3_rope"]["rope_original_max_len"] == 16
    assert fields["mistral_window4"]["sliding_window"] == 4
    assert fields["qwen2_bias_kv1"]["qkv_bias"] and fields["qwen2_bias_kv1"]["rope_theta"] == 1e6
    for case, (model_type, _) in CASES.items():
        cfg = make_config("llama", fields[case])
        assert llama.hf_model_type(cfg) == model_type
        assert llama.config_from_hf(llama.config_to_hf(cfg)) == fields[case], case


@pytest.mark.parity
def test_load_pretrained_safetensors_scanned(tmp_path):
    model = random_hf_model("llama_kv2")
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg = lmzoo_config(model, scan_layers=True)
    params, report = hf.convert_pretrained(f"hf:{tmp_path}", "llama", cfg, target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    assert params["blocks"]["layers"]["attn"]["key"]["kernel"].shape == (2, 24, 2, 8)
    tokens, mask, positions = padded_batch()
    diff = max_diff(lmzoo_logits(cfg, params, tokens, mask, positions), hf_logits(model, tokens, mask, positions), mask)
    assert diff <= TOL, f"max |lmzoo(scan) - HF| logits = {diff:.3e}"
    state_dict = numpy_state_dict(model)
    back = llama.to_hf(params, cfg)
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)


@pytest.mark.parity
def test_bfloat16_checkpoint_loads(tmp_path):
    """Released Llama-family weights are bfloat16, which numpy lacks: read exactly, as float32."""
    model = random_hf_model("qwen2_bias_kv1").to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg = lmzoo_config(model)
    params, _ = hf.convert_pretrained(f"hf:{tmp_path}", "llama", cfg, target_params(cfg))
    query = model.model.layers[1].self_attn.q_proj
    np.testing.assert_array_equal(
        params["blocks"]["layer_1"]["attn"]["query"]["kernel"],
        query.weight.detach().float().numpy().T.reshape(24, 6, 8),
    )
    np.testing.assert_array_equal(
        params["blocks"]["layer_1"]["attn"]["query"]["bias"], query.bias.detach().float().numpy().reshape(6, 8)
    )


def test_config_refusals():
    base = {"model_type": "llama", **{k: v for k, v in SHAPE.items() if v is not None}}
    legacy = llama.config_from_hf(base | {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}})
    assert legacy["rope_theta"] == 5e5 and legacy["rope_scaling_factor"] == 8.0
    scaled = make_config("llama", llama.config_from_hf(base) | {"rope_scaling_factor": 8.0})
    assert hf.differing_fields(llama.config_from_hf(base), scaled) == ["rope_scaling_factor"]
    refused = {
        "rope_scaling": base | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        "rope_parameters": base | {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        "hidden_act": base | {"hidden_act": "gelu"},
        "attention_bias": base | {"attention_bias": True},
        "mlp_bias": base | {"mlp_bias": True},
        "partial_rotary_factor": base | {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        "max_window_layers=1": base
        | {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        "GemmaForCausalLM": base | {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
        "LlamaForSequenceClassification": base | {"architectures": ["LlamaForSequenceClassification"]},
    }
    for name, hf_config in refused.items():
        with pytest.raises(ValueError, match=name):
            llama.config_from_hf(hf_config)
    all_sliding = base | {
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 0,
    }
    assert llama.config_from_hf(all_sliding)["sliding_window"] == 4
    qwen_off = all_sliding | {"use_sliding_window": False}
    assert llama.config_from_hf(qwen_off)["sliding_window"] == 0


def test_folder_errors(tmp_path):
    hf_config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **SHAPE}
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(hf_config))
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"(?s)pickle.*safetensors"):
        hf.convert_pretrained(f"hf:{pickled}", "llama", {}, {})
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(
        json.dumps(hf_config | {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]})
    )
    save_file({"model.embed_tokens.weight": np.zeros((VOCAB, 24), np.float32)}, str(foreign / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model_type='gemma' \(architectures \['GemmaForCausalLM'\]\)"):
        hf.convert_pretrained(f"hf:{foreign}", "llama", {}, {})
