"""Parity of lmzoo's encoder-decoder ("seq2seq": T5 v1.0, T5 v1.1, BART) with HuggingFace transformers:
logits, weight and config conversion both ways, greedy decoding and beam search."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import save_file

from lmzoo import decoding
from lmzoo.convert import hf, safetensors_reader, seq2seq
from lmzoo.models import build_model, make_config

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

TOL = 1e-4
VOCAB = 99
PAD = 0
NEW_TOKENS = 8
VARIANTS = ("t5_v1_0", "t5_v1_1", "bart")
# (weight std, embedding std, cross-attention std, seed), found by a small search: small random encoder-decoders
# tend to repeat one token (tied heads copy their input; strong cross-attention ignores it); these emit varied
# tokens that differ between the two inputs, with greedy top-1/top-2 margins far above the parity error.
INIT = {"t5_v1_0": (1.0, 2.0, 0.1, 1), "t5_v1_1": (0.3, 0.5, 0.1, 3), "bart": (1.0, 1.0, 0.1, 1)}
# model_type -> (config_from_hf, from_hf, config_to_hf, to_hf)
CONVERTERS = {
    "t5": (seq2seq.t5_config_from_hf, seq2seq.t5_from_hf, seq2seq.t5_config_to_hf, seq2seq.t5_to_hf),
    "bart": (seq2seq.bart_config_from_hf, seq2seq.bart_from_hf, seq2seq.bart_config_to_hf, seq2seq.bart_to_hf),
}


def model_type(variant: str) -> str:
    return "bart" if variant == "bart" else "t5"


def hf_config(variant: str):
    """A tiny HF config without dropout: 2+2 layers, 4 heads of 8, FFN 64."""
    if variant == "bart":
        return transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=40,
            dropout=0.0,
        )
    v1_1 = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False) if variant == "t5_v1_1" else {}
    return transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        dropout_rate=0.0,
        decoder_start_token_id=PAD,
        **v1_1,
    )


def random_hf_model(variant: str):
    """HF *ForConditionalGeneration in eval mode with every weight random: norms, biases, relative position
    tables, BART's final_logits_bias."""
    prefix = "Bart" if variant == "bart" else "T5"
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(hf_config(variant)).float().eval()
    if variant == "t5_v1_1":
        # transformers 5 ties T5's lm_head to the shared embedding even for v1.1 configs (it unties only when a
        # loaded checkpoint's lm_head differs): give the head its own weights, as v1.1 checkpoints have.
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    std, embedding_std, cross_std, seed = INIT[variant]
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif any(part in name for part in ("shared", "embed", "lm_head")):
                param.normal_(0.0, embedding_std)
            elif "EncDecAttention" in name or "encoder_attn" in name:
                param.normal_(0.0, cross_std)
            else:
                param.normal_(0.0, std)
        if variant == "bart":
            model.final_logits_bias.normal_(0.0, 0.2)
    return model


def numpy_state_dict(model) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}


