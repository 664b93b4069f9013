"""Qwen3.5 (`lmzoo.models.qwen3_5`): cached greedy decoding equals the uncached forward's argmax token by token, the
step-by-step decode equals the forward (looped and scanned groups), packed documents equal the documents run apart,
gradients are finite, the layer pattern is found, the config refuses what it cannot build. (HF parity:
tests/convert/test_qwen3_5_hf.py.)"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo import decoding, testing
from lmzoo.config import load_config_file
from lmzoo.models import build_model, make_config, qwen3_5
from lmzoo.serving import slots

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "qwen3_5.py"
SMALL = dict(
    vocab_size=37,
    max_len=32,
    emb_dim=24,
    num_heads=3,
    num_kv_heads=1,
    head_dim=8,
    num_layers=4,
    mlp_dim=40,
    rotary_fraction=0.5,
    linear_key_heads=2,
    linear_value_heads=4,
    linear_key_dim=6,
    linear_value_dim=5,
    chunk_size=4,
    init_std=0.3,
)


def model_and_params(**overrides):
    cfg = make_config("qwen3_5", SMALL | overrides)
    model = build_model("qwen3_5", cfg)
    return model, nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])


def test_cached_greedy_decoding_equals_the_uncached_argmax():
    """decoding.generate with the cache (prefill, then one token a step) picks the tokens that recomputing the whole
    forward each step picks, on left-padded prompts."""
    model, params = model_and_params()
    prompts = np.random.default_rng(0).integers(0, 37, (3, 6))
    prompt_mask = np.ones_like(prompts)
    prompt_mask[1, :2] = prompt_mask[2, :5] = 0
    kwargs = dict(prompt_mask=prompt_mask, rng=jax.random.key(0), max_new_tokens=8, temperature=0.0)
    cached = decoding.generate(model, params, prompts, use_cache=True, **kwargs)
    uncached = decoding.generate(model, params, prompts, use_cache=False, **kwargs)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(uncached))


MOE = dict(num_experts=4, experts_per_token=2, expert_mlp_dim=10, shared_expert_mlp_dim=12)


@pytest.mark.parametrize("case", ["looped", "scanned", "moe"])
def test_decoding_step_by_step_equals_the_forward(case):
    """A prefill of 5 then a token at a time against the cache: the forward's logits at every position (looped, two
    scanned groups, and with experts)."""
    two_kinds = dict(num_layers=2, layer_types=(qwen3_5.LINEAR, qwen3_5.FULL))
    overrides = {"looped": {}, "scanned": dict(scan_layers=True, num_layers=8), "moe": MOE | two_kinds}[case]
    model, params = model_and_params(**overrides)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 37, (2, 9)))
    full = jax.jit(model.apply)({"params": params}, tokens)
    cache = slots.init_cache(model, 2, 9)
    step = jax.jit(
        lambda cache, chunk, positions: model.apply(
            {"params": params, "cache": cache}, chunk, positions=positions, decode=True, mutable=["cache"]
        )
    )
    logits, variables = step(cache, tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)))
    outs = [logits]
    for t in range(5, 9):
        logits, variables = step(variables["cache"], tokens[:, t : t + 1], jnp.full((2, 1), t))
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-4)


def test_packed_documents_equal_the_documents_apart():
    """Two documents packed in one row (positions restarting, segment ids 1 and 2) give each document's own logits:
    attention is masked and the Gated DeltaNet state and convolution restart at the second document."""
    model, params = model_and_params()
    apply = jax.jit(model.apply)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 37, (1, 10)))
    segments = jnp.asarray([[1] * 5 + [2] * 5])
    positions = jnp.asarray([list(range(5)) * 2])
    packed = apply({"params": params}, tokens, positions=positions, segment_ids=segments)
    apart = apply({"params": params}, tokens.reshape(2, 5))  # [2, 5, V]: each document a row of its own
    np.testing.assert_allclose(packed.reshape(apart.shape), apart, atol=1e-4)


def test_gradients_are_finite():
    model, params = model_and_params(num_layers=2, layer_types=("linear_attention", "full_attention"))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 37, (2, 10)))
    segments = jnp.asarray([[1] * 4 + [2] * 6, [0] * 3 + [1] * 7])

    def loss(params):
        logits = model.apply({"params": params}, tokens, segment_ids=segments)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grads = jax.jit(jax.grad(loss))(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["blocks"]["layer_0"]["block_0"]["linear_attn"]["decay_rate"]).sum()) > 0


def test_layer_pattern():
    """HF's default is 3 linear : 1 full; the shortest repeating run is the scanned group."""
    cfg = make_config("qwen3_5", SMALL | {"num_layers": 8})
    assert cfg.pattern == (qwen3_5.LINEAR,) * 3 + (qwen3_5.FULL,)
    kinds = ("linear_attention", "full_attention", "linear_attention", "full_attention")
    assert make_config("qwen3_5", SMALL | {"layer_types": kinds}).pattern == kinds[:2]
    uneven = ("full_attention", "linear_attention", "linear_attention", "linear_attention")
    assert make_config("qwen3_5", SMALL | {"layer_types": uneven}).pattern == uneven


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_kv_heads": 2}, "num_heads=3 must be a multiple"),
        ({"linear_value_heads": 3}, "linear_value_heads=3 must be a multiple"),
        ({"rotary_fraction": 0.1}, "rotary_fraction=0.1"),
        ({"layer_types": ("linear_attention",) * 3}, "3 kinds for num_layers=4"),
        ({"layer_types": ("sliding_attention",) * 4}, "'sliding_attention'"),
    ],
)
def test_config_refusals(change, message):
    with pytest.raises(ValueError, match=message):
        make_config("qwen3_5", SMALL | change)


