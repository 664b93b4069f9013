"""Train state and the task interface every family and objective plugs into.

A `Task` is two pure functions. `init(rng, batch)` builds the trainable params, the frozen
params (a distillation teacher, a PPO reference policy) and the carry (state that flows from one
batch to the next, e.g. LSTM hidden states). `loss(params, frozen, carry, batch, rng, train)`
returns the scalar to minimise with metrics as (sum, count) pairs and the next carry. Several
models, their own rngs and objectives other than next-token prediction all fit this shape.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import struct

PyTree = Any
Metrics = dict[str, tuple[jax.Array, jax.Array]]
InitFn = Callable[[jax.Array, dict[str, jax.Array]], tuple[PyTree, PyTree, PyTree]]
LossFn = Callable[..., tuple[jax.Array, tuple[Metrics, PyTree]]]


@dataclasses.dataclass(frozen=True)
class Task:
    """init(rng, batch) -> (params, frozen, carry); loss(params, frozen, carry, batch, rng, *, train)."""

    init: InitFn
    loss: LossFn


@struct.dataclass
class TrainState:
    """Everything a step needs; checkpointed whole.

    rng is raw key data (uint32 [2]) so that it serialises like any other array.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    rng: jax.Array
    frozen: PyTree
    carry: PyTree