def convert(model):
    """(lmzoo module, params) of an HF model through the public config and weight converters."""
    config_from_hf, from_hf, _, _ = CONVERTERS[model.config.model_type]
    cfg = make_config("seq2seq", config_from_hf(model.config.to_dict()))
    return build_model("seq2seq", cfg), from_hf(numpy_state_dict(model), cfg)


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """Tiny models: torch's intra-op threads only add synchronisation, which costs ~20 ms per op on a busy host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data() -> dict[str, np.ndarray]:
    """Encoder inputs [2, 10], the second row right-padded (attention mask 0); decoder inputs [2, 6]."""
    rng = np.random.default_rng(0)
    inputs = rng.integers(3, VOCAB, (2, 10))
    mask = np.ones_like(inputs)
    mask[1, 7:] = 0
    inputs[1, 7:] = PAD
    return {"inputs": inputs, "mask": mask, "decoder_inputs": rng.integers(3, VOCAB, (2, 6))}


def hf_logits(model, inputs, mask, decoder_inputs) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(inputs),
            attention_mask=torch.from_numpy(mask),
            decoder_input_ids=torch.from_numpy(decoder_inputs),
        )
    return out.logits.numpy()


def hf_generate(model, data, eos_id, **kwargs):
    """HF generate comparing only the search itself: no forced tokens, n-gram blocking or minimum length."""
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=model.config.decoder_start_token_id,
        eos_token_id=eos_id,
        pad_token_id=PAD,
        bos_token_id=None,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        no_repeat_ngram_size=0,
        min_length=0,
    )
    with torch.no_grad():
        return model.generate(
            torch.from_numpy(data["inputs"]),
            attention_mask=torch.from_numpy(data["mask"]),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            return_dict_in_generate=True,
            **kwargs,
        )


def first_new_token(row: list[int], start: int) -> tuple[int, int]:
    """(step, token) of the first token at step >= start that is not PAD and not earlier in `row`: as EOS, it
    stops that row there."""
    return next((i, token) for i, token in enumerate(row) if i >= start and token != PAD and token not in row[:i])


def new_tokens(sequences, eos_id) -> np.ndarray:
    """HF sequences [B, 1 + n] -> [B, NEW_TOKENS] without the start token, PAD after the first EOS (HF beam
    search fills with EOS when the pad id is 0) and to the full length (HF stops when every row is done)."""
    out = np.full((len(sequences), NEW_TOKENS), PAD)
    out[:, : sequences.shape[1] - 1] = sequences[:, 1:]
    if eos_id is not None:
        is_eos = out == eos_id
        out[np.cumsum(is_eos, axis=1) - is_eos > 0] = PAD
    return out


@pytest.mark.parity
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_hf(variant, data):
    model = random_hf_model(variant)
    module, params = convert(model)
    assert ("lm_head" in params) == (variant == "t5_v1_1")
    apply = jax.jit(lambda p, x, y, m: module.apply({"params": p}, x, y, encoder_segment_ids=m))
    inputs, mask, decoder_inputs = data["inputs"], data["mask"], data["decoder_inputs"]
    unpadded = np.ones_like(mask)
    for name, m in (("unpadded", unpadded), ("padded", mask)):
        ours = np.asarray(apply(params, inputs, decoder_inputs, m))
        ref = hf_logits(model, inputs, m, decoder_inputs)
        diff = float(np.max(np.abs(ours - ref)))
        assert diff <= TOL, f"{variant} ({name}): max |lmzoo - HF| logits = {diff:.3e} (logit std {ref.std():.2f})"


@pytest.mark.parity
@pytest.mark.parametrize("variant", VARIANTS)
def test_to_hf_round_trip(tmp_path, variant, data):
    model = random_hf_model(variant)
    state_dict = numpy_state_dict(model)
    module, params = convert(model)
    _, _, config_to_hf, to_hf = CONVERTERS[model_type(variant)]
    back = to_hf(params, module.config)
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)

    # Export as a checkpoint folder; HF unties the v1.1 head on load because its weights differ.
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(module.config)))
    weights = {key: value for key, value in back.items() if "embed_tokens" not in key}
    save_file(weights, tmp_path / "model.safetensors")
    fresh = type(model).from_pretrained(tmp_path).float().eval()
    args = (data["inputs"], data["mask"], data["decoder_inputs"])
    np.testing.assert_array_equal(hf_logits(fresh, *args), hf_logits(model, *args))


@pytest.mark.parity
def test_v1_1_head_shared_with_the_embedding_loads_as_transformers_saves_it(tmp_path, data):
    """transformers 5 ties a v1.1 T5's head to its embedding unless told otherwise and then saves no lm_head.weight
    (config: tie_word_embeddings True, scale_decoder_outputs False); lmzoo reads it as a tied, unscaled head."""
    model = transformers.T5ForConditionalGeneration(hf_config("t5_v1_1")).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "shared" in name else 0.3)
    assert model.lm_head.weight is model.shared.weight
    model.save_pretrained(tmp_path)
    hf_dict, state_dict = safetensors_reader.read_safetensors_dir(str(tmp_path))
    assert "lm_head.weight" not in state_dict and not hf_dict.get("scale_decoder_outputs", True)
    fields, params = seq2seq.read_checkpoint(hf_dict, state_dict)
    assert fields["tie_embeddings"] and not fields["scale_tied_logits"]
    module = build_model("seq2seq", make_config("seq2seq", fields))
    inputs, mask, decoder_inputs = data["inputs"], data["mask"], data["decoder_inputs"]
    ours = np.asarray(module.apply({"params": params}, inputs, decoder_inputs, encoder_segment_ids=mask))
    assert float(np.max(np.abs(ours - hf_logits(model, inputs, mask, decoder_inputs)))) <= TOL
    exported = seq2seq.t5_config_to_hf(make_config("seq2seq", fields))
    assert exported["tie_word_embeddings"] and not exported["scale_decoder_outputs"]


@pytest.mark.parity
def test_config_round_trip():
    common = dict(
        vocab_size=101,
        emb_dim=48,
        num_heads=6,
        head_dim=8,
        num_encoder_layers=3,
        num_decoder_layers=2,
        mlp_dim=100,
        dropout_rate=0.05,
        decoder_start_id=3,
    )
    t5_common = common | dict(
        relative_buckets=16,
        relative_max_distance=64,
        layer_norm_epsilon=1e-5,
        embedding_init_std=0.5,
        attention_dropout_rate=0.05,
    )
    v1_1 = dict(activations=("gelu_tanh", "linear"), tie_embeddings=False, scale_tied_logits=False)
    configs = {
        "t5": [t5_common, t5_common | v1_1, t5_common | dict(activations=("silu", "linear"))],
        "bart": [
            common
            | dict(
                positions="learned",
                position_offset=2,
                max_len=66,
                pre_norm=False,
                norm="layer",
                use_bias=True,
                embedding_norm=True,
                activations=("gelu",),
                attention_scale=0.0,
                scale_tied_logits=False,
                final_logits_bias=True,
                layer_norm_epsilon=1e-5,
                scale_embeddings=True,
                attention_dropout_rate=0.1,
                embedding_init_std=0.02,
                init_scheme="normal",
            )
        ],
    }
    for family, field_sets in configs.items():
        from_hf, _, to_hf, _ = CONVERTERS[family]
        config_cls = transformers.BartConfig if family == "bart" else transformers.T5Config
        for fields in field_sets:
            cfg = make_config("seq2seq", fields)
            hf_dict = to_hf(cfg)
            assert make_config("seq2seq", from_hf(hf_dict)) == cfg, fields
            assert make_config("seq2seq", from_hf(config_cls(**hf_dict).to_dict())) == cfg, fields

    for variant in VARIANTS:
        hf_dict = hf_config(variant).to_dict()
        from_hf, _, to_hf, _ = CONVERTERS[model_type(variant)]
        fields = from_hf(hf_dict)
        assert (fields["tie_embeddings"], fields["activations"]) == {
            "t5_v1_0": (True, ("relu",)),
            "t5_v1_1": (False, ("gelu_tanh", "linear")),
            "bart": (True, ("gelu",)),
        }[variant]
        rebuilt = type(hf_config(variant))(**to_hf(make_config("seq2seq", fields))).to_dict()
        assert {key for key in hf_dict if rebuilt.get(key) != hf_dict[key]} == {"architectures"}, variant

    t5_dict = hf_config("t5_v1_0").to_dict()
    with pytest.raises(ValueError, match="feed_forward_proj 'gated-swish'"):
        seq2seq.t5_config_from_hf({**t5_dict, "feed_forward_proj": "gated-swish"})
    with pytest.raises(ValueError, match="lacks \\['d_kv'\\]"):
        seq2seq.t5_config_from_hf({key: value for key, value in t5_dict.items() if key != "d_kv"})
    with pytest.raises(ValueError, match="decoder_attention_heads=2 != encoder_attention_heads=4"):
        seq2seq.bart_config_from_hf({**hf_config("bart").to_dict(), "decoder_attention_heads": 2})
    with pytest.raises(ValueError, match=r"no HF t5 equivalent; it needs: norm='rms'.*activations \(ACT,\)"):
        seq2seq.t5_config_to_hf(make_config("seq2seq", dict(norm="layer", activations=("gelu", "linear"))))
    with pytest.raises(ValueError, match="scale_tied_logits"):
        seq2seq.t5_config_to_hf(make_config("seq2seq", dict(tie_embeddings=False, scale_tied_logits=True)))
    with pytest.raises(ValueError, match="no HF bart equivalent; it needs: positions='learned'"):
        seq2seq.bart_config_to_hf(make_config("seq2seq", {}))
    with pytest.raises(ValueError, match=r"seq2seq converter reads \['bart', 't5'\]"):
        seq2seq.read_checkpoint({"model_type": "mt5"}, {})


@pytest.mark.parity
def test_state_dict_key_forms():
    t5 = random_hf_model("t5_v1_0")
    module, reference = convert(t5)
    cfg = module.config
    full = numpy_state_dict(t5)
    # As saved to safetensors: tied copies dropped; old checkpoints also hold a decoder cross-attention table.
    saved = {key: value for key, value in full.items() if "embed_tokens" not in key and key != "lm_head.weight"}
    saved["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = np.zeros((8, 4), np.float32)
    jax.tree.map(np.testing.assert_array_equal, seq2seq.t5_from_hf(saved, cfg), reference)

    lost = "decoder.block.1.layer.2.DenseReluDense.wo.weight"
    with pytest.raises(ValueError, match=rf"unexpected keys \['extra.weight'\], missing keys \['{lost}'\]"):
        seq2seq.t5_from_hf({**{k: v for k, v in saved.items() if k != lost}, "extra.weight": np.zeros(1)}, cfg)
    with pytest.raises(ValueError, match="lm_head.weight different from shared.weight.*T5 v1.1"):
        seq2seq.t5_from_hf({**full, "lm_head.weight": full["lm_head.weight"] + 1.0}, cfg)
    with pytest.raises(ValueError, match=r"shared.weight: \(98, 32\) \(expected \(99, 32\)\)"):
        seq2seq.t5_from_hf({**saved, "shared.weight": np.zeros((98, 32))}, cfg)

    bart = random_hf_model("bart")
    module, reference = convert(bart)
    bare = numpy_state_dict(bart.model)  # BartModel: no "model." prefix, no head, no final_logits_bias
    params = seq2seq.bart_from_hf(bare, module.config)
    np.testing.assert_array_equal(params.pop("final_logits_bias"), np.zeros(VOCAB, np.float32))
    reference.pop("final_logits_bias")
    jax.tree.map(np.testing.assert_array_equal, params, reference)
    with pytest.raises(ValueError, match=r"missing keys \['encoder.layers.0.fc1.bias'\].*without the optional 'model."):
        seq2seq.bart_from_hf({k: v for k, v in bare.items() if k != "encoder.layers.0.fc1.bias"}, module.config)


@pytest.mark.parity
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_matches_hf(variant, data):
    model = random_hf_model(variant)
    module, params = convert(model)
    stop, eos_id = first_new_token(hf_generate(model, data, None).sequences[0, 1:].tolist(), start=2)
    out = hf_generate(model, data, eos_id, output_logits=True)
    expected = new_tokens(out.sequences.numpy(), eos_id)
    logits = np.sort(np.stack([step.numpy() for step in out.logits], axis=1), axis=-1)
    live = np.cumsum(expected == eos_id, axis=1) - (expected == eos_id) == 0
    margin = float(np.min((logits[..., -1] - logits[..., -2])[live[:, : logits.shape[1]]]))
    assert margin > 100 * TOL, f"{variant}: top-1/top-2 logit margin {margin:.2e} is too small to compare argmaxes"

    ours = decoding.generate_seq2seq(
        module,
        params,
        data["inputs"],
        rng=jax.random.key(0),
        max_new_tokens=NEW_TOKENS,
        encoder_segment_ids=data["mask"],
        temperature=0.0,
        eos_id=eos_id,
        pad_id=PAD,
    )
    np.testing.assert_array_equal(np.asarray(ours), expected)
    assert expected[0, stop] == eos_id and np.all(expected[0, stop + 1 :] == PAD)


def check_beam_search(module, params, model, data, *, scan: bool = False):
    """lmzoo beam search equals HF's (tokens exactly, scores to 1e-5) for several length penalties and stopping
    rules, with an EOS chosen so that hypotheses finish at different steps."""
    _, eos_id = first_new_token(hf_generate(model, data, None, num_beams=3).sequences[1, 1:].tolist(), start=1)
    hit_eos = False
    for length_penalty, early_stopping in ((1.0, True), (0.6, True), (1.0, False), (1.5, "never")):
        out = hf_generate(
            model,
            data,
            eos_id,
            num_beams=3,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            output_scores=True,
        )
        expected = new_tokens(out.sequences.numpy(), eos_id)
        tokens, scores = decoding.beam_search(
            module,
            params,
            data["inputs"],
            beam_size=3,
            max_new_tokens=NEW_TOKENS,
            eos_id=eos_id,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            pad_id=PAD,
            encoder_segment_ids=data["mask"],
        )
        setting = f"length_penalty={length_penalty}, early_stopping={early_stopping}, scan={scan}"
        np.testing.assert_array_equal(np.asarray(tokens), expected, err_msg=setting)
        np.testing.assert_allclose(np.asarray(scores), out.sequences_scores.numpy(), atol=1e-5, err_msg=setting)
        hit_eos |= bool(np.any(expected[:, :-1] == eos_id))
    assert hit_eos, "no hypothesis ended with EOS before max_new_tokens; the pool logic went untested"


@pytest.mark.parity
@pytest.mark.parametrize("variant", VARIANTS)
def test_beam_search_matches_hf(variant, data):
    model = random_hf_model(variant)
    module, params = convert(model)
    check_beam_search(module, params, model, data)


@pytest.mark.parity
def test_load_pretrained_scanned(tmp_path, data):
    """A saved T5 through load_pretrained("hf:PATH") into a scan_layers model: logits, beam search (cache
    [layers, B*K, ...]) and the way back to HF."""
    model = random_hf_model("t5_v1_0")
    model.save_pretrained(tmp_path, safe_serialization=True)
    hf_dict, state_dict = safetensors_reader.read_safetensors_dir(tmp_path)
    fields = seq2seq.t5_config_from_hf(hf_dict)
    module = build_model("seq2seq", fields | {"scan_layers": True})
    tokens = jnp.zeros((1, 4), jnp.int32)
    target = nn.unbox(jax.eval_shape(lambda: module.init(jax.random.key(0), tokens, tokens)["params"]))
    params, _ = hf.convert_pretrained(f"hf:{tmp_path}", "seq2seq", module.config, target)
    assert set(params["encoder"]) == set(params["decoder"]) == {"layers"}
    args = (data["inputs"], data["mask"], data["decoder_inputs"])
    ours = jax.jit(module.apply)({"params": params}, args[0], args[2], encoder_segment_ids=args[1])
    diff = float(np.max(np.abs(np.asarray(ours) - hf_logits(model, *args))))
    assert diff <= TOL, f"max |lmzoo(scan) - HF| logits = {diff:.3e}"
    back = seq2seq.t5_to_hf(params, module.config)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    check_beam_search(module, params, model, data, scan=True)


@pytest.mark.parametrize("variant", ["t5_v1_0", "t5_v1_1"])
def test_fresh_t5_init_matches_hf_init_scales(variant):
    """lmzoo's own T5 initialisation draws every tensor with the std HF's `_init_weights` uses (fan-in scaled
    kernels, queries (D H) ** -0.5, embeddings / untied head 1.0): compared tensor by tensor through the converter."""
    config = transformers.T5Config(
        **{**hf_config(variant).to_dict(), "d_model": 64, "d_ff": 256, "d_kv": 16, "vocab_size": 512}
    )
    torch.manual_seed(0)
    reference = transformers.T5ForConditionalGeneration(config).float()
    if variant == "t5_v1_1":
        reference.lm_head.weight = torch.nn.Parameter(
            torch.randn_like(reference.lm_head.weight) * config.initializer_factor
        )
    model, hf_params = convert(reference)
    fresh = nn.unbox(
        model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))["params"]
    )
    flat_fresh = {"/".join(k): v for k, v in traverse_util.flatten_dict(fresh).items()}
    flat_hf = {"/".join(k): v for k, v in traverse_util.flatten_dict(hf_params).items()}
    assert flat_fresh.keys() == flat_hf.keys()
    for name, value in flat_fresh.items():
        expected = float(np.std(flat_hf[name]))
        if "scale" in name.split("/")[-1]:
            np.testing.assert_array_equal(value, flat_hf[name], err_msg=name)
        elif value.size >= 256:  # the [buckets, heads] relative tables are too small for a std estimate
            np.testing.assert_allclose(float(np.std(value)), expected, rtol=0.15, err_msg=name)
