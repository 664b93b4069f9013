"""Qwen3-Next (HF Qwen3NextForCausalLM, model_type qwen3_next) read into and written from lmzoo's qwen3_5 family
(`lmzoo.convert.qwen3_5`, `lmzoo.models.qwen3_5`) against transformers' torch forward (its fallbacks of the chunked
gated delta rule and the causal convolution), on random models of odd shapes: 3 query heads of 12 over 1 key/value
head (head_dim 12, hidden 24) with half of each head rotated, Gated DeltaNet with 2 key heads of 6 and 6 value heads of
5 (3 to a key head: the fused in_proj_qkvz and in_proj_ba interleave them key head by key head), vocabulary 61, 4
layers alternating (full_attention_interval 2). "moe": every layer 4 experts, top-2 not renormalised (norm_topk_prob
False, which only Qwen3-Next expresses: export picks qwen3_next on its own) plus a sigmoid-gated shared expert, read
into scanned groups; "dense_tied": num_experts 0, a tied head, exported to qwen3_next when asked. Logits on
left-padded rows, the tensors back, the export HF loads, lmzoo's cached decode against its own forward and HF's greedy
generation, the released shape's parameter count, the refusals. (Qwen3.5: test_qwen3_5_hf.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo import decoding
from lmzoo.convert import export, hf, qwen3_5, safetensors_reader, tables
from lmzoo.models import build_model, make_config
from lmzoo.serving import slots

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

# The parity helpers of Qwen3.5's test (the same family, vocabulary and left-padded batch; tests/convert is on the path).
from test_qwen3_5_hf import TOL, VOCAB, hf_logits, lmzoo_logits, max_diff, padded_batch, target_params  # noqa: E402

SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=4,
    full_attention_interval=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=6,
    linear_value_head_dim=5,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=10,
    shared_expert_intermediate_size=12,
    norm_topk_prob=False,
)
CASES = {"moe": MOE, "dense_tied": dict(num_experts=0, tie_word_embeddings=True)}


def random_hf_model(case: str, seed: int = 0):
    """A float32 Qwen3NextForCausalLM of `case` in eval mode with every weight random: norms' weights around 0 (HF
    adds 1), the gated norm's around 1, decay rates and biases spread so the state both keeps and forgets, routers
    wide so that a top-2 is rarely a near tie, and the convolution's taps wide (std 0.5, as HF's own init): with
    narrow ones the Gated DeltaNet's outputs have an RMS near sqrt(rms_norm_eps), where the gated norm amplifies
    float32 rounding some thousandfold (lmzoo and HF then differ by ~1e-4 at such a position, though each agrees with
    the other in float64)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3NextConfig(**SHAPE | CASES[case])
    model = transformers.Qwen3NextForCausalLM._from_config(config, experts_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.01, 4.0).log())
            elif name.endswith(("dt_bias", "conv1d.weight")):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.2)
    return model


def converted(tmp_path, case: str):
    """(HF model, its state dict as saved, lmzoo config, lmzoo params read from hf:FOLDER); the MoE case into scanned
    groups, chunks of 4 positions (several per row of 12)."""
    model = random_hf_model(case)
    model.save_pretrained(tmp_path / "hf")
    _, state_dict = safetensors_reader.read_safetensors_dir(tmp_path / "hf")
    fields = hf.checkpoint_fields(f"hf:{tmp_path / 'hf'}", "qwen3_5")
    cfg = make_config("qwen3_5", fields | {"scan_layers": case == "moe", "chunk_size": 4})
    params, report = hf.convert_pretrained(f"hf:{tmp_path / 'hf'}", "qwen3_5", cfg, target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    return model, state_dict, cfg, params


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_logits_tensors_and_export_match_hf(tmp_path, case):
    """hf:FOLDER -> HF's logits on left-padded rows, the same tensors back, and a qwen3_next export that HF loads with
    the original's logits."""
    model, state_dict, cfg, params = converted(tmp_path, case)
    assert cfg.kinds == ("linear_attention", "full_attention") * 2
    moe = cfg.moe
    assert (moe.num_experts, moe.renormalize_expert_weights) == (4, False) if case == "moe" else moe is None
    tokens, mask, positions = padded_batch()
    ref = hf_logits(model, tokens, mask, positions)
    ours = lmzoo_logits(cfg, params, tokens, mask, positions)
    diff = max_diff(ours, ref, mask)
    print(f"{case}: max |lmzoo - HF| logits {diff:.2e} (float32; logit std {ref.std():.2f})")
    assert diff <= TOL, f"{case}: lmzoo - HF {diff:.3e}"

    back = qwen3_5.to_hf(params, cfg, model_type="qwen3_next")
    if cfg.tie_embeddings:  # save_pretrained leaves the tied copy out
        np.testing.assert_array_equal(back.pop("lm_head.weight"), back["model.embed_tokens.weight"])
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():  # exactly, but for the zero-centred norms' w, which went through 1 + w
        zero_centred = "norm" in key and "linear_attn" not in key
        np.testing.assert_allclose(
            back[key], np.asarray(value), rtol=0, atol=1.2e-7 if zero_centred else 0, err_msg=key
        )

    out = tmp_path / "export"
    if case == "moe":  # top-k weights not renormalised: only Qwen3-Next has them, so export picks it
        assert export.export_hf("qwen3_5", cfg, params, str(out))["model_type"] == "qwen3_next"
    else:  # a dense model is Qwen3.5's by default; Qwen3-Next's when asked (`python -m lmzoo.cli.export --model_type`)
        assert export.hf_model_type("qwen3_5", cfg) == "qwen3_5_text"
        assert export.export_hf("qwen3_5", cfg, params, str(out), model_type="qwen3_next")["model_type"] == "qwen3_next"
        with pytest.raises(ValueError, match="exports to HF model_type 'qwen3_5_text' or 'qwen3_next', not 'llama'"):
            export.export_hf("qwen3_5", cfg, params, str(tmp_path / "refused"), model_type="llama")
        assert not (tmp_path / "refused").exists()
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), experts_implementation="eager").eval()
    assert type(exported) is type(model)
    assert max_diff(hf_logits(exported, tokens, mask, positions), ref, mask) <= 1e-5