def test_config_file_variants_build():
    """configs/qwen3_5.py's tiny variant traces a forward; its released variants have Qwen3.5-9B's and
    Qwen3.5-35B-A3B's text models' parameter counts (as transformers counts them: tests/convert/test_qwen3_5_hf.py)."""
    c = load_config_file(CONFIG, "tiny")
    model = build_model(c.model_name, c.model)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32)))
    logits = jax.eval_shape(lambda v: model.apply(v, jnp.ones((2, 8), jnp.int32)), variables)
    assert logits.shape == (2, 8, c.model.vocab_size)
    # transformers' own counts of Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM at their default configs
    for variant, count in (("qwen3_5_9b", 8_953_803_264), ("qwen3_5_35b_a3b", 34_660_610_688)):
        released = build_model("qwen3_5", load_config_file(CONFIG, variant).model)
        shapes = jax.eval_shape(released.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
        assert sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nn.unbox(shapes))) == count, variant


BACKWARD = """
import sys
import jax, numpy as np
from flax import linen as nn
from lmzoo.models import build_model
model = build_model("qwen3_5", dict(vocab_size=512, max_len=256, emb_dim=256, num_heads=4, num_kv_heads=2,
    head_dim=64, num_layers=4, mlp_dim=704, linear_key_heads=2, linear_value_heads=4, linear_key_dim=64,
    linear_value_dim=64))
tokens = np.random.default_rng(0).integers(0, 512, (1, 256)).astype(np.int32)
params = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens[:, :8])["params"])
grad = jax.jit(jax.grad(lambda p: model.apply({"params": p}, tokens).astype(np.float32).sum()))
for _ in range(2):
    jax.block_until_ready(grad(params))
print("done")
"""


def test_a_train_shaped_backward_pass_finishes_in_the_default_pipeline():
    """The backward pass of a Qwen3.5 of 4 layers at D 256 on 256 positions (4 chunks), compiled as users compile it
    (XLA's default pipeline, in a process of its own), finishes twice: with `lax.linalg.triangular_solve` in the
    chunks (a LAPACK call on XLA:CPU) its first call deadlocked, every thread idle (`gated_delta.unit_lower_solve`)."""
    env = {**os.environ, "XLA_FLAGS": " ".join(testing.default_pipeline_xla_flags()), "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, "-c", BACKWARD], env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the backward pass did not finish in 240 s (its compile takes ~10 s): a deadlock")
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
