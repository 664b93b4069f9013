"""Low-rank adapters attached beside a block's kernels, merged where the block runs.

A kernel leaf `name` [*batch, *inputs, *outputs] (batch: per-expert axes) may carry two siblings in its module's
params, `name + "_lora_a"` [*batch, *inputs, r] and `name + "_lora_b"` [*batch, r, *outputs], the adapters' scale
already in B: the block then runs on name + A B (`merge_attached`). `layers.blocks.BlockStack` merges them inside its
scan, one layer at a time, so a merged kernel and its gradient exist for one layer, not for the whole stack;
`lmzoo.models.lora.attach` puts adapters there (`lmzoo.models.lora` is LoRA itself: targets, init, export).
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


def fit(kernel_shape: tuple[int, ...], a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(batch axes, input axes) that make A [*batch, *inputs, r] and B [*batch, r, *outputs] fit the kernel
    [*batch, *inputs, *outputs]; None when they do not."""
    batch = len(a_shape) + len(b_shape) - len(kernel_shape) - 2
    inputs = len(a_shape) - batch - 1
    if batch < 0 or inputs < 1 or len(b_shape) - batch - 1 < 1:
        return None
    r = a_shape[-1]
    fits = (
        a_shape[:batch] == b_shape[:batch]
        and b_shape[batch] == r
        and kernel_shape == (*a_shape[:-1], *b_shape[batch + 1 :])
    )
    return (batch, inputs) if fits else None


def delta(a: jax.Array, b: jax.Array, batch: int, dtype: Any) -> jax.Array:
    """A B over the rank axis: [*batch, *inputs, r] x [*batch, r, *outputs] -> [*batch, *inputs, *outputs]."""
    letters = iter("abcdefghijklmnopqstuvwxyz")  # "r" is the rank
    lead = "".join(next(letters) for _ in range(batch))
    ins = "".join(next(letters) for _ in range(a.ndim - batch - 1))
    outs = "".join(next(letters) for _ in range(b.ndim - batch - 1))
    return jnp.einsum(
        f"{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}",
        a,
        b,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=dtype,
    )


def merged_kernel(kernel: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """kernel + A B, in the promoted dtype of the three (a bfloat16 kernel with float32 adapters merges to float32,
    so that small adapter updates are not rounded away). A and B must `fit` the kernel."""
    batch, _ = fit(tuple(kernel.shape), tuple(a.shape), tuple(b.shape))
    dtype = jnp.result_type(kernel.dtype, a.dtype, b.dtype)
    return jnp.asarray(kernel, dtype) + delta(a, b, batch, dtype)


def merge_attached(params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` (a module's nested dict) with every kernel that carries attached adapters replaced by
    `merged_kernel` and the adapters dropped; unchanged where none are attached."""
    merged = {}
    for name, value in params.items():
        if name.endswith((SUFFIX_A, SUFFIX_B)):
            continue
        if isinstance(value, Mapping):
            value = merge_attached(value)
        elif name + SUFFIX_A in params:
            value = merged_kernel(value, params[name + SUFFIX_A], params[name + SUFFIX_B])
        merged[name] = value
    return merged