@pytest.mark.parity
def test_cached_decode_matches_the_forward_and_hf_generation(tmp_path):
    """The recurrent decode (prefill of 5, then a token at a time against the cache, scanned groups, experts) gives
    the forward's logits at every position; greedy generation from left-padded prompts gives HF generate's tokens."""
    model, _, cfg, params = converted(tmp_path, "moe")
    lm = build_model("qwen3_5", cfg)
    tokens = jnp.asarray(padded_batch()[0][:2, :9])
    full = jax.jit(lm.apply)({"params": params}, tokens)
    step = jax.jit(
        lambda cache, chunk, positions: lm.apply(
            {"params": params, "cache": cache}, chunk, positions=positions, decode=True, mutable=["cache"]
        )
    )
    logits, variables = step(slots.init_cache(lm, 2, 9), tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)))
    outs = [logits]
    for t in range(5, 9):
        logits, variables = step(variables["cache"], tokens[:, t : t + 1], jnp.full((2, 1), t))
        outs.append(logits)
    decode_diff = float(jnp.max(jnp.abs(jnp.concatenate(outs, axis=1) - full)))
    print(f"moe: max |cached decode - forward| logits {decode_diff:.2e}")
    assert decode_diff <= TOL

    prompts, prompt_mask = (a[:, 4:10] for a in padded_batch()[:2])  # 0, 0 and 3 left pads
    ours = decoding.generate(
        lm, params, prompts, prompt_mask=prompt_mask, rng=jax.random.key(0), max_new_tokens=5, temperature=0.0
    )
    with torch.no_grad():
        theirs = model.generate(
            torch.from_numpy(prompts), attention_mask=torch.from_numpy(prompt_mask), max_new_tokens=5, do_sample=False
        )
    np.testing.assert_array_equal(np.asarray(ours), theirs[:, prompts.shape[1] :].numpy())


def test_reads_the_config_as_hf_does():
    """family_of finds the converter; full_attention_interval without layer_types; a model whose every layer is in
    mlp_only_layers is dense; Qwen3NextConfig's defaults (Qwen3-Next-80B-A3B's shape) have HF's parameter count."""
    assert hf.family_of("qwen3_next") == "qwen3_5"
    config = transformers.Qwen3NextConfig(**SHAPE | MOE).to_dict()
    del config["layer_types"]
    fields = qwen3_5.config_from_hf(config | {"full_attention_interval": 2})
    assert fields["layer_types"] == ("linear_attention", "full_attention") * 2 and fields["num_experts"] == 4
    dense = qwen3_5.config_from_hf(config | {"mlp_only_layers": [0, 1, 2, 3]})
    assert "num_experts" not in dense and dense["mlp_dim"] == 40
    with torch.device("meta"):
        reference = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig())
    count = sum(p.numel() for p in reference.parameters())
    fields = qwen3_5.config_from_hf(reference.config.to_dict())
    lm = build_model("qwen3_5", fields | {"scan_layers": True})
    shapes = jax.eval_shape(lambda: lm.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    assert sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nn.unbox(shapes))) == count


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2, mlp_only_layers=\[\]: layers \[0, 2\]"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]: layers \[1\] are dense"),
        ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
        ({"hidden_act": "gelu"}, "HF qwen3_next config has hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'yarn'"),
        ({"architectures": ["Qwen3_5ForCausalLM"]}, "Qwen3NextForCausalLM"),
    ],
)
def test_refuses_what_it_does_not_implement(change, message):
    config = transformers.Qwen3NextConfig(**SHAPE | MOE).to_dict() | change
    with pytest.raises(tables.ConfigError, match=message):
        qwen3_5.config_from_hf(config)


def test_export_refuses_what_qwen3_next_cannot_express():
    """Experts without a shared expert have no Qwen3-Next (nor Qwen3.5-MoE) counterpart; a dense model is not a
    Qwen3.5-MoE."""
    fields = qwen3_5.config_from_hf(transformers.Qwen3NextConfig(**SHAPE | MOE).to_dict())
    with pytest.raises(ValueError, match="shared_expert_mlp_dim=0"):
        qwen3_5.config_to_hf(make_config("qwen3_5", fields | {"shared_expert_mlp_dim": 0}), model_type="qwen3_next")
    dense = make_config(
        "qwen3_5", qwen3_5.config_from_hf(transformers.Qwen3NextConfig(**SHAPE, num_experts=0).to_dict())
    )
    with pytest.raises(ValueError, match="'qwen3_5_text' or 'qwen3_next', not 'qwen3_5_moe_text'"):
        qwen3_5.config_to_hf(dense, model_type="qwen3_5_moe_text")
