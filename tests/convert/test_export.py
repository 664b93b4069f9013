"""Export to HF folders: transformers' from_pretrained gives the lmzoo model's logits (language models, sequence
classifiers, a PPO policy's decoder), AutoTokenizer its ids; models HF cannot express are refused."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lmzoo
from lmzoo import config as config_lib
from lmzoo import testing, tokenizers
from lmzoo.cli import export as cli_export
from lmzoo.convert import bert, export, seq2seq
from lmzoo.models import build_model, heads, make_config
from lmzoo.objectives import classify
from lmzoo.rl import reward
from lmzoo.train import loop

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENCODER = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_hidden_layers=2,
    intermediate_size=37,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    vocab_size=40,
    max_position_embeddings=24,
)
HF_CONFIGS = {
    "bert": lambda: transformers.BertConfig(**ENCODER),
    "roberta": lambda: transformers.RobertaConfig(**ENCODER, type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5),
    "albert": lambda: transformers.AlbertConfig(**ENCODER | dict(num_attention_heads=2), embedding_size=16),
    "distilbert": lambda: transformers.DistilBertConfig(
        vocab_size=40,
        max_position_embeddings=24,
        dim=32,
        n_heads=4,
        n_layers=2,
        hidden_dim=37,
        dropout=0.0,
        attention_dropout=0.0,
    ),
    "t5": lambda: transformers.T5Config(
        vocab_size=40,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    ),
    "bart": lambda: transformers.BartConfig(
        vocab_size=40,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=40,
        dropout=0.0,
    ),
}


def lmzoo_fields(model_type: str) -> tuple[str, dict]:
    """(model_name, config.model fields) of a tiny model of each HF type, as an lmzoo config file would set them."""
    if model_type == "gpt2":
        return "gpt2", dict(testing.TINY_GPT2)
    hf = HF_CONFIGS[model_type]().to_dict()
    if model_type in ("t5", "bart"):
        return "seq2seq", (seq2seq.t5_config_from_hf if model_type == "t5" else seq2seq.bart_config_from_hf)(hf)
    return "bert", bert.config_from_hf(hf, pooler=False, sentence_head=False)


def perturbed_params(model, *inputs):
    """Fresh params plus noise, so norms and biases differ from their init (ones and zeros) too."""
    params = nn.unbox(model.init(jax.random.key(0), *inputs)["params"])
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(
        treedef, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    )


@pytest.mark.parity
@pytest.mark.parametrize("model_type", ["gpt2", "bert", "roberta", "albert", "distilbert", "t5", "bart"])
def test_exported_folder_loads_in_transformers_with_the_same_logits(tmp_path, model_type):
    model_name, fields = lmzoo_fields(model_type)
    model = build_model(model_name, fields)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 32, (2, 9)).astype(np.int32)
    decoder_tokens = rng.integers(3, 32, (2, 5)).astype(np.int32)
    inputs = (tokens, decoder_tokens) if model_name == "seq2seq" else (tokens,)
    params = perturbed_params(model, *map(jnp.asarray, inputs))
    summary = export.export_hf(model_name, fields, params, str(tmp_path))
    assert summary["model_type"] == model_type and (tmp_path / "config.json").exists()

    auto = {"gpt2": transformers.AutoModelForCausalLM, "seq2seq": transformers.AutoModelForSeq2SeqLM}.get(
        model_name, transformers.AutoModelForMaskedLM
    )
    hf_model = auto.from_pretrained(str(tmp_path)).eval()
    assert hf_model.config.model_type == model_type
    with torch.no_grad():
        if model_name == "seq2seq":
            theirs = hf_model(
                input_ids=torch.from_numpy(tokens).long(), decoder_input_ids=torch.from_numpy(decoder_tokens).long()
            ).logits
        else:
            theirs = hf_model(input_ids=torch.from_numpy(tokens).long()).logits
    ours = model.apply({"params": params}, *map(jnp.asarray, inputs))
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parity
@pytest.mark.parametrize("model_type", ["gpt2", "bert", "roberta", "albert", "distilbert"])
def test_exported_sequence_classifier_gives_the_same_logits_and_labels(tmp_path, model_type):
    """A `classify` model (configs/sst2.py; gpt2: its :gpt variant, byte tokens plus three markers, a right-padded
    row read at its last real token) -> *ForSequenceClassification with num_labels and id2label."""
    model_name, fields = lmzoo_fields(model_type)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 32, (2, 9)).astype(np.int32)
    tokenizer = None
    if model_type == "gpt2":
        tokenizer = tokenizers.build_tokenizer("byte")
        fields = dict(fields, vocab_size=tokenizer.vocab_size + 3)
        tokens[1, 6:] = tokenizer.pad_id
        classifier = heads.SequenceClassifier(build_model("gpt2", fields), 3, head="linear", pooling="last")
    else:
        fields = dict(fields, pooler=model_type in ("bert", "albert"))
        classifier = heads.SequenceClassifier(build_model("bert", fields), 3, head=bert.CLASSIFIER_HEADS[model_type])
    segment_ids = jnp.asarray(tokens != (tokenizer.pad_id if tokenizer else -1), jnp.int32)
    params = perturbed_params(classifier, jnp.asarray(tokens))
    labels = ["negative", "neutral", "positive"]
    summary = export.export_hf(
        model_name, fields, params, str(tmp_path), tokenizer, classifier=classifier, labels=labels
    )
    assert summary["architecture"].endswith("ForSequenceClassification") and summary["labels"] == labels

    hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).eval()
    assert hf_model.config.num_labels == 3 and hf_model.config.id2label == dict(enumerate(labels))
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    ours = np.asarray(classifier.apply({"params": params}, jnp.asarray(tokens), segment_ids=segment_ids))
    assert ours.shape == theirs.shape == (2, 3)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parity
def test_a_classify_workdir_exports_its_classifier(tmp_path):
    """train.py's configs/sst2.py:gpt,tiny on a small TSV, then `python -m lmzoo.cli.export --labels=...`."""
    sentences = ["a charming and affecting journey", "bleak and desperate", "the acting is terrible", "great fun"]
    tsv = "sentence\tlabel\n" + "".join(f"{s}\t{i % 3 == 0:d}\n" for i, s in enumerate(sentences * 8))
    for split in ("train", "dev"):
        (tmp_path / f"{split}.tsv").write_text(tsv)
    config = config_lib.load_config_file(ROOT / "configs" / "sst2.py", "gpt,tiny")
    config.data.train_path, config.data.validation_path = str(tmp_path / "train.tsv"), str(tmp_path / "dev.tsv")
    loop.train_and_evaluate(config, str(tmp_path / "run"))
    summary = cli_export.export_workdir(str(tmp_path / "run"), str(tmp_path / "hf"), labels=["negative", "positive"])
    assert summary["architecture"] == "GPT2ForSequenceClassification" and summary["step"] == config.train.steps

    loaded = lmzoo.load(str(tmp_path / "run"))
    batch = classify.classification_examples(
        [(s,) for s in sentences], np.zeros(4, np.int32), loaded.tokenizer, config.data.seq_len, "gpt"
    )
    assert (batch["segment_ids"] == 0).any()  # right-padded rows, read at their [EXTRACT] token
    ours = loaded.model.apply({"params": loaded.params}, jnp.asarray(batch["tokens"]), segment_ids=batch["segment_ids"])
    hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf_model.config.id2label == {0: "negative", 1: "positive"}
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.from_numpy(batch["tokens"]).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parity
@pytest.mark.parametrize("value", ["head", "value_model"])
def test_a_ppo_policy_exports_its_decoder(tmp_path, value):
    decoder = build_model("gpt2", testing.TINY_GPT2)
    if value == "head":
        policy = heads.LMWithValueHead(decoder)
    else:  # configs/hh_ppo.py:value_model
        policy = heads.LMWithValueModel(decoder, reward.value_model(build_model("gpt2", testing.TINY_GPT2)))
    ids = np.random.default_rng(0).integers(3, 32, (2, 9))
    tokens = jnp.asarray(ids, jnp.int32)
    params = perturbed_params(policy, tokens)
    decoder_params, classifier = export.exported_part(policy, params)
    assert classifier is None
    export.export_hf("gpt2", testing.TINY_GPT2, decoder_params, str(tmp_path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(policy.apply({"params": params}, tokens)[0]), theirs, atol=1e-4, rtol=1e-4)


def test_hf_tokenizer_files_load_with_autotokenizer(tmp_path):
    import tokenizers as hf

    bpe = hf.Tokenizer(hf.models.BPE())
    bpe.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["the movie was great", "the plot was terrible", "a great cast"] * 20, trainer)
    tokenizer = tokenizers.HFTokenizer(bpe)
    fields = dict(testing.TINY_GPT2, vocab_size=tokenizer.vocab_size)
    model = build_model("gpt2", fields)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    summary = export.export_hf("gpt2", fields, params, str(tmp_path), tokenizer)
    assert summary["tokenizer"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "the cast was great, the plot terrible"
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text)
    assert hf_tokenizer.eos_token_id == tokenizer.eos_id and hf_tokenizer.decode(tokenizer.encode(text)) == text


