"""Qwen3.5's text model (`lmzoo.models.qwen3_5`, `lmzoo.layers.gated_delta`, `lmzoo.convert.qwen3_5`) against HF's
Qwen3_5ForCausalLM (transformers' torch fallbacks of the chunked gated delta rule and the causal convolution), on
random models of odd shapes: 3 query heads of 8 over 1 key/value head with half of each head rotated, Gated DeltaNet
with 2 key heads of 6 and 4 value heads of 5, vocabulary 61, left padding; HF's default 3:1 pattern read sharded into
scanned groups, and a 1:1 pattern with a tied head looped. Logits, the tensors back, greedy generation against HF's
(its recurrent cache against ours) and the export HF loads; the released shape's parameter count; the refusals."""

import copy
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import traverse_util

from lmzoo import decoding, testing
from lmzoo.convert import export, hf, qwen3_5, safetensors_reader, tables
from lmzoo.models import build_model, make_config

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

TOL, VOCAB = 1e-4, 61
ROOT = pathlib.Path(__file__).resolve().parents[2]
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=8,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=6,
    linear_value_head_dim=5,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
CASES = {
    # HF's default pattern (3 linear : 1 full), two groups, read from a sharded folder into scanned layers.
    "default_pattern_scanned": dict(),
    # Alternating kinds, a tied head, four layers looped.
    "alternating_tied": dict(
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, tie_word_embeddings=True
    ),
}


def random_hf_model(case: str, seed: int = 0):
    """A float32 Qwen3_5ForCausalLM of `case` in eval mode with every weight random: norms' weights around 0 (HF
    adds 1), the gated norm's around 1, decay rates and biases spread so the state both keeps and forgets."""
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE | CASES[case])).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "norm" in name:
                param.normal_(0.0, 0.2)
            elif name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.01, 4.0).log())
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.2)
    return model


def padded_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens [3, 12], left-padding mask (row 1: 3 pads, row 2: 7) and positions counted from the first real token."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 12), dtype=np.int64)
    mask = np.ones_like(tokens)
    mask[1, :3] = mask[2, :7] = 0
    return tokens, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def hf_logits(model, tokens, mask, positions) -> np.ndarray:
    with torch.no_grad():
        return model(
            torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(positions)
        ).logits.numpy()


def max_diff(ours, theirs, mask) -> float:
    """Max |ours - theirs| over the real (unpadded) positions."""
    return float(np.max(np.abs(ours - theirs)[mask.astype(bool)]))


def target_params(cfg):
    model = build_model("qwen3_5", cfg)
    return nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))


