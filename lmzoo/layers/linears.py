"""Projections: `project` (an einsum of activations with a kernel) and `Einsum`, its module with logical axes."""

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import kernels
from lmzoo.kernels import cpu

Initializer = Callable[..., jax.Array]


def project(eqn: str, x: jax.Array, kernel: jax.Array, **dot_kwargs: Any) -> jax.Array:
    """`jnp.einsum(eqn, x, kernel)` for a projection (`kernels.cpu.project`, one 2-D matmul, on the CPU).
    dot_kwargs: e.g. preferred_element_type."""
    if kernels.on_cpu():
        return cpu.project(eqn, x, kernel, **dot_kwargs)
    return jnp.einsum(eqn, x, kernel, **dot_kwargs)


class Einsum(nn.Module):
    """A projection `einsum(eqn, x, kernel) (+ bias)` whose kernel carries logical axis names.

    Attributes:
        shape: kernel shape, e.g. (D, N, H).
        axes: one logical name per kernel dimension, e.g. ("embed", "heads", "kv").
        use_bias: add a bias over the kernel dimensions that appear in the output.
    """

    shape: Sequence[int]
    axes: Sequence[str]
    use_bias: bool = False
    kernel_init: Initializer = nn.initializers.normal(0.02)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, eqn: str, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(self.kernel_init, tuple(self.axes)),
            tuple(self.shape),
            self.param_dtype,
        )
        y = project(eqn, x.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            in_spec, out_spec = eqn.replace(" ", "").split("->")
            kernel_spec = in_spec.split(",")[1]
            keep = [i for i, letter in enumerate(kernel_spec) if letter in out_spec]
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, tuple(self.axes[i] for i in keep)),
                tuple(self.shape[i] for i in keep),
                self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        return y
