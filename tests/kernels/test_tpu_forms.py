"""The TPU forms traced on the CPU (`kernels.use_platform("tpu")`): Pallas' splash attention, run by Pallas'
interpreter, equals the explicit form in value and gradients, and the seam picks it only where it computes the same
function; the fused LM head takes the TPU's chunk."""

import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import kernels
from lmzoo.kernels import explicit
from lmzoo.layers import attention, embeddings
from lmzoo.objectives import losses

B, N, K, H = 2, 4, 2, 16  # grouped-query attention: two query heads a kv head


def _segment_ids(length: int) -> np.ndarray:
    """[B, length]: row 0 three packed documents then padding, row 1 two documents."""
    ids = np.ones((B, length), np.int32)
    ids[0, length // 3 : 2 * length // 3] = 2
    ids[0, 2 * length // 3 :] = 3
    ids[0, -length // 8 :] = 0
    ids[1, length // 2 :] = 2
    return ids


def _llama_attention(**fields) -> attention.Attention:
    config = attention.AttentionConfig(
        num_heads=N, head_dim=H, num_kv_heads=K, use_bias=False, rotary=embeddings.Rotary(10_000.0), **fields
    )
    return attention.Attention(config, causal=True)


@pytest.mark.parametrize(
    ("causal", "packed", "length"), [(True, True, 128), (True, True, 256), (True, False, 128), (False, True, 128)]
)
def test_splash_attention_equals_the_explicit_form(causal, packed, length):
    """Forward and gradients w.r.t. q, k, v over the rows of non-padding queries (a padding query's row differs:
    `kernels.tpu.dot_product_attention`); 256 positions take blocks of 256, 128 blocks of 128."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, length, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, length, K, H)), jnp.float32) for _ in range(2))
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    segment_ids = jnp.asarray(_segment_ids(length)) if packed else None
    mask = attention.attention_mask(segment_ids, segment_ids, causal=False)
    rows = (jnp.ones((B, length)) if segment_ids is None else segment_ids != 0)[:, :, None, None]

    def loss(attend, q, k, v):
        out = attend(q, k, v, mask=mask, bias=None, is_causal=causal, scale=None, dropout_rate=0.0, dropout_rng=None)
        out = jnp.where(rows, out, 0.0)
        return jnp.sum(out * cotangent), out

    seam = functools.partial(attention.dot_product_attention, segment_ids=segment_ids)
    splash = jax.jit(jax.value_and_grad(lambda *a: loss(seam, *a), argnums=(0, 1, 2), has_aux=True))
    with kernels.use_platform("tpu"):
        assert kernels.attention_form(q, k, mask=mask, bias=None, dropout=False, segment_ids=segment_ids) == "splash"
        (_, out), grads = splash(q, k, v)
    plain = jax.value_and_grad(lambda *a: loss(explicit.dot_product_attention, *a), argnums=(0, 1, 2), has_aux=True)
    (_, expected_out), expected_grads = plain(q, k, v)
    chex.assert_trees_all_close((out, grads), (expected_out, expected_grads), atol=1e-5, rtol=0)


def test_llama_attention_module_on_the_tpu_forms_equals_the_cpu_forms():
    """A causal Llama-style attention (rotary, 4 query heads over 2 kv heads, no biases) over packed documents and
    padding: its output and parameter gradients over non-padding positions."""
    x = jax.random.normal(jax.random.key(0), (B, 128, 32))
    segment_ids = jnp.asarray(_segment_ids(128))
    module = _llama_attention()
    params = module.init(jax.random.key(1), x, segment_ids=segment_ids, deterministic=True)["params"]
    rows = (segment_ids != 0)[:, :, None]

    def loss(params):
        out = module.apply({"params": params}, x, segment_ids=segment_ids, deterministic=True)
        return jnp.sum(jnp.where(rows, jnp.sin(out), 0.0))

    def value_and_grads(platform):
        with kernels.use_platform(platform):
            return jax.jit(jax.value_and_grad(loss))(params)

    chex.assert_trees_all_close(value_and_grads("tpu"), value_and_grads("cpu"), atol=1e-5, rtol=0)


def test_the_seam_picks_splash_on_tpus_only_where_it_computes_the_same_function():
    q, k = jnp.zeros((B, 128, N, H)), jnp.zeros((B, 128, K, H))
    segment_ids = jnp.asarray(_segment_ids(128))
    mask = attention.attention_mask(segment_ids, segment_ids, causal=False)
    window = attention.sliding_window_mask(*(jnp.broadcast_to(jnp.arange(128), (B, 128)),) * 2, 16)
    bias = jnp.zeros((1, N, 128, 128))
    form = kernels.attention_form
    with kernels.use_platform("tpu"):
        assert form(q, k, mask=None, bias=None, dropout=False) == "splash"
        assert form(q, k, mask=mask, bias=None, dropout=False, segment_ids=segment_ids) == "splash"
        assert form(q, k, mask=mask & window, bias=None, dropout=False) == "xla"  # a sliding window
        assert form(q, k, mask=None, bias=bias, dropout=False) == "xla"
        assert form(q[:, :1], k, mask=mask[:, :, :1], bias=None, dropout=False) == "xla"  # a decoding step
        assert form(q[:, :8], k[:, :8], mask=None, bias=None, dropout=False) == "xla"  # shorter than a block
        assert form(q, k, mask=None, bias=None, dropout=True) == "explicit"
    with kernels.use_platform("gpu"):
        assert form(q, k, mask=mask, bias=None, dropout=False, segment_ids=segment_ids) == "xla"


def test_the_attention_module_passes_segment_ids_only_for_a_mask_made_of_them(monkeypatch):
    """Whole-sequence self-attention reaches splash; a sliding window and cross-attention over packed contexts keep
    the dense mask and XLA's form; a decoding step attends to its head-major cache in `attention.cached_attention`,
    choosing no form."""
    forms = []
    choose = kernels.attention_form
    monkeypatch.setattr(kernels, "attention_form", lambda *a, **kw: forms.append(choose(*a, **kw)) or forms[-1])
    x = jnp.zeros((B, 128, 32))
    segment_ids = jnp.asarray(_segment_ids(128))

    def forms_of(module, *args, **kwargs):
        forms.clear()
        with kernels.use_platform("tpu"):
            jax.eval_shape(lambda: module.init_with_output(jax.random.key(0), *args, deterministic=True, **kwargs))
        return forms[-1]

    assert forms_of(_llama_attention(), x, segment_ids=segment_ids) == "splash"
    assert forms_of(_llama_attention(sliding_window=16), x, segment_ids=segment_ids) == "xla"
    cross = attention.Attention(attention.AttentionConfig(num_heads=N, head_dim=H), cross=True)
    assert forms_of(cross, x, x, segment_ids=segment_ids, context_segment_ids=segment_ids) == "xla"
    module = _llama_attention()
    with kernels.use_platform("tpu"):
        cache = module.init(jax.random.key(0), x, deterministic=True, decode=True)["cache"]
        params = module.init(jax.random.key(0), x, deterministic=True)["params"]
        forms.clear()
        jax.eval_shape(
            lambda: module.apply(
                {"params": params, "cache": cache}, x[:, :1], deterministic=True, decode=True, mutable=["cache"]
            )
        )
    assert forms == []


MESH_CHECK = """
import json
import flax.linen as nn
import jax
import jax.numpy as jnp
from lmzoo import kernels, sharding
from tests.kernels.test_tpu_forms import _llama_attention, _segment_ids

x = jax.random.normal(jax.random.key(0), (4, 128, 32))
module = _llama_attention()
params = module.init(jax.random.key(1), x, deterministic=True)["params"]
mesh = sharding.make_mesh((2, 1, 1, 2))  # batch over data, heads (query and kv) over tensor
report = {}
for segment_ids in (jnp.asarray(_segment_ids(128).repeat(2, axis=0)), None):
    rows = 1.0 if segment_ids is None else (segment_ids != 0)[:, :, None]

    def loss(params):
        out = module.apply({"params": params}, x, segment_ids=segment_ids, deterministic=True)
        return jnp.sum(jnp.where(rows, jnp.sin(out), 0.0))

    with kernels.use_platform("cpu"):
        expected = jax.jit(jax.value_and_grad(loss))(params)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), kernels.use_platform("tpu"):
        jaxpr = str(jax.make_jaxpr(jax.value_and_grad(loss))(params))
        got = jax.jit(jax.value_and_grad(loss))(params)
    errors = [jnp.max(jnp.abs(a - b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected))]
    report["packed" if segment_ids is not None else "unpacked"] = {
        "splash_per_device": "shard_map" in jaxpr and "splash_mha" in jaxpr,
        "error": float(max(errors)),
    }
print(json.dumps(report))
"""


def test_splash_attention_under_a_mesh_runs_per_device_and_equals_the_cpu_forms():
    """On 4 CPU devices (2 data x 2 tensor) the kernel runs in a shard_map over rows and heads (XLA cannot partition
    a Mosaic kernel): the module's loss and gradients equal the explicit form's without a mesh."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    root = pathlib.Path(__file__).parents[2]
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MESH_CHECK)], capture_output=True, text=True, env=env, cwd=root
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert all(case["splash_per_device"] and case["error"] <= 1e-5 for case in report.values()), report


def test_the_fused_head_loss_takes_the_tpu_chunk():
    """GPT-2's real head (batch 8 x 1,024 positions, 50,257 words), traced with the TPU's budget, scans 8 chunks of
    128 positions' logits; that a chunked scan equals the plain loss is tests/objectives/test_causal_lm.py's check."""
    hidden = jax.ShapeDtypeStruct((8, 1024, 768), jnp.bfloat16)
    embedding = jax.ShapeDtypeStruct((50257, 768), jnp.bfloat16)
    batch = {
        "targets": jax.ShapeDtypeStruct((8, 1024), jnp.int32),
        "weights": jax.ShapeDtypeStruct((8, 1024), jnp.float32),
    }
    loss = jax.grad(lambda h, e, batch: losses.fused_head_loss(h, e, batch)[0], argnums=(0, 1))
    with kernels.use_platform("tpu"):
        jaxpr = str(jax.make_jaxpr(loss)(hidden, embedding, batch))
    assert re.findall(r"length=(\d+)", jaxpr) == ["8"]
    assert "f32[8,128,50257]" in jaxpr


def test_a_scanned_llama_loss_on_the_tpu_forms_equals_the_cpu_forms(monkeypatch):
    """A Llama's causal-LM loss and gradients over packed documents with splash attention inside its scanned,
    rematerialised layers (Pallas interpreted), against the CPU forms; no padding, so every row counts."""
    from lmzoo import models
    from lmzoo.kernels import tpu
    from lmzoo.objectives import tasks

    traced = []
    splash = tpu.dot_product_attention
    monkeypatch.setattr(
        tpu, "dot_product_attention", lambda *a, **k: traced.append(k["segment_ids"]) or splash(*a, **k)
    )

    fields = dict(
        vocab_size=64, max_len=128, emb_dim=32, num_heads=N, num_kv_heads=K, head_dim=H, num_layers=2, mlp_dim=48
    )
    model = models.build_model("llama", {**fields, "scan_layers": True, "remat_policy": "full"})
    task = tasks.causal_lm_task(model)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 64, (B, 129)).astype(np.int32)
    segment_ids = np.where(np.arange(128) < 50, 1, 2)[None].repeat(B, 0).astype(np.int32)
    positions = np.where(segment_ids == 1, np.arange(128), np.arange(128) - 50).astype(np.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": np.ones((B, 128), np.float32),
        "segment_ids": segment_ids,
        "positions": positions,
    }
    params, _ = task.init(jax.random.key(0), batch)

    def loss_and_grads(platform):
        with kernels.use_platform(platform):
            assert kernels.attention_form(
                jnp.zeros((B, 128, N, H)), jnp.zeros((B, 128, K, H)), mask=None, bias=None, dropout=False
            ) == ("splash" if platform == "tpu" else "explicit")
            loss = lambda p: task.loss(p, {}, {}, batch, jax.random.key(1), step=0, train=False)[0]  # noqa: E731
            return jax.jit(jax.value_and_grad(loss))(params)

    on_tpu = loss_and_grads("tpu")
    assert traced and all(ids is not None for ids in traced)  # the model's attention ran splash, segment ids given
    chex.assert_trees_all_close(on_tpu, loss_and_grads("cpu"), rtol=1e-5, atol=1e-6)
