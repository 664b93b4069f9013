"""Every family declares what it is; evaluation dispatches on that, not on classes."""

import pathlib

import chex
import flax.linen as nn
import jax
import numpy as np
import pytest

from lmzoo import config as config_lib
from lmzoo import decoding, lora, models, testing
from lmzoo.evaluation import scoring
from lmzoo.models import kinds

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY_LLAMA = dict(vocab_size=61, max_len=16, emb_dim=16, num_heads=2, num_kv_heads=1, num_layers=2, mlp_dim=24)

EXPECTED = {
    "gpt2": kinds.DECODER,
    "llama": kinds.DECODER,
    "deepseek": kinds.DECODER,
    "qwen3_5": kinds.DECODER,
    "bert": kinds.ENCODER,
    "seq2seq": kinds.ENCODER_DECODER,
    "lstm": kinds.RECURRENT,
    "vae_lm": kinds.LATENT,
    "elmo": kinds.RECURRENT,
    "ngram": kinds.COUNTED,
}


def test_every_registered_family_declares_its_kind():
    assert set(EXPECTED) == set(models.REGISTRY)
    for name, (_, module) in models.REGISTRY.items():
        declared = module.kind if name != "ngram" else models.REGISTRY[name][0].kind
        assert declared == EXPECTED[name], name


def test_scoring_asks_for_the_kind():
    decoder = models.build_model("gpt2", testing.TINY_GPT2)
    assert kinds.kind_of(decoder) == kinds.DECODER
    assert scoring.max_positions(decoder) == testing.TINY_GPT2["max_len"]

    class Unknown:
        config = None

    with pytest.raises(ValueError, match="cannot score continuations"):
        scoring.loglikelihoods(Unknown(), {}, [([1], [2])])


# (family, config file of its `tiny` model, scanned here): each decoder family, Gemma's pattern of layer kinds.
SCANNED_DECODERS = [
    ("llama", "gemma3.py"),
    ("llama", "gpt_oss.py"),
    ("deepseek", "deepseek_v3.py"),
    ("qwen3_5", "qwen3_5.py"),
]


@pytest.mark.parametrize(("family", "config_file"), SCANNED_DECODERS, ids=[c[1] for c in SCANNED_DECODERS])
def test_decoding_form_loops_a_scanned_stack_with_the_same_logits_and_replies(family, config_file):
    """`kinds.decoding_form` gives the same model looped, its params split per layer (in `jax.jit` too), with the
    scanned model's logits and greedy replies (KV cache)."""
    config = config_lib.load_config_file(ROOT / "configs" / config_file, "tiny")
    model = models.build_model(family, dict(config.model.to_dict(), max_len=32, scan_layers=True))
    tokens = testing.random_tokens((2, 9), vocab_size=model.config.vocab_size)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    looped, split = kinds.decoding_form(model, params)
    assert type(looped) is type(model) and not looped.config.scan_layers
    assert not any("layers" in jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(split))
    chex.assert_trees_all_equal(jax.jit(lambda p: kinds.decoding_form(model, p)[1])(params), split)
    np.testing.assert_allclose(
        looped.apply({"params": split}, tokens), model.apply({"params": params}, tokens), atol=1e-5, rtol=1e-5
    )
    replies = [
        decoding.generate(m, p, tokens, rng=jax.random.key(0), max_new_tokens=6, temperature=0.0)
        for m, p in ((model, params), (looped, split))
    ]
    np.testing.assert_array_equal(*replies)


def test_decoding_form_merges_attached_lora_adapters_and_leaves_a_looped_model_alone():
    """A scanned stack carrying attached adapters (LoRA's training form) decodes with them merged: the looped form's
    logits equal the merged params' (`lora.merge`); a looped model comes back as it is."""
    config = lora.LoraConfig("query|key|value|out|wi_0|wi_1|wo", rank=2, alpha=4.0)
    model = models.build_model("llama", dict(TINY_LLAMA, scan_layers=True))
    tokens = testing.random_tokens((2, 8), vocab_size=model.config.vocab_size)
    boxed = model.init(jax.random.key(0), tokens)["params"]
    base = nn.unbox(boxed)
    adapters = jax.tree.map(lambda x: x + 0.1, nn.unbox(lora.init_adapters(jax.random.key(1), boxed, config)))
    looped, split = kinds.decoding_form(model, lora.attach(base, adapters, config))
    assert not any("lora" in jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(split))
    np.testing.assert_allclose(
        looped.apply({"params": split}, tokens),
        model.apply({"params": lora.merge(base, adapters, config)}, tokens),
        atol=1e-5,
    )
    unscanned = models.build_model("llama", dict(TINY_LLAMA, scan_layers=False))
    same_model, same_params = kinds.decoding_form(unscanned, base)
    assert same_model is unscanned and same_params is base


WINDOW_DECODERS = [
    ("gpt2", None),
    ("llama", None),
    ("llama", "gemma3.py"),
    ("deepseek", "deepseek_v3.py"),
    ("qwen3_5", "qwen3_5.py"),
]


@pytest.mark.parametrize(("family", "config_file"), WINDOW_DECODERS, ids=[f"{f}-{c}" for f, c in WINDOW_DECODERS])
def test_window_logits_are_the_full_logits_of_those_positions_and_compile_no_others(family, config_file):
    """`window_logits` gives the logits of positions start..end-1 (tied and untied heads) and the final hidden
    states the full call gives; compiled, no [B·T, V] logits are computed (vocabularies unlike any other width)."""
    if config_file is None:
        model = models.build_model(family, dict(testing.TINY_GPT2, vocab_size=37) if family == "gpt2" else TINY_LLAMA)
    else:
        config = config_lib.load_config_file(ROOT / "configs" / config_file, "tiny")
        model = models.build_model(family, dict(config.model.to_dict(), max_len=32))
    batch, length, window = 3, 10, (4, 9)
    tokens = testing.random_tokens((batch, length), vocab_size=model.config.vocab_size)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    full_logits, full_hidden = model.apply({"params": params}, tokens, return_hidden=True)
    windowed = jax.jit(lambda p, t: model.apply({"params": p}, t, window, method="window_logits"))
    logits, hidden = windowed(params, tokens)
    assert logits.shape == (batch, window[1] - window[0], model.config.vocab_size)
    np.testing.assert_allclose(logits, full_logits[:, window[0] : window[1]], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(hidden, full_hidden, atol=1e-5)
    program = windowed.lower(params, tokens).compile().as_text()
    vocab = model.config.vocab_size
    assert f"[{batch * length},{vocab}]" not in program and f"[{batch},{length},{vocab}]" not in program


def test_window_logits_read_a_lora_adapted_head():
    """Under LoRA's training form (`lora.attach`) with the LM head among the targets, the window's logits are those
    of the merged params."""
    config = lora.LoraConfig("query|value|lm_head", rank=2, alpha=4.0)
    model = models.build_model("llama", TINY_LLAMA)
    tokens = testing.random_tokens((2, 8), vocab_size=model.config.vocab_size)
    boxed = model.init(jax.random.key(0), tokens)["params"]
    base = nn.unbox(boxed)
    adapters = jax.tree.map(lambda x: x + 0.1, nn.unbox(lora.init_adapters(jax.random.key(1), boxed, config)))
    with lora.training_form(config, train=False):
        logits, _ = model.apply({"params": lora.attach(base, adapters, config)}, tokens, (2, 7), method="window_logits")
    merged = model.apply({"params": lora.merge(base, adapters, config)}, tokens)
    np.testing.assert_allclose(logits, merged[:, 2:7], atol=1e-5)
