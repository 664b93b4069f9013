"""Accelerator forms on a real GPU (skipped elsewhere): cuDNN's fused attention against the explicit form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo.kernels import explicit
from lmzoo.layers import attention

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