def test_unexportable_models_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="exportable families"):
        export.hf_model_type("ngram", None)
    fields = dict(testing.TINY_GPT2, pre_norm=False)
    with pytest.raises(ValueError, match="pre-norm"):
        export.export_hf("gpt2", fields, {}, str(tmp_path))
    assert make_config("gpt2", fields).pre_norm is False and not (tmp_path / "config.json").exists()
    _, encoder = lmzoo_fields("bert")
    # configs/hh_rm.py:minilm: a scalar head on an encoder's last real token
    last_token = heads.SequenceClassifier(build_model("bert", encoder), 1, head="linear", pooling="last")
    with pytest.raises(ValueError, match="head='linear', pooling='last' has no HF .*reads head='pooler'"):
        export.export_hf("bert", encoder, {"backbone": {}}, str(tmp_path), classifier=last_token)
    with pytest.raises(ValueError, match="pass the SequenceClassifier"):
        export.export_hf("bert", encoder, {"backbone": {}, "classifier": {}}, str(tmp_path))
    with pytest.raises(ValueError, match="--labels gives 3 names; the run's classifier has 1 classes"):
        export.export_hf("bert", encoder, {}, str(tmp_path), classifier=last_token, labels=["a", "b", "c"])


def test_a_model_type_a_family_does_not_write_is_refused():
    """`export.hf_model_type(..., model_type)`: a family that writes one model_type for a config refuses any other."""
    cfg = make_config("gpt2", testing.TINY_GPT2)
    assert export.hf_model_type("gpt2", cfg, "gpt2") == "gpt2"
    with pytest.raises(ValueError, match="a gpt2 of this config exports to HF model_type 'gpt2', not 'qwen3_next'"):
        export.hf_model_type("gpt2", cfg, "qwen3_next")