def converted(tmp_path, case: str):
    """(HF model, its state dict as saved, lmzoo config, lmzoo params read from hf:FOLDER). The default pattern is
    saved in shards and read into scanned groups; chunks of 4 positions (several per row of 12)."""
    scanned = case == "default_pattern_scanned"
    model = random_hf_model(case)
    model.save_pretrained(tmp_path / "hf", **({"max_shard_size": "20KB"} if scanned else {}))
    config_json, state_dict = safetensors_reader.read_safetensors_dir(tmp_path / "hf")
    fields = qwen3_5.config_from_hf(config_json)
    cfg = make_config("qwen3_5", fields | {"scan_layers": scanned, "chunk_size": 4})
    params, report = hf.convert_pretrained(f"hf:{tmp_path / 'hf'}", "qwen3_5", cfg, target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    return model, state_dict, cfg, params


def lmzoo_logits(cfg, params, tokens, mask, positions) -> np.ndarray:
    model = build_model("qwen3_5", cfg)
    return np.asarray(
        model.apply({"params": params}, jnp.asarray(tokens), positions=jnp.asarray(positions), segment_ids=mask)
    )


# The forward of `default_pipeline_logits`, in a process of its own: FOLDER holds config.json, params.npz ("/"-joined paths) and
# inputs.npz; it writes logits.npy.
FORWARD = """
import json, pathlib, sys
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from lmzoo.models import build_model, make_config
folder = pathlib.Path(sys.argv[1])
cfg = make_config("qwen3_5", json.loads((folder / "config.json").read_text()))
params = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in np.load(folder / "params.npz").items()})
inputs = np.load(folder / "inputs.npz")
tokens, positions = jnp.asarray(inputs["tokens"]), jnp.asarray(inputs["positions"])
logits = build_model("qwen3_5", cfg).apply({"params": params}, tokens, positions=positions, segment_ids=inputs["mask"])
np.save(folder / "logits.npy", np.asarray(logits))
"""


def default_pipeline_logits(cfg, params, tokens, mask, positions, folder) -> np.ndarray:
    """`lmzoo_logits`, compiled by XLA's default pipeline as users compile it (in a process of its own:
    the suite's quickest pipeline contracts float operations otherwise, which on an Intel Xeon put this 8-layer
    model 1.3e-4 from HF's float64 logits where the default pipeline is 6.6e-5 from them, HF's own float32 1.4e-4)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    flat = traverse_util.flatten_dict(jax.device_get(params))
    np.savez(folder / "params.npz", **{"/".join(path): np.asarray(value) for path, value in flat.items()})
    np.savez(folder / "inputs.npz", tokens=tokens, mask=mask, positions=positions)
    env = {**os.environ, "XLA_FLAGS": " ".join(testing.default_pipeline_xla_flags()), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", FORWARD, str(folder)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return np.load(folder / "logits.npy")


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_tensors_match_hf(tmp_path, case):
    """hf:FOLDER -> the same logits as HF's on left-padded rows, and the same tensors back."""
    model, state_dict, cfg, params = converted(tmp_path, case)
    tokens, mask, positions = padded_batch()
    ref = hf_logits(model, tokens, mask, positions)
    ours = default_pipeline_logits(cfg, params, tokens, mask, positions, tmp_path / "lmzoo")
    # HF's own float32 forward is up to ~1.5e-4 from its float64 one at a few positions of these random models (the
    # triangular solves of the chunks): both float32 forwards are held to the float64 truth, and to each other.
    exact = hf_logits(copy.deepcopy(model).double(), tokens, mask, positions)
    diff, truth, theirs = (max_diff(a, b, mask) for a, b in ((ours, ref), (ours, exact), (ref, exact)))
    print(
        f"{case}: max |lmzoo - HF| logits {diff:.2e}; against HF in float64: lmzoo {truth:.2e}, HF float32 "
        f"{theirs:.2e} (logit std {ref.std():.2f})"
    )
    assert truth <= TOL and diff <= 2 * TOL, f"{case}: lmzoo - HF {diff:.3e}, lmzoo - HF float64 {truth:.3e}"

    back = qwen3_5.to_hf(params, cfg)
    if cfg.tie_embeddings:  # save_pretrained leaves the tied copy out
        np.testing.assert_array_equal(back.pop("lm_head.weight"), back["model.embed_tokens.weight"])
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():  # exactly, but for the zero-centred norms' w, which went through 1 + w
        zero_centred = "norm" in key and "linear_attn" not in key
        np.testing.assert_allclose(
            back[key], np.asarray(value), rtol=0, atol=1.2e-7 if zero_centred else 0, err_msg=key
        )


@pytest.mark.parity
def test_greedy_generation_matches_hf(tmp_path):
    """The KV cache and recurrent states (scanned groups, left-padded prompts) give HF generate's greedy tokens."""
    model, _, cfg, params = converted(tmp_path, "default_pattern_scanned")
    tokens, mask, _ = padded_batch()
    prompts, prompt_mask = tokens[:, 4:10], mask[:, 4:10]  # 0, 0 and 3 left pads
    ours = decoding.generate(
        build_model("qwen3_5", cfg),
        params,
        prompts,
        prompt_mask=prompt_mask,
        rng=jax.random.key(0),
        max_new_tokens=5,
        temperature=0.0,
    )
    with torch.no_grad():
        theirs = model.generate(
            torch.from_numpy(prompts), attention_mask=torch.from_numpy(prompt_mask), max_new_tokens=5, do_sample=False
        )
    np.testing.assert_array_equal(np.asarray(ours), theirs[:, prompts.shape[1] :].numpy())


@pytest.mark.parity
def test_export_loads_in_hf(tmp_path):
    """export_hf writes a Qwen3_5ForCausalLM folder that AutoModelForCausalLM loads, with the original's logits."""
    model, _, cfg, params = converted(tmp_path, "alternating_tied")
    summary = export.export_hf("qwen3_5", cfg, params, str(tmp_path / "export"))
    assert summary["model_type"] == "qwen3_5_text"
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert type(exported) is type(model)
    tokens, mask, positions = padded_batch()
    ref = hf_logits(model, tokens, mask, positions)
    assert max_diff(hf_logits(exported, tokens, mask, positions), ref, mask) <= 1e-5


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=10, shared_expert_intermediate_size=12)


