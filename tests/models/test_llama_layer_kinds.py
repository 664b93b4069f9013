"""The llama family's layer kinds (Gemma 3's `layer_types`: sliding-window layers rotating with one base, global ones
with another and the scaling), which differ only in values each layer takes (`BlockStack.per_layer`): a scanned stack
of both kinds is one scan body, equal to the looped stack; the KV cache (full-length with a traced window in a scanned
stack, each sliding layer's rolling window in a looped one), `decoding.generate` and the generation engine agree with
the full forward pass with a window shorter than the sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo import decoding, models, testing
from lmzoo.layers import attention, blocks, embeddings
from lmzoo.models.llama import FULL, SLIDING
from lmzoo.serving import engine
from tests.serving.test_engine import greedy_references, prompts
from tests.test_decoding import randomized

LENGTH = 40
GEMMA = dict(
    vocab_size=61,
    max_len=LENGTH,
    emb_dim=24,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    num_layers=6,
    mlp_dim=40,
    layer_types=(SLIDING,) * 5 + (FULL,),
    sliding_window=3,
    rope_theta=1e6,
    sliding_rope_theta=1e4,
    rope_scaling_factor=8.0,
    rope_scaling_type="linear",
    qk_norm=True,
    sandwich_norms=True,
    embed_scale=True,
    query_pre_attn_scalar=12.0,
    mlp_activation="gelu_tanh",
    tie_embeddings=False,  # tied to random embeddings scaled by sqrt(D), greedy decoding repeats one token
)


def gemma(**overrides):
    """(model, random params) of GEMMA with `overrides`; scanned params are the looped ones stacked, so both
    layouts hold the same model."""
    fields = GEMMA | overrides
    looped = models.build_model("llama", fields | {"scan_layers": False})
    params = nn.unbox(looped.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    params = randomized(params, seed=3)
    if fields.get("scan_layers"):
        layers = [params["blocks"].pop(f"layer_{i}") for i in range(fields["num_layers"])]
        params["blocks"] = {"layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
    return models.build_model("llama", fields), params


def test_each_layer_takes_its_window_and_rotation():
    cfg = models.make_config("llama", GEMMA)
    per_layer = cfg.per_layer()
    assert per_layer["sliding_window"] == (3, 3, 3, 3, 3, 0)
    local, global_ = embeddings.Rotary(1e4).inverse_frequencies(8), embeddings.Rotary(1e6).inverse_frequencies(8)
    for i in range(5):
        np.testing.assert_array_equal(per_layer["rotary_frequencies"][i], local)
    np.testing.assert_allclose(per_layer["rotary_frequencies"][5], global_ / 8.0, rtol=1e-6)  # linear: every one / 8
    alike = {k: v for k, v in GEMMA.items() if k not in ("layer_types", "sliding_rope_theta")}
    assert models.make_config("llama", alike).per_layer() is None  # every layer slides, as Mistral's


def test_a_scanned_stack_of_both_kinds_is_one_scan_body():
    """The 5 sliding and 1 global layers trace as one scan of length 6 whose body holds one layer's matmuls: the
    program does not grow with depth (12 layers trace the same body)."""
    tokens = testing.random_tokens((2, 12), vocab_size=61)

    def trace(num_layers, **fields):
        model, params = gemma(num_layers=num_layers, layer_types=(SLIDING,) * (num_layers - 1) + (FULL,), **fields)
        return str(jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens))(params))

    six, twelve = trace(6, scan_layers=True, remat_policy="full"), trace(12, scan_layers=True, remat_policy="full")
    assert six.count("scan[") == 1 and "length=6" in six and "length=12" in twelve
    assert six.count("dot_general") == twelve.count("dot_general")
    assert trace(6).count("dot_general") > 5 * six.count("dot_general") // 2  # looped: every layer's own


@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_scanned_layers_equal_looped_ones_with_left_padding(remat_policy):
    looped, params = gemma()
    scanned, stacked = gemma(scan_layers=True, remat_policy=remat_policy)
    tokens = testing.random_tokens((2, 12), vocab_size=61)
    mask = np.ones_like(tokens)
    mask[1, :4] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ours = scanned.apply({"params": stacked}, tokens, positions=positions, segment_ids=mask)
    np.testing.assert_allclose(
        ours, looped.apply({"params": params}, tokens, positions=positions, segment_ids=mask), atol=1e-5
    )
    all_global, _ = gemma(layer_types=(FULL,) * 6, sliding_rope_theta=0.0)
    diff = np.abs(
        np.asarray(ours - all_global.apply({"params": params}, tokens, positions=positions, segment_ids=mask))
    )
    assert diff[0, 3:].max() > 1e-3  # the windows change what the later positions see


@pytest.mark.parametrize("scan_layers", [False, True], ids=["looped", "scanned"])
def test_kv_cache_decoding_equals_the_full_forward(scan_layers):
    """A 4-token chunk, then one token at a time to position 10 (past the window of 3): the cached logits equal the
    full forward pass's. Scanned, every layer caches the whole sequence; looped, the sliding layers their window."""
    model, params = gemma(scan_layers=scan_layers)
    tokens = testing.random_tokens((2, 10), vocab_size=61)
    full = model.apply({"params": params}, tokens)
    cache = model.init(jax.random.key(0), jnp.zeros((2, 10), jnp.int32), decode=True)["cache"]
    keys = cache["blocks"]["layers" if scan_layers else "layer_0"]["attn"]["cached_key"]
    assert keys.shape == ((6, 2, 2, 8, 10) if scan_layers else (2, 2, 8, 3))  # head-major, transposed: [B, K, H, S]
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


