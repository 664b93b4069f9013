import functools
import importlib.util
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo import models, testing
from lmzoo.models import seq2seq

TINY = dict(
    vocab_size=32,
    emb_dim=16,
    num_heads=2,
    head_dim=8,
    num_encoder_layers=2,
    num_decoder_layers=2,
    mlp_dim=32,
    dropout_rate=0.0,
    relative_buckets=8,
    relative_max_distance=16,
    max_len=24,
)
VARIANTS = {
    "t5_v1_0": {},
    "t5_v1_1": dict(activations=("gelu_tanh", "linear"), tie_embeddings=False),
    "bart": dict(
        positions="learned",
        position_offset=2,
        pre_norm=False,
        norm="layer",
        use_bias=True,
        embedding_norm=True,
        activations=("gelu",),
        attention_scale=0.0,
        scale_tied_logits=False,
        final_logits_bias=True,
        embedding_init_std=0.02,
        init_scheme="normal",
    ),
    "transformer": dict(
        positions="sinusoidal",
        pre_norm=False,
        norm="layer",
        use_bias=True,
        scale_embeddings=True,
        attention_scale=0.0,
        scale_tied_logits=False,
        embedding_init_std=0.02,
        init_scheme="normal",
    ),
}


def _init(variant):
    model = models.build_model("seq2seq", {**TINY, **VARIANTS[variant]})
    params = nn.unbox(
        model.init(jax.random.key(0), jnp.zeros((2, 7), jnp.int32), jnp.zeros((2, 5), jnp.int32))["params"]
    )
    return model, params


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_shapes_causality_and_cached_decoding(variant):
    model, params = _init(variant)
    inputs, targets = testing.random_tokens((2, 7), seed=1), testing.random_tokens((2, 6), seed=2)
    logits = model.apply({"params": params}, inputs, targets)
    chex.assert_shape(logits, (2, 6, 32))
    changed = targets.copy()
    changed[:, 4:] = (changed[:, 4:] + 3) % 32
    np.testing.assert_allclose(model.apply({"params": params}, inputs, changed)[:, :4], logits[:, :4], atol=1e-5)

    encoded = model.apply({"params": params}, inputs, method=model.encode)
    cache = model.init(jax.random.key(0), inputs, targets, method=_decode_init(model, 6))["cache"]
    steps = []
    for t in range(6):  # the first step fills the cross-attention cache, later ones read it
        out, variables = model.apply(
            {"params": params, "cache": cache},
            targets[:, t : t + 1],
            encoded if t == 0 else None,
            positions=np.full((2, 1), t),
            decode=True,
            max_decode_len=6,
            mutable=["cache"],
            method=model.decode,
        )
        cache = variables["cache"]
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), logits, atol=1e-5)


def _decode_init(model, length):
    def init(module, inputs, targets):
        encoded = module.encode(inputs)
        return module.decode(
            jnp.zeros((inputs.shape[0], length), jnp.int32), encoded, decode=True, max_decode_len=length
        )

    return init


def test_encoder_padding_is_ignored():
    model, params = _init("t5_v1_0")
    inputs, targets = testing.random_tokens((1, 5), seed=3), testing.random_tokens((1, 4), seed=4)
    padded = np.concatenate([inputs, np.zeros((1, 3), np.int32)], axis=1)
    mask = np.array([[1] * 5 + [0] * 3])
    a = model.apply({"params": params}, inputs, targets, encoder_segment_ids=np.ones((1, 5), np.int32))
    b = model.apply({"params": params}, padded, targets, encoder_segment_ids=mask)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_relative_position_buckets_match_t5():
    offsets = jnp.array([-200, -20, -8, -1, 0, 1, 7, 8, 20, 200])
    bi = seq2seq.relative_position_bucket(offsets, bidirectional=True, num_buckets=32, max_distance=128)
    uni = seq2seq.relative_position_bucket(offsets, bidirectional=False, num_buckets=32, max_distance=128)
    # Values printed by transformers' T5Attention._relative_position_bucket for the same offsets.
    np.testing.assert_array_equal(bi, [15, 10, 8, 1, 0, 17, 23, 24, 26, 31])
    np.testing.assert_array_equal(uni, [31, 17, 8, 1, 0, 0, 0, 0, 0, 0])


# (num_buckets, max_distance): T5's default, the five settings where float32 on device put a distance exactly on a
# bucket boundary into the lower bucket, and the tiny test config.
BUCKET_SETTINGS = [(32, 128), (6, 100), (32, 25), (64, 25), (16, 144), (8, 72), (8, 16)]


def reference_distance_buckets(num_buckets: int, max_distance: int) -> np.ndarray:
    """T5's formula for distances 0..max_distance in float64; a value within 1e-9 below an integer is that integer
    (the exact value is on the boundary; floats land on either side of it)."""
    max_exact, distance = num_buckets // 2, np.arange(max_distance + 1)
    scaled = np.log(np.maximum(distance, 1) / max_exact) / np.log(max_distance / max_exact) * (num_buckets - max_exact)
    large = np.minimum(max_exact + np.floor(scaled + 1e-9).astype(int), num_buckets - 1)
    return np.where(distance < max_exact, distance, large)


