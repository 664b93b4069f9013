import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo import decoding, kernels, models, testing
from lmzoo.layers import embeddings

TINY = dict(vocab_size=61, max_len=32, emb_dim=24, num_heads=6, num_kv_heads=2, head_dim=8, num_layers=2, mlp_dim=40)


def tiny_llama(**overrides):
    model = models.build_model("llama", {**TINY, **overrides})
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    return model, params


def test_parameter_shapes_follow_grouped_query_attention():
    model, params = tiny_llama()
    attn = params["blocks"]["layer_0"]["attn"]
    assert attn["query"]["kernel"].shape == (24, 6, 8)
    assert attn["key"]["kernel"].shape == attn["value"]["kernel"].shape == (24, 2, 8)  # K heads, head_dim != D / N
    assert attn["out"]["kernel"].shape == (6, 8, 24)
    assert "bias" not in attn["query"] and "bias" not in attn["out"]
    assert set(params["blocks"]["layer_0"]["mlp"]) == {"wi_0", "wi_1", "wo"}  # SwiGLU: gate, up, down
    assert set(params) == {"embed", "blocks", "norm", "lm_head"}  # untied head
    _, qwen = tiny_llama(qkv_bias=True)
    assert "bias" in qwen["blocks"]["layer_0"]["attn"]["key"] and "bias" not in qwen["blocks"]["layer_0"]["attn"]["out"]


def test_grouped_query_attention_equals_repeated_kv_heads():
    """A GQA model equals the multi-head model whose kv kernels repeat each kv head for its group of queries."""
    model, params = tiny_llama()
    full = models.build_model("llama", {**TINY, "num_kv_heads": 6})
    repeated = jax.tree.map(lambda x: x, params)
    for i in range(2):
        attn = repeated["blocks"][f"layer_{i}"]["attn"]
        for name in ("key", "value"):
            attn[name] = {"kernel": jnp.repeat(attn[name]["kernel"], 3, axis=1)}
    tokens = testing.random_tokens((2, 12), vocab_size=61)
    np.testing.assert_allclose(
        model.apply({"params": params}, tokens), full.apply({"params": repeated}, tokens), atol=1e-5
    )


def test_rotary_is_relative():
    """q.k after rotation depends on the positions' difference only."""
    rotary = embeddings.Rotary(10_000.0)
    q, k = (jax.random.normal(key, (1, 1, 1, 8)) for key in jax.random.split(jax.random.key(1)))

    def score(pq, pk):
        return jnp.sum(
            rotary(q, rotary.rotation(jnp.array([[pq]]), 8)) * rotary(k, rotary.rotation(jnp.array([[pk]]), 8))
        )

    np.testing.assert_allclose(score(3, 1), score(12, 10), rtol=1e-5)
    assert abs(float(score(3, 1) - score(3, 2))) > 1e-4


def test_default_positions_use_constant_tables_equal_to_computed_ones():
    """On the CPU, without positions the rotation comes from numpy tables that every layer shares; they equal the
    rotation computed from 0..T-1, which is what the accelerators compute."""
    rotary = embeddings.Rotary(10_000.0, (8.0, 1.0, 4.0, 16))
    positions = jnp.broadcast_to(jnp.arange(20), (3, 20))
    tables = rotary.rotation(None, 16, 20)
    assert rotary.rotation(None, 16, 20)[0] is tables[0]
    with kernels.use_platform("gpu"):
        accelerator = rotary.rotation(None, 16, 20)
    for constant, plain, computed in zip(tables, accelerator, rotary.rotation(positions, 16), strict=True):
        assert isinstance(constant, np.ndarray) and constant.shape == (1, 20, 1, 16) and not constant.flags.writeable
        assert isinstance(plain, jax.Array) and plain.shape == (1, 20, 1, 16)
        np.testing.assert_allclose(np.broadcast_to(constant, computed.shape), computed, atol=2e-6)
        np.testing.assert_array_equal(np.broadcast_to(plain, computed.shape), computed)
    model, params = tiny_llama()
    tokens = testing.random_tokens((2, 12), vocab_size=61)
    np.testing.assert_allclose(
        model.apply({"params": params}, tokens),
        model.apply({"params": params}, tokens, positions=jnp.broadcast_to(jnp.arange(12), (2, 12))),
        atol=1e-5,
    )


