"""LayerNorm and RMS norm over the last axis, with float32 statistics."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import kernels
from lmzoo.kernels import cpu


def normalize(x: jax.Array, scale: jax.Array, epsilon: float, use_mean: bool) -> jax.Array:
    """(x - mean) / sqrt(var + epsilon) * scale over the last axis, in float32 (RMS norm without the mean).

    x [..., D], scale [D] -> float32 [..., D] (`kernels.cpu.normalize`, with its derivative written out, on the CPU).
    """
    if kernels.on_cpu():
        return cpu.normalize(x, scale, epsilon, use_mean)
    x32 = x.astype(jnp.float32)
    if use_mean:
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon) * scale.astype(jnp.float32)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis (`use_bias=False, use_mean=False` gives T5's RMS norm)."""

    epsilon: float = 1e-5
    use_bias: bool = True
    use_mean: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in dtype; the statistics are computed in float32."""
        d = x.shape[-1]
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (d,), self.param_dtype
        )
        y = normalize(x, scale, self.epsilon, self.use_mean)
        if self.use_bias:
            y = y + self.param(
                "bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), (d,), self.param_dtype
            )
        return y.astype(self.dtype)
