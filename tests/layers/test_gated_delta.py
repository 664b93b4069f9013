"""Gated DeltaNet (`layers.gated_delta`): the chunked recurrence equals the token-by-token delta rule (any chunk size,
a starting state, document resets), the causal convolution continues from its state, packed documents equal the same
documents run apart, and decoding chunk by chunk against the cache equals the full forward."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo.layers import gated_delta

B, T, N, H, P = 2, 13, 3, 4, 5


def sequential_reference(q, k, v, g, b, state, starts):
    """The delta rule one token at a time, in float64: reset, decay, correct towards v, read with q."""
    s = np.array(state, np.float64)
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        s = s * (1.0 - starts[:, t])[:, None, None, None] * np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - np.einsum("BNHP,BNH->BNP", s, k[:, t])) * b[:, t][..., None]
        s = s + np.einsum("BNH,BNP->BNHP", k[:, t], delta)
        out[:, t] = np.einsum("BNHP,BNH->BNP", s, q[:, t])
    return out, s


def random_inputs(seed=0):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(B, T, N, H))
    return (
        rng.normal(size=(B, T, N, H)),
        k / np.linalg.norm(k, axis=-1, keepdims=True),
        rng.normal(size=(B, T, N, P)),
        -rng.uniform(0.01, 2.0, size=(B, T, N)),
        rng.uniform(size=(B, T, N)),
        rng.normal(size=(B, N, H, P)),
    )


class ChunkedRuleTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_equals_the_sequential_rule(self):
        q, k, v, g, b, state = random_inputs()
        starts = np.zeros((B, T), bool)
        starts[0, 5] = starts[1, 3] = starts[1, 4] = starts[1, 12] = True  # resets mid-chunk, adjacent, at the end
        for chunk_size in (1, 4, 5, 64):
            for resets in (None, starts):
                rule = self.variant(
                    lambda *xs, resets=resets, chunk_size=chunk_size: gated_delta.gated_delta_rule(
                        *xs[:5], state=xs[5], starts=resets, chunk_size=chunk_size
                    )
                )
                out, final = rule(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, b, state)))
                chex.assert_shape(out, (B, T, N, P))
                want, want_final = sequential_reference(
                    q, k, v, g, b, state, np.zeros((B, T)) if resets is None else resets
                )
                np.testing.assert_allclose(out, want, atol=1e-5, err_msg=f"chunk {chunk_size}")
                np.testing.assert_allclose(final, want_final, atol=1e-5, err_msg=f"chunk {chunk_size}")


def test_convolution_continues_from_its_state():
    rng = np.random.default_rng(1)
    x, kernel = jnp.asarray(rng.normal(size=(B, 9, 6))), jnp.asarray(rng.normal(size=(4, 6)))
    whole = gated_delta.causal_conv(x, kernel)
    first = gated_delta.causal_conv(x[:, :5], kernel)
    second = gated_delta.causal_conv(x[:, 5:], kernel, state=x[:, 2:5])
    np.testing.assert_allclose(jnp.concatenate([first, second], axis=1), whole, atol=1e-6)
    # tap w multiplies x[t - 3 + w]: the last tap the current position
    np.testing.assert_allclose(whole[:, 0], x[:, 0] * kernel[3], atol=1e-6)


def layer(**fields):
    config = gated_delta.GatedDeltaConfig(
        **{"num_key_heads": 2, "num_value_heads": 4, "key_dim": 6, "value_dim": 5, "chunk_size": 4, **fields}
    )
    return gated_delta.GatedDeltaNet(
        config, kernel_init=nn.initializers.normal(0.3), out_init=nn.initializers.normal(0.3)
    )


def test_packed_documents_equal_the_documents_apart():
    module, x = layer(), jax.random.normal(jax.random.key(0), (1, 11, 16))
    params = jax.jit(module.init)(jax.random.key(1), x)
    apply = jax.jit(module.apply)
    segments = jnp.asarray([[1] * 5 + [2] * 5 + [0]])
    packed = apply(params, x, segment_ids=segments)
    apart = apply(params, x[:, :10].reshape(2, 5, 16))  # each document a row of its own
    np.testing.assert_allclose(packed[:, :10].reshape(apart.shape), apart, atol=1e-5)


@pytest.mark.parametrize("chunks", [(1,) * 9, (4, 1, 1, 3)])
def test_decoding_in_chunks_equals_the_full_forward(chunks):
    module, x = layer(), jax.random.normal(jax.random.key(0), (B, 9, 16))
    params = jax.jit(module.init)(jax.random.key(1), x)
    full = jax.jit(module.apply)(params, x)
    cache = jax.eval_shape(lambda: module.init(jax.random.key(1), x, decode=True)["cache"])
    cache = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), cache)
    step = jax.jit(lambda cache, chunk: module.apply({**params, "cache": cache}, chunk, decode=True, mutable=["cache"]))
    outs, start = [], 0
    for size in chunks:
        out, variables = step(cache, x[:, start : start + size])
        cache, start = variables["cache"], start + size
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5)
    # a row whose chunk is all padding keeps its state
    padded, after = module.apply(
        {**params, "cache": cache}, x[:, :1], segment_ids=jnp.asarray([[1], [0]]), decode=True, mutable=["cache"]
    )
    for name in ("conv_state", "recurrent_state"):
        np.testing.assert_array_equal(after["cache"][name][1], cache[name][1])
        assert not np.allclose(after["cache"][name][0], cache[name][0])
