"""Parity of lmzoo's GPT-2 with HuggingFace transformers through `lmzoo.convert.gpt2` and `lmzoo.convert.hf`."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo.convert import gpt2, hf, safetensors_reader
from lmzoo.decoding import generate
from lmzoo.models import build_model, make_config

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

TOL = 1e-4
VOCAB = 97


def random_hf_model(tie: bool = True, seed: int = 0):
    """A small float32 GPT2LMHeadModel in eval mode with every weight random (LayerNorms and biases too)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_embd=64,
        n_head=4,
        n_layer=2,
        n_positions=32,
        vocab_size=VOCAB,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.GPT2LMHeadModel(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 0.15)
    return model


def numpy_state_dict(model) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}


def lmzoo_config(model, **overrides):
    return make_config("gpt2", {**gpt2.config_from_hf(model.config.to_dict()), **overrides})


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def target_params(cfg):
    model = build_model("gpt2", cfg)
    return nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, (2, 16), dtype=np.int64)


@pytest.mark.parity
@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_hf(tokens, tie):
    model = random_hf_model(tie)
    cfg = lmzoo_config(model)
    params = gpt2.from_hf(numpy_state_dict(model), cfg)
    assert ("lm_head" in params) == (not tie)
    ours = np.asarray(build_model("gpt2", cfg).apply({"params": params}, jnp.asarray(tokens)))
    ref = hf_logits(model, tokens)
    diff = float(np.max(np.abs(ours - ref)))
    assert diff <= TOL, f"max |lmzoo - HF| logits = {diff:.3e} (tie={tie}, logit std {ref.std():.2f})"


@pytest.mark.parity
@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_load_pretrained_safetensors_scanned(tmp_path, tokens, max_shard_size):
    model = random_hf_model()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size is not None)
    hf_config, state_dict = safetensors_reader.read_safetensors_dir(tmp_path)
    assert hf_config["n_embd"] == 64 and "transformer.wte.weight" in state_dict
    cfg = lmzoo_config(model, scan_layers=True)
    params, report = hf.convert_pretrained(f"hf:{tmp_path}", "gpt2", cfg, target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    assert set(params["blocks"]) == {"layers"}
    assert params["blocks"]["layers"]["attn"]["query"]["kernel"].shape == (2, 64, 4, 16)
    ours = np.asarray(build_model("gpt2", cfg).apply({"params": params}, jnp.asarray(tokens)))
    diff = float(np.max(np.abs(ours - hf_logits(model, tokens))))
    assert diff <= TOL, f"max |lmzoo(scan) - HF| logits = {diff:.3e}"
    back = gpt2.to_hf(params, cfg)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)