def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    plain = embeddings.Rotary(500_000.0).inverse_frequencies(64)
    scaled = embeddings.Rotary(500_000.0, (8.0, 1.0, 4.0, 8192)).inverse_frequencies(64)
    np.testing.assert_allclose(scaled[:4], plain[:4])  # short wavelengths untouched
    np.testing.assert_allclose(scaled[-2:], plain[-2:] / 8.0, rtol=1e-6)  # long ones divided by the factor


def test_kv_cache_decoding_equals_full_forward_with_sliding_window():
    model, params = tiny_llama(sliding_window=3)
    tokens = testing.random_tokens((2, 10), vocab_size=61)
    full = model.apply({"params": params}, tokens)
    no_window = tiny_llama()[0].apply({"params": params}, tokens)
    assert np.abs(np.asarray(full[:, 4:] - no_window[:, 4:])).max() > 1e-4  # the window changes later positions
    np.testing.assert_allclose(full[:, :3], no_window[:, :3], atol=1e-5)  # and not those within it
    cache = model.init(jax.random.key(0), jnp.zeros((2, 10), jnp.int32), decode=True)["cache"]
    assert cache["blocks"]["layer_0"]["attn"]["cached_key"].shape == (2, 2, 8, 3)  # K heads, the last 3 positions
    out, variables = model.apply({"params": params, "cache": cache}, tokens[:, :4], decode=True, mutable=["cache"])
    pieces = [out]
    for t in range(4, 10):
        out, variables = model.apply(
            {"params": params, "cache": variables["cache"]},
            tokens[:, t : t + 1],
            positions=np.full((2, 1), t),
            decode=True,
            mutable=["cache"],
        )
        pieces.append(out)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5)


@pytest.mark.parametrize("window", [0, 3])
def test_left_padded_greedy_generation_with_and_without_cache(window):
    model, params = tiny_llama(sliding_window=window)
    prompts = np.array([[0, 0, 5, 7, 9], [3, 4, 5, 6, 7]], np.int32)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int32)
    kwargs = dict(max_new_tokens=6, temperature=0.0)
    cached = decoding.sample(model, params, prompts, mask, jax.random.key(0), **kwargs).tokens
    plain = decoding.sample(model, params, prompts, mask, jax.random.key(0), use_cache=False, **kwargs).tokens
    np.testing.assert_array_equal(cached, plain)
    alone = decoding.sample(model, params, prompts[:1, 2:], mask[:1, 2:], jax.random.key(0), **kwargs).tokens
    np.testing.assert_array_equal(cached[:1], alone)  # left padding changes nothing


def test_scan_layers_match_python_loop():
    model, params = tiny_llama()
    scanned = models.build_model("llama", {**TINY, "scan_layers": True, "remat_policy": "full"})
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[params["blocks"][f"layer_{i}"] for i in range(2)])
    scan_params = {**{k: v for k, v in params.items() if k != "blocks"}, "blocks": {"layers": stacked}}
    tokens = testing.random_tokens((2, 8), vocab_size=61)
    np.testing.assert_allclose(
        scanned.apply({"params": scan_params}, tokens), model.apply({"params": params}, tokens), atol=1e-5
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_kv_heads": 4}, "num_kv_heads"),
        ({"head_dim": 7}, "even head size"),
        ({"rope_scaling_factor": 8.0, "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 1.0}, "llama3"),
        ({"sliding_window": -1}, "sliding_window"),
    ],
)
def test_bad_configs_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        models.make_config("llama", {**TINY, **fields})


def test_longer_input_than_max_len_raises():
    model, params = tiny_llama()
    with pytest.raises(ValueError, match="max_len=32"):
        model.apply({"params": params}, jnp.zeros((1, 33), jnp.int32))


def test_kv_cache_bytes_scale_with_kv_heads():
    grouped, full = (models.make_config("llama", {**TINY, "num_kv_heads": k}) for k in (2, 6))
    assert grouped.kv_cache_bytes(4, 32) * 3 == full.kv_cache_bytes(4, 32) == 2 * 2 * 4 * 32 * 6 * 8 * 4