@pytest.mark.parity
def test_moe_logits_tensors_and_export_match_hf(tmp_path):
    """Qwen3.5-MoE (Qwen3_5MoeForCausalLM: every layer 4 experts, top-2 renormalised, a sigmoid-gated shared expert):
    hf:FOLDER -> HF's logits on left-padded rows, the same tensors back, and an export HF loads."""
    torch.manual_seed(0)
    config = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in SHAPE.items() if k != "intermediate_size"} | MOE)
    model = transformers.Qwen3_5MoeForCausalLM._from_config(config, experts_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.2).add_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
            elif name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.01, 4.0).log())
            else:  # the routers wide too: a top-2 is rarely a near tie
                param.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.2)
    model.save_pretrained(tmp_path / "hf")
    _, state_dict = safetensors_reader.read_safetensors_dir(tmp_path / "hf")
    fields = hf.checkpoint_fields(f"hf:{tmp_path / 'hf'}", "qwen3_5")
    assert (fields["num_experts"], fields["experts_per_token"], fields["shared_expert_mlp_dim"]) == (4, 2, 12)
    cfg = make_config("qwen3_5", fields | {"chunk_size": 4})
    params, report = hf.convert_pretrained(f"hf:{tmp_path / 'hf'}", "qwen3_5", cfg, target_params(cfg))
    assert not report.initialised and not report.dropped
    tokens, mask, positions = padded_batch()
    ref = hf_logits(model, tokens, mask, positions)
    ours = default_pipeline_logits(cfg, params, tokens, mask, positions, tmp_path / "lmzoo")
    exact = hf_logits(model.double(), tokens, mask, positions)
    diff, truth = max_diff(ours, ref, mask), max_diff(ours, exact, mask)
    print(f"moe: max |lmzoo - HF| logits {diff:.2e}, against HF in float64 {truth:.2e} (logit std {ref.std():.2f})")
    assert truth <= TOL and diff <= 2 * TOL, f"moe: lmzoo - HF {diff:.3e}, lmzoo - HF float64 {truth:.3e}"
    model.float()
    back = qwen3_5.to_hf(params, cfg)
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        zero_centred = "norm" in key and "linear_attn" not in key
        np.testing.assert_allclose(
            back[key], np.asarray(value), rtol=0, atol=1.2e-7 if zero_centred else 0, err_msg=key
        )
    summary = export.export_hf("qwen3_5", cfg, params, str(tmp_path / "export"))
    assert summary["model_type"] == "qwen3_5_moe_text"
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), experts_implementation="eager"
    ).eval()
    assert type(exported) is type(model)
    assert max_diff(hf_logits(exported, tokens, mask, positions), ref, mask) <= 1e-5


@pytest.mark.parity
def test_reads_the_text_model_of_a_vision_language_checkpoint(tmp_path):
    """A Qwen3_5ForConditionalGeneration folder (the released checkpoints' class, a tiny vision encoder here) reads as
    HF's Qwen3_5ForCausalLM reads it: text_config, the tensors under model.language_model., the vision encoder left
    out; the logits of the text model's."""
    torch.manual_seed(0)
    text = SHAPE | {"num_hidden_layers": 4}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=24, patch_size=4)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    ).eval()
    model.save_pretrained(tmp_path / "vl")
    reference = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path / "vl").eval()
    fields = hf.checkpoint_fields(f"hf:{tmp_path / 'vl'}", "qwen3_5")
    assert fields["num_layers"] == 4 and fields["rotary_fraction"] == 0.5
    cfg = make_config("qwen3_5", fields)
    params, report = hf.convert_pretrained(f"hf:{tmp_path / 'vl'}", "qwen3_5", cfg, target_params(cfg))
    assert not report.initialised and not report.dropped
    tokens, mask, positions = padded_batch()
    ref = hf_logits(reference, tokens, mask, positions)
    assert max_diff(lmzoo_logits(cfg, params, tokens, mask, positions), ref, mask) <= TOL


@pytest.mark.parametrize(
    "hf_class, config_class, count",
    [
        ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", 8_953_803_264),  # Qwen3.5-9B's text model
        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", 34_660_610_688),  # Qwen3.5-35B-A3B's
    ],
)
def test_released_shapes_have_hf_parameter_counts(hf_class, config_class, count):
    """transformers' default configs (the released shapes), built on the meta device, have as many parameters as the
    converted config, counted with jax.eval_shape (configs/qwen3_5.py's variants: tests/models/test_qwen3_5.py)."""
    with torch.device("meta"):
        reference = getattr(transformers, hf_class)(getattr(transformers, config_class)())
    assert sum(p.numel() for p in reference.parameters()) == count
    fields = qwen3_5.config_from_hf(reference.config.to_dict())
    model = build_model("qwen3_5", fields | {"scan_layers": True})
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    assert sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nn.unbox(shapes))) == count


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["linear_attention", "sliding_attention"] * 4}, "'sliding_attention'"),
        ({"model_type": "qwen3_5"}, "no text_config"),
        ({"model_type": "qwen3_vl"}, "model_type='qwen3_vl'"),
    ],
)
def test_refuses_what_it_does_not_implement(change, message):
    config = transformers.Qwen3_5TextConfig(**SHAPE).to_dict() | change
    with pytest.raises(tables.ConfigError, match=message):
        qwen3_5.config_from_hf(config)