@pytest.mark.parametrize("scan_layers", [False, True], ids=["looped", "scanned"])
def test_greedy_generate_equals_the_argmax_of_the_full_forward(scan_layers):
    """Left-padded prompts and 14 new tokens (sequences of 19, windows of 3): each token generate picks with the
    cache is the argmax of the full forward pass over the prompt and the tokens before it."""
    model, params = gemma(scan_layers=scan_layers)
    tokens = testing.random_tokens((2, 5), vocab_size=61)
    mask = np.ones_like(tokens)
    mask[1, :2] = 0
    new = np.asarray(
        decoding.generate(
            model, params, tokens, prompt_mask=mask, rng=jax.random.key(0), max_new_tokens=14, temperature=0.0
        )
    )
    assert len(set(new[0])) > 3, f"degenerate continuation {new[0]}"
    sequence = np.concatenate([tokens, new], axis=1)
    full_mask = np.concatenate([mask, np.ones_like(new)], axis=1)
    positions = np.maximum(np.cumsum(full_mask, axis=1) - 1, 0)
    logits = model.apply({"params": params}, sequence, positions=positions, segment_ids=full_mask)
    np.testing.assert_array_equal(np.argmax(logits[:, 4:-1], axis=-1), new)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["looped", "scanned"])
def test_the_engine_decodes_as_generate(scan_layers):
    """Seven prompts through 3 slots, 4 steps a chunk, replies of up to 15 tokens past windows of 3: every reply is
    `decoding.generate`'s, token for token."""
    model, params = gemma(scan_layers=scan_layers)
    eng = engine.Engine(model, params, slots=3, chunk=4, length=LENGTH)
    requests = [engine.Request(p, max_tokens=3 + 2 * i, temperature=0.0) for i, p in enumerate(prompts(61))]
    tickets = eng.generate(requests)
    expected = greedy_references(model, params, [r.prompt for r in requests], [r.max_tokens for r in requests])
    assert [t.outputs[0].tokens for t in tickets] == expected


def test_a_traced_window_masks_as_the_static_one_and_zero_is_none():
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    static = attention.sliding_window_mask(positions, positions, 3)
    traced = jax.jit(attention.sliding_window_mask)
    np.testing.assert_array_equal(traced(positions, positions, jnp.int32(3)), static)
    assert np.all(traced(positions, positions, jnp.int32(0)))


def test_per_layer_values_are_one_per_layer():
    stack = blocks.BlockStack(
        blocks.TransformerBlock(attention.AttentionConfig(2, 4), mlp_dim=8), 3, per_layer={"sliding_window": (1, 2)}
    )
    with pytest.raises(ValueError, match=r"per_layer values \{'sliding_window': 2\} must number num_layers=3"):
        stack.init(jax.random.key(0), jnp.zeros((1, 4, 8)), deterministic=True)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"layer_types": (SLIDING,) * 5}, r"layer_types has 5 kinds for num_layers=6"),
        ({"layer_types": (SLIDING,) * 5 + ("global",)}, r"layer_types has 'global': each layer is one of"),
        ({"sliding_window": 0}, r"sliding_attention layers but sliding_window=0"),
        ({"layer_types": (), "sliding_window": 0}, r"sliding_rope_theta=10000.0 rotates sliding_attention layers"),
        ({"rope_scaling_type": "ntk"}, r"rope_scaling_type='ntk': choose one of \('llama3', 'linear', 'yarn'\)"),
        (
            {"rope_scaling_type": "yarn", "rope_scaling_factor": 32.0},
            r"sliding_rope_theta=10000.0 with YaRN scaling: .* set sliding_rope_theta=0",
        ),
        ({"mlp_activation": "swish"}, r"mlp_activation='swish': choose one of"),
        ({"num_experts": 4}, r"mlp_activation='gelu_tanh' with num_experts=4: experts are SiLU-gated"),
        ({"query_pre_attn_scalar": -1.0}, r"query_pre_attn_scalar=-1.0 must be >= 0"),
    ],
)
def test_bad_layer_kinds_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        models.make_config("llama", GEMMA | fields)
