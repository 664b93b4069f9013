"""Accelerator forms on a real GPU (skipped elsewhere): cuDNN's fused attention against the explicit form; a
checkpoint's blocks assembled on the GPU against the host load."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from lmzoo.convert import hf, llama, mapping
from lmzoo.kernels import explicit
from lmzoo.layers import attention
from lmzoo.models import build_model, make_config

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_attention_matches_explicit_form(causal, packed):
    """bf16 q/k/v [B, T, N, H]: outputs and gradients of the cuDNN kernel equal the explicit form's to bf16 rounding;
    packed: rows of several documents and a padding tail, the mask [B, 1, T, T] from their segment ids."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, cotangent = (jax.random.normal(key, (2, 256, 4, 64), jnp.bfloat16) for key in keys)
    mask, real = None, jnp.ones((2, 256, 1, 1), jnp.float32)
    if packed:
        segment_ids = jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], [40, 100, 76, 40], axis=1), jnp.int32)
        mask = attention.attention_mask(segment_ids, segment_ids, causal=False)
        real = (segment_ids != 0)[:, :, None, None].astype(jnp.float32)  # padding queries' outputs are unused
    cotangent = cotangent.astype(jnp.float32) * real

    def attend(fn, q, k, v):
        out = fn(q, k, v, mask=mask, bias=None, is_causal=causal, scale=None, dropout_rate=0.0, dropout_rng=None)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out.astype(jnp.float32) * real

    fused = jax.jit(jax.value_and_grad(lambda *a: attend(attention.dot_product_attention, *a), (0, 1, 2), has_aux=True))
    plain = jax.jit(jax.value_and_grad(lambda *a: attend(explicit.dot_product_attention, *a), (0, 1, 2), has_aux=True))
    assert "cudnn" in fused.lower(q, k, v).as_text().lower()  # the fused kernel, not the XLA form
    (_, out), grads = fused(q, k, v)
    (_, want), want_grads = plain(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-2, rtol=2e-2)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_checkpoint_blocks_assembled_on_the_gpu_equal_the_host_load(tmp_path, monkeypatch, param_dtype):
    """`hf:` onto the GPU, each parameter put there piece by piece (`mapping._place_in_pieces`; 100-byte pieces, so
    every tensor comes in many), equals the host load bit for bit: a random Llama stored in bfloat16, loaded into
    scanned layers."""
    fields = dict(vocab_size=64, max_len=16, emb_dim=32, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=48)

    def shapes(cfg):
        model = build_model("llama", cfg)
        return nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))

    stored = make_config("llama", fields)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda leaf: rng.normal(size=leaf.shape).astype(np.float32), shapes(stored))
    state_dict = {name: tensor.astype(ml_dtypes.bfloat16) for name, tensor in llama.to_hf(params, stored).items()}
    save_file(state_dict, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(llama.config_to_hf(stored)))
    cfg = make_config("llama", fields | {"scan_layers": True, "param_dtype": param_dtype})
    host, _ = hf.convert_pretrained(f"hf:{tmp_path}", "llama", cfg, shapes(cfg))
    gpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=gpu), shapes(cfg))
    monkeypatch.setattr(mapping, "_ROWS_PIECE_BYTES", 100)
    loaded, _ = hf.convert_pretrained(f"hf:{tmp_path}", "llama", cfg, target)
    flat_host = mapping.flatten(host)
    for path, leaf in mapping.flatten(loaded).items():
        assert isinstance(leaf, jax.Array) and leaf.sharding == gpu and leaf.dtype == jnp.dtype(param_dtype), path
        np.testing.assert_array_equal(np.asarray(leaf), flat_host[path], err_msg=path)
