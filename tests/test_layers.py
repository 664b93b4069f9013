"""Shared layers and their CPU forms (`kernels.cpu`): `project` (one 2-D matmul), attention, GELU, LayerNorm backward;
the accelerator forms equal the CPU forms."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import kernels, models, testing
from lmzoo.kernels import cpu, explicit
from lmzoo.layers import attention, embeddings, linears, mlp
from lmzoo.objectives import losses, tasks

PROJECTIONS = [
    ("BTD,DNH->BTNH", (2, 8, 16), (16, 4, 4)),
    ("BTNH,NHD->BTD", (2, 8, 4, 4), (4, 4, 16)),
    ("BTD,VD->BTV", (2, 8, 16), (32, 16)),
    ("BD,DC->BC", (2, 16), (16, 3)),
]


def _operands(x_shape, kernel_shape):
    rng = np.random.default_rng(0)
    return rng.normal(size=x_shape).astype(np.float32), rng.normal(size=kernel_shape).astype(np.float32)


@pytest.mark.parametrize(("eqn", "x_shape", "kernel_shape"), PROJECTIONS)
def test_project_equals_einsum_in_value_and_gradients(eqn, x_shape, kernel_shape):
    x, kernel = _operands(x_shape, kernel_shape)
    weights = np.random.default_rng(1).normal(size=jnp.einsum(eqn, x, kernel).shape).astype(np.float32)

    def loss(contract):
        return lambda x, kernel: jnp.sum(weights * contract(eqn, x, kernel))

    chex.assert_trees_all_close(cpu.project(eqn, x, kernel), jnp.einsum(eqn, x, kernel), atol=1e-5)
    chex.assert_trees_all_close(
        jax.grad(loss(cpu.project), argnums=(0, 1))(x, kernel),
        jax.grad(loss(jnp.einsum), argnums=(0, 1))(x, kernel),
        atol=1e-5,
    )


@pytest.mark.parametrize(("eqn", "x_shape", "kernel_shape"), PROJECTIONS)
def test_project_is_one_two_dimensional_dot(eqn, x_shape, kernel_shape):
    """Every dot of the forward and backward pass has 2-D operands and one contracted axis."""
    x, kernel = _operands(x_shape, kernel_shape)
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, k: jnp.sum(cpu.project(eqn, x, k)), argnums=(0, 1)))(x, kernel)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # forward, input gradient, kernel gradient
    for dot in dots:
        assert [v.aval.ndim for v in dot.invars] == [2, 2]
        (contracting, _), _ = dot.params["dimension_numbers"]
        assert len(contracting) == 1


def test_non_projection_equations_fall_back_to_einsum():
    query, key = _operands((2, 8, 4, 4), (2, 6, 4, 4))
    chex.assert_trees_all_close(
        cpu.project("BTNH,BSNH->BNTS", query, key), jnp.einsum("BTNH,BSNH->BNTS", query, key), atol=1e-5
    )


@pytest.mark.parametrize("query_without_keys", [False, True])
def test_explicit_attention_equals_jax_attention_with_masks_and_bias(query_without_keys):
    """The explicit head-major attention (CPU, attention dropout) matches `jax.nn.dot_product_attention` in value and gradients
    (of the bias too), also when the loss reaches a query that no key is valid for (position 7 of the first row)."""
    rng = np.random.default_rng(2)
    query, key, value = (rng.normal(size=(2, 8, 4, 4)).astype(np.float32) for _ in range(3))
    bias = rng.normal(size=(1, 4, 8, 8)).astype(np.float32)
    segment_ids = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    mask = attention.attention_mask(segment_ids, segment_ids, causal=False)
    if query_without_keys:
        mask = mask & (segment_ids != 0)[:, None, :, None]

    def loss(attend):
        def fn(q, k, v, b):
            return jnp.sum(attend(q, k, v, mask=mask, bias=b, is_causal=True, scale=0.3) ** 2)

        return jax.value_and_grad(fn, argnums=(0, 1, 2, 3))(query, key, value, bias)

    ours = loss(functools.partial(explicit.dot_product_attention, dropout_rate=0.0, dropout_rng=None))
    reference = loss(jax.nn.dot_product_attention)
    chex.assert_trees_all_close(ours, reference, atol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(
    ("length", "block_min", "blocks"),
    [(1024, 64, [128] * 8), (200, 64, [64, 64, 64, 8]), (7, 2, [2, 2, 2, 1])],
)
def test_causal_split_attention_equals_jax_attention(monkeypatch, length, block_min, blocks, padded):
    """Causal self-attention computed in query blocks (`explicit.causal_blocks`: 1024 in 8 of 128, 200 in 64s and a
    last of 8, 7 in 2s and a last of 1), each against the keys up to its last query, matches
    `jax.nn.dot_product_attention` in value and gradients; `padded`: with a padding mask [B, 1, T, S] as a policy's
    rollouts have (left-padded prompts, right-padded replies), on every query that has a key (a left pad's row has
    none: what it reads is no one's, and differs between forms)."""
    monkeypatch.setattr(explicit, "CAUSAL_SPLIT_MIN_LEN", min(length, 128))
    monkeypatch.setattr(explicit, "CAUSAL_BLOCK_MIN", block_min)
    assert [b.stop - b.start for b in explicit.causal_blocks(length)] == blocks
    rng = np.random.default_rng(3)
    query, key, value = (rng.normal(size=(2, length, 2, 8)).astype(np.float32) for _ in range(3))
    mask, has_keys = None, np.ones((2, length, 1, 1), np.float32)
    if padded:
        valid = np.ones((2, length), bool)
        valid[0, : length // 3] = False
        valid[1, length - length // 4 :] = False
        mask = np.broadcast_to(valid[:, None, None, :], (2, 1, length, length))
        has_keys[0, : length // 3] = 0.0

    def loss(attend):
        def fn(q, k, v):
            return jnp.sum(jnp.sin(attend(q, k, v, mask=mask, bias=None, is_causal=True, scale=None)) * has_keys)

        return jax.value_and_grad(fn, argnums=(0, 1, 2))(query, key, value)

    ours = loss(functools.partial(explicit.dot_product_attention, dropout_rate=0.0, dropout_rng=None))
    reference = loss(jax.nn.dot_product_attention)
    chex.assert_trees_all_close(ours, reference, atol=1e-4)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cached_attention_over_the_head_major_cache_equals_the_explicit_form(kv_heads):
    """Decoding's form over a head-major cache (keys [B, K, H, S], values [B, K, S, H]: `attention.cached_attention`)
    equals the explicit form over the same keys laid out [B, S, K, H], with grouped heads, several queries a row, a
    mask of each row's valid keys, a bias and sinks."""
    rng = np.random.default_rng(5)
    query = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)
    key, value = (rng.normal(size=(2, 6, kv_heads, 8)).astype(np.float32) for _ in range(2))
    mask = (rng.random((2, 1, 3, 6)) < 0.7) & np.tril(np.ones((3, 6), bool), k=3)
    bias = rng.normal(size=(1, 4, 3, 6)).astype(np.float32)
    sinks = rng.normal(size=(4,)).astype(np.float32)
    for kwargs in (dict(bias=None, sinks=None), dict(bias=bias, sinks=sinks)):
        ours = attention.cached_attention(
            query, key.transpose(0, 2, 3, 1), np.swapaxes(value, 1, 2), mask=mask, scale=0.5, **kwargs
        )
        reference = explicit.dot_product_attention(
            query, key, value, mask=mask, is_causal=False, scale=0.5, dropout_rate=0.0, dropout_rng=None, **kwargs
        )
        chex.assert_trees_all_close(ours, reference, atol=1e-5)


def test_gelu_equals_exact_jax_gelu_in_value_and_gradient():
    x = np.linspace(-9.0, 9.0, 401, dtype=np.float32)
    chex.assert_trees_all_close(cpu.gelu(x), jax.nn.gelu(x, approximate=False), atol=1e-6)
    gradient = jax.vmap(jax.grad(cpu.gelu))(x)
    chex.assert_trees_all_close(
        gradient, jax.vmap(jax.grad(functools.partial(jax.nn.gelu, approximate=False)))(x), atol=1e-6
    )


@pytest.mark.parametrize("use_mean", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_normalize_matches_automatic_differentiation(use_mean, dtype):
    """The hand-written LayerNorm / RMS norm backward equals autodiff of the plain formula."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(1.0, 2.0, size=(2, 8, 16)), dtype)
    scale = jnp.asarray(rng.normal(1.0, 0.1, size=16), jnp.float32)
    weights = rng.normal(size=(2, 8, 16)).astype(np.float32)

    def plain(x, scale):
        x32 = x.astype(jnp.float32)
        if use_mean:
            x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-5) * scale

    def loss(norm):
        return jax.value_and_grad(lambda x, scale: jnp.sum(weights * norm(x, scale)), argnums=(0, 1))(x, scale)

    (value, grads), (expected_value, expected_grads) = (
        loss(lambda x, s: cpu.normalize(x, s, 1e-5, use_mean)),
        loss(plain),
    )
    assert grads[0].dtype == dtype
    chex.assert_trees_all_close(value, expected_value, rtol=1e-5)
    chex.assert_trees_all_close(grads, expected_grads, atol=1e-4 if dtype == jnp.float32 else 2e-2)
    tangents = (jnp.asarray(rng.normal(size=x.shape), dtype), jnp.asarray(rng.normal(size=16), jnp.float32))
    forward = jax.jvp(lambda x, s: cpu.normalize(x, s, 1e-5, use_mean), (x, scale), tangents)
    chex.assert_trees_all_close(
        forward, jax.jvp(plain, (x, scale), tangents), atol=1e-4 if dtype == jnp.float32 else 2e-2
    )


def test_embed_lookup_gives_nan_rows_for_ids_outside_the_vocabulary():
    table = jnp.arange(12.0).reshape(4, 3)
    ids = jnp.array([[0, 3, -1], [4, 2, -4]])
    with pytest.raises(ValueError, match=r"token ids span \[-4, 4\] but the embedding table has 4 rows"):
        embeddings.embed_lookup(table, ids)  # concrete ids are checked; traced ones give NaN rows
    out = jax.jit(embeddings.embed_lookup)(table, ids)
    np.testing.assert_array_equal(out[0, :2], table[jnp.array([0, 3])])
    np.testing.assert_array_equal(out[1, 1], table[2])
    assert np.isnan(out[0, 2]).all() and np.isnan(out[1, 0]).all() and np.isnan(out[1, 2]).all()
    grad = jax.grad(lambda t: jnp.sum(embeddings.embed_lookup(t, jnp.array([0, 2, 2])) * 2.0))(table)
    np.testing.assert_array_equal(grad, jnp.array([[2.0] * 3, [0.0] * 3, [4.0] * 3, [0.0] * 3]))


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_layers_choose_the_form_of_the_platform(platform):
    """`layers` runs `kernels.cpu`'s forms on the CPU and the plain ones (einsum, jax.nn) elsewhere."""
    x, kernel = _operands((2, 8, 16), (16, 4, 4))
    with kernels.use_platform(platform):
        jaxpr = str(jax.make_jaxpr(lambda x, k: linears.project("BTD,DNH->BTNH", x, k))(x, kernel))
        gelu_jaxpr = str(
            jax.make_jaxpr(lambda x: mlp.gelu(x))(x)
        )  # a new function: no trace cached from the other platform
    assert ("custom_jvp_call" in gelu_jaxpr) == (platform == "cpu")
    assert ("reshape" in jaxpr) == (platform == "cpu")  # the 2-D form flattens [B, T, D] to [B*T, D]


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("dropout", [False, True])
def test_the_platform_seam_alone_chooses_the_explicit_attention(platform, dropout):
    """The explicit form runs on the CPU and, on every platform, when attention dropout needs the probabilities;
    otherwise `jax.nn.dot_product_attention` (cuDNN needs a GPU backend, so here its XLA form)."""
    query, key = _operands((2, 8, 4, 8), (2, 8, 2, 8))
    with kernels.use_platform(platform):
        form = kernels.attention_form(query.astype(jnp.bfloat16), key, mask=None, bias=None, dropout=dropout)
    assert form == ("explicit" if platform == "cpu" or dropout else "xla")


def test_accelerator_forms_equal_the_cpu_forms_in_loss_and_gradients():
    """GPT-2's causal-LM loss and gradients traced with the GPU/TPU forms (einsum projections, jax.nn GELU and
    attention, autodiff norms, large head chunks), run here on the CPU, equal the CPU forms'."""
    model = models.build_model("gpt2", dict(testing.TINY_GPT2, dropout_rate=0.0))
    task = tasks.causal_lm_task(model)
    tokens = testing.random_tokens((2, 9), vocab_size=testing.TINY_GPT2["vocab_size"], seed=4)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((2, 8), np.float32)}
    params, _ = task.init(jax.random.key(0), batch)

    def loss_and_grads(platform):
        with kernels.use_platform(platform):
            fn = jax.jit(
                jax.value_and_grad(lambda p: task.loss(p, {}, {}, batch, jax.random.key(1), step=0, train=False)[0])
            )
            return fn(params)

    chex.assert_trees_all_close(loss_and_grads("gpu"), loss_and_grads("cpu"), rtol=1e-5, atol=1e-6)


def test_head_chunks_are_sized_per_platform():
    with kernels.use_platform("cpu"):
        cpu_chunk = losses.head_loss_chunk_len(8, 1024, 50257)
    with kernels.use_platform("tpu"):
        tpu_chunk = losses.head_loss_chunk_len(8, 1024, 50257)
    with kernels.use_platform("gpu"):
        gpu_chunks = [losses.head_loss_chunk_len(b, 1024, 50304) for b in (8, 12)]
    assert (cpu_chunk, tpu_chunk) == (8, 128)  # 16 MB and 256 MB of float32 logits
    assert gpu_chunks == [1024, 512]  # 2 GiB: GPT-2 124M's microbatch of 12 takes two chunks