@pytest.mark.parity
@pytest.mark.parametrize("tie", [True, False])
def test_to_hf_round_trip(tokens, tie):
    model = random_hf_model(tie)
    cfg = lmzoo_config(model)
    state_dict = numpy_state_dict(model)
    params = gpt2.from_hf(state_dict, cfg)
    back = gpt2.to_hf(params, cfg)
    assert list(back) == list(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)

    fresh = transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2.config_to_hf(cfg))).float().eval()
    result = fresh.load_state_dict({key: torch.from_numpy(value) for key, value in back.items()}, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    np.testing.assert_array_equal(hf_logits(fresh, tokens), hf_logits(model, tokens))


@pytest.mark.parity
def test_config_round_trip():
    cfg = make_config(
        "gpt2",
        dict(
            vocab_size=101,
            max_len=48,
            emb_dim=96,
            num_heads=6,
            num_layers=3,
            mlp_dim=200,
            dropout_rate=0.05,
            attention_dropout_rate=0.2,
            tie_embeddings=False,
            activation="relu",
            layer_norm_epsilon=1e-6,
        ),
    )
    assert make_config("gpt2", gpt2.config_from_hf(gpt2.config_to_hf(cfg))) == cfg
    hf_dict = random_hf_model().config.to_dict()
    fields = gpt2.config_from_hf(hf_dict)
    assert fields["mlp_dim"] == 256 and fields["activation"] == "gelu_tanh" and fields["tie_embeddings"]
    again = gpt2.config_to_hf(make_config("gpt2", fields))
    assert {key: hf_dict[key] for key in again if key not in ("n_inner", "architectures")} == {
        key: value for key, value in again.items() if key not in ("n_inner", "architectures")
    }
    with pytest.raises(ValueError, match="pre-norm"):
        gpt2.config_to_hf(make_config("gpt2", dict(pre_norm=False)))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        gpt2.config_from_hf({**hf_dict, "scale_attn_by_inverse_layer_idx": True})


@pytest.mark.parity
def test_state_dict_key_forms():
    model = random_hf_model()
    cfg = lmzoo_config(model)
    full = numpy_state_dict(model)
    reference = gpt2.from_hf(full, cfg)
    bare = {key.removeprefix("transformer."): value for key, value in full.items() if key != "lm_head.weight"}
    bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), bool))
    bare["h.1.attn.masked_bias"] = np.array(-1e4, np.float32)
    jax.tree.map(np.testing.assert_array_equal, gpt2.from_hf(bare, cfg), reference)
    with pytest.raises(ValueError, match=r"unexpected keys \['extra.weight'\].*missing keys \['h.1.mlp.c_fc.bias'\]"):
        broken = {key: value for key, value in bare.items() if key != "h.1.mlp.c_fc.bias"}
        gpt2.from_hf({**broken, "extra.weight": np.zeros(1)}, cfg)
    with pytest.raises(ValueError, match="tie_embeddings: False"):
        gpt2.from_hf({**full, "lm_head.weight": full["lm_head.weight"] + 1.0}, cfg)


@pytest.mark.parity
def test_errors(tmp_path):
    model = random_hf_model()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(model.config.to_dict()))
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"(?s)pickle.*safetensors"):
        safetensors_reader.read_safetensors_dir(pickled)
    with pytest.raises(ValueError, match=r"(?s)pickle.*safetensors"):
        hf.convert_pretrained(f"hf:{pickled}", "gpt2", {}, {})

    saved = tmp_path / "saved"
    model.save_pretrained(saved, safe_serialization=True)
    small = lmzoo_config(model, emb_dim=32)
    with pytest.raises(ValueError, match=r"(?s)wte/embedding: checkpoint \(97, 64\) vs model \(97, 32\).*emb_dim: 64"):
        hf.convert_pretrained(f"hf:{saved}", "gpt2", small, target_params(small))
    untied = lmzoo_config(model, tie_embeddings=False)
    with pytest.raises(ValueError, match="lm_head/kernel: not in the checkpoint"):
        hf.convert_pretrained(f"hf:{saved}", "gpt2", untied, target_params(untied))

    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        safetensors_reader.read_safetensors_dir(missing)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        hf.convert_pretrained(f"hf:{missing}", "gpt2", {}, {})
    with pytest.raises(ValueError, match="hf:PATH"):
        hf.convert_pretrained(str(saved), "gpt2", {}, {})
    with pytest.raises(ValueError, match="no HF converter"):
        hf.convert_pretrained(f"hf:{saved}", "t5", {}, {})


@pytest.mark.parity
def test_greedy_generation_matches_hf():
    model = random_hf_model()
    cfg = lmzoo_config(model)
    params = gpt2.from_hf(numpy_state_dict(model), cfg)
    prompts = np.random.default_rng(1).integers(0, VOCAB, (2, 5), dtype=np.int64)
    ours = generate(build_model("gpt2", cfg), params, prompts, rng=jax.random.key(0), max_new_tokens=8, temperature=0.0)
    with torch.no_grad():
        mask = torch.ones(2, 5, dtype=torch.long)
        out = model.generate(torch.from_numpy(prompts), attention_mask=mask, max_new_tokens=8, do_sample=False)
    np.testing.assert_array_equal(np.asarray(ours), out[:, 5:].numpy())