def test_distance_buckets_match_the_formula_over_a_grid():
    boundaries = 0
    for num_buckets in range(2, 65):
        for max_distance in range(num_buckets // 2 + 1, 161, 3):
            expected = reference_distance_buckets(num_buckets, max_distance)
            buckets = seq2seq.distance_buckets(num_buckets, max_distance)
            np.testing.assert_array_equal(buckets, expected, err_msg=f"{num_buckets=} {max_distance=}")
            max_exact = num_buckets // 2
            ratio = np.log(np.arange(max_exact, max_distance) / max_exact) / np.log(max_distance / max_exact)
            boundaries += int(np.sum(ratio * (num_buckets - max_exact) % 1 > 1 - 1e-9))
    assert (
        boundaries > 0
    )  # the grid holds distances whose float64 value falls just below a boundary: a plain floor fails there
    # max_distance <= num_buckets // 2 (a decoder with (64, 25)): the log buckets are empty, longer distances share the last.
    np.testing.assert_array_equal(seq2seq.distance_buckets(64, 25), np.append(np.arange(32), 63))
    with pytest.raises(ValueError, match="at least 2 buckets per direction"):
        seq2seq.distance_buckets(1, 8)


class RelativePositionBucketTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_buckets_of_offsets_in_both_directions(self):
        for num_buckets, max_distance in BUCKET_SETTINGS:
            offsets = np.arange(-max_distance - 3, max_distance + 4)
            distance = np.minimum(np.abs(offsets), max_distance)
            for bidirectional in (True, False):
                if max_distance <= (num_buckets // 2 if bidirectional else num_buckets) // 2:
                    continue  # no log buckets (a (64, 25) decoder): test_distance_buckets_match_the_formula_over_a_grid
                buckets = self.variant(
                    functools.partial(
                        seq2seq.relative_position_bucket,
                        bidirectional=bidirectional,
                        num_buckets=num_buckets,
                        max_distance=max_distance,
                    )
                )(jnp.asarray(offsets))
                if bidirectional:
                    half = num_buckets // 2
                    expected = reference_distance_buckets(half, max_distance)[distance] + half * (offsets > 0)
                else:
                    expected = np.where(offsets > 0, 0, reference_distance_buckets(num_buckets, max_distance)[distance])
                np.testing.assert_array_equal(
                    buckets, expected, err_msg=f"{num_buckets=} {max_distance=} {bidirectional=}"
                )


def test_inputs_longer_than_a_learned_position_table_raise():
    model, params = _init("bart")  # max_len 24 with position_offset 2: 22 positions
    apply = jax.jit(functools.partial(model.apply, {"params": params}))
    chex.assert_shape(apply(np.zeros((1, 22), np.int32), np.zeros((1, 22), np.int32)), (1, 22, 32))
    with pytest.raises(ValueError, match=r"encoder input length 23 starting at position_offset 2 .*\(max_len=24\)"):
        apply(np.zeros((1, 23), np.int32), np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="decoder input length 23"):
        apply(np.zeros((1, 4), np.int32), np.zeros((1, 23), np.int32))
    encoded = model.apply({"params": params}, np.zeros((1, 4), np.int32), method=model.encode)
    with pytest.raises(ValueError, match="decoder cache length 23"):
        step = jnp.zeros((1, 1), jnp.int32)  # one token at an explicit position: only the cache length can overrun
        model.init(
            jax.random.key(0), step, encoded, positions=step, decode=True, max_decode_len=23, method=model.decode
        )
    for variant in ("t5_v1_0", "transformer"):  # relative and sinusoidal positions have no table to overrun
        model, params = _init(variant)
        long = np.zeros((1, 40), np.int32)
        chex.assert_shape(model.apply({"params": params}, long, long), (1, 40, 32))


@pytest.mark.parametrize(
    "fields, expected",
    [
        # HF t5-small num_parameters().
        (
            dict(
                vocab_size=32128,
                emb_dim=512,
                num_heads=8,
                head_dim=64,
                num_encoder_layers=6,
                num_decoder_layers=6,
                mlp_dim=2048,
            ),
            60_506_624,
        ),
        # HF facebook/bart-base parameters (139,420,416) plus its final_logits_bias buffer (50,265).
        (
            dict(
                VARIANTS["bart"],
                vocab_size=50265,
                emb_dim=768,
                num_heads=12,
                head_dim=64,
                num_encoder_layers=6,
                num_decoder_layers=6,
                mlp_dim=3072,
                max_len=1026,
            ),
            139_470_681,
        ),
    ],
)
def test_published_parameter_counts(fields, expected):
    assert _num_params(fields) == expected


def _num_params(fields) -> int:
    model = models.build_model("seq2seq", fields)
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32))
    )
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(shapes["params"])))


@pytest.mark.parametrize(
    "arg, expected",
    # HF num_parameters() of t5-small, t5-base, google/t5-v1_1-small, google/t5-v1_1-base.
    [("small", 60_506_624), ("base", 222_903_552), ("small,v1_1", 76_961_152), ("base,v1_1", 247_577_856)],
)
def test_t5_configs_have_the_published_shapes(arg, expected):
    spec = importlib.util.spec_from_file_location("t5_config", pathlib.Path(__file__).parents[2] / "configs" / "t5.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert _num_params(dict(module.get_config(arg).model)) == expected


def test_decoding_without_context_needs_a_filled_cache():
    model, params = _init("t5_v1_0")
    with pytest.raises(ValueError, match="cross-attention decoding without a context"):
        model.apply(
            {"params": params},
            np.zeros((2, 1), np.int32),
            None,
            positions=np.zeros((2, 1), np.int32),
            decode=True,
            max_decode_len=4,
            mutable=["cache"],
            method=model.decode,
        )
