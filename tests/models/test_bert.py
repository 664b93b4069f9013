import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo import models, testing
from lmzoo.models import bert, heads

TINY = dict(
    vocab_size=32,
    max_len=16,
    emb_dim=16,
    num_heads=2,
    num_layers=2,
    mlp_dim=32,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
)
VARIANTS = {
    "bert": {},
    "roberta": dict(type_vocab_size=1, position_offset=2, pooler=False, sentence_head=False),
    "albert": dict(embedding_dim=8, share_layers=True, activation="gelu_tanh"),
    "distilbert": dict(type_vocab_size=0, pooler=False, sentence_head=False),
}


def _init(**overrides):
    model = models.build_model("bert", {**TINY, **overrides})
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"])
    return model, params


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_shapes_and_padding_invariance(variant):
    model, params = _init(**VARIANTS[variant])
    tokens = testing.random_tokens((2, 6), vocab_size=32)
    out = model.apply({"params": params}, tokens)
    logits = out[0] if isinstance(out, tuple) else out
    chex.assert_shape(logits, (2, 6, 32))
    padded = np.concatenate([tokens, np.zeros((2, 3), np.int32)], axis=1)
    mask = np.concatenate([np.ones((2, 6)), np.zeros((2, 3))], axis=1).astype(np.int32)
    out_padded = model.apply({"params": params}, padded, segment_ids=mask)
    logits_padded = out_padded[0] if isinstance(out_padded, tuple) else out_padded
    np.testing.assert_allclose(logits_padded[:, :6], logits, atol=1e-5)


def test_bidirectional_attention_sees_the_future():
    model, params = _init(**VARIANTS["distilbert"])
    tokens = testing.random_tokens((1, 8))
    changed = tokens.copy()
    changed[0, -1] = (changed[0, -1] + 1) % 32
    a, b = model.apply({"params": params}, tokens), model.apply({"params": params}, changed)
    assert np.abs(np.asarray(a[0, 0] - b[0, 0])).max() > 1e-4


def test_albert_shares_one_block_and_factorizes_embeddings():
    _, two = _init(**VARIANTS["albert"])
    _, six = _init(**{**VARIANTS["albert"], "num_layers": 6})
    count = lambda p: sum(x.size for x in jax.tree.leaves(p))  # noqa: E731
    assert count(two) == count(six)
    assert list(two["blocks"]) == ["shared"]
    assert two["word_embeddings"]["embedding"].shape == (32, 8)
    assert two["embed_projection"]["kernel"].shape == (8, 16)


def test_roberta_positions_skip_padding():
    model, params = _init(**VARIANTS["roberta"])
    positions = model.apply(
        {"params": params}, jnp.ones((1, 4), jnp.int32), jnp.array([[1, 1, 1, 0]]), method=model._positions
    )
    np.testing.assert_array_equal(positions, [[2, 3, 4, 1]])


def test_distilbert_student_takes_every_other_teacher_layer():
    _, teacher = _init(num_layers=4)
    student = bert.distilbert_student_params(teacher, 4)
    assert sorted(student["blocks"]) == ["layer_0", "layer_1"]
    np.testing.assert_array_equal(
        student["blocks"]["layer_1"]["mlp"]["wi"]["kernel"], teacher["blocks"]["layer_2"]["mlp"]["wi"]["kernel"]
    )
    assert "pooler" not in student and "sentence_classifier" not in student


@pytest.mark.parametrize(
    "name, head, pooling", [("bert", "pooler", "first"), ("bert", "dense_tanh", "mean"), ("gpt2", "linear", "last")]
)
def test_heads(name, head, pooling):
    backbone = models.build_model(name, TINY if name == "bert" else testing.TINY_GPT2)
    tokens = testing.random_tokens((2, 8))
    mask = np.array([[1] * 8, [1] * 5 + [0] * 3], np.int32)
    module = heads.SequenceClassifier(backbone, 3, head=head, pooling=pooling)
    variables = module.init(jax.random.key(0), tokens, segment_ids=mask)
    chex.assert_shape(module.apply(variables, tokens, segment_ids=mask), (2, 3))


def test_gpt_classifier_reads_the_last_real_token():
    hidden = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    pooled = heads.pool(hidden, jnp.array([[1, 1, 1, 1], [1, 1, 0, 0]]), "last")
    np.testing.assert_array_equal(pooled, np.stack([hidden[0, 3], hidden[1, 1]]))


@pytest.mark.parametrize(
    "variant, longest", [("bert", 16), ("roberta", 14)]
)  # max_len 16; RoBERTa starts at position 2
@pytest.mark.parametrize("jit", [False, True])
def test_inputs_longer_than_the_position_table_raise(variant, longest, jit):
    model, params = _init(**VARIANTS[variant])
    encode = functools.partial(model.apply, {"params": params}, method=model.encode)
    encode = jax.jit(encode) if jit else encode
    chex.assert_shape(encode(testing.random_tokens((2, longest)))[0], (2, longest, 16))
    with pytest.raises(ValueError, match=rf"encoder input length {longest + 1}.* \(max_len=16\)"):
        encode(testing.random_tokens((2, longest + 1)))
