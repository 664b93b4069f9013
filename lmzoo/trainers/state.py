"""Train state and the task interface the supervised trainer runs.

A `Task` is pure functions. `init(rng, batch)` builds the trainable params and the frozen params
(a distillation teacher, a PPO reference policy). `loss(params, frozen, carry, batch, rng, *, step,
train)` returns the scalar to minimise with metrics as (sum, count) pairs and the next carry: state
that flows from one batch to the next, row by row (an LSTM's hidden states), starting from
`initial_carry(batch_size)`, whose arrays are boxed with logical axes (batch first) so they shard
with their rows. `step` is the optimizer step (KL annealing, schedules inside the loss).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import struct

PyTree = Any
Metrics = dict[str, tuple[jax.Array, jax.Array]]
InitFn = Callable[[jax.Array, dict[str, jax.Array]], tuple[PyTree, PyTree]]
LossFn = Callable[..., tuple[jax.Array, tuple[Metrics, PyTree]]]


def no_carry(batch_size: int) -> dict:
    return {}


def own_params(params: PyTree, frozen: PyTree) -> PyTree:
    return params


@dataclasses.dataclass(frozen=True)
class Task:
    """init(rng, batch) -> (params, frozen); loss(params, frozen, carry, batch, rng, *, step, train);
    initial_carry(batch_size) -> carry ({} for models without recurrent state); model_params(params, frozen) -> the
    model's params where the trained ones are not (LoRA adapters over a frozen base: `lmzoo.lora.lora_task`)."""

    init: InitFn
    loss: LossFn
    initial_carry: Callable[[int], PyTree] = no_carry
    model_params: Callable[[PyTree, PyTree], PyTree] = own_params


@struct.dataclass
class TrainState:
    """Everything a supervised step needs. Checkpointed without `frozen`, which is read again from
    the paths the config names when a run resumes.

    rng is raw key data (uint32 [2]) so that it serialises like any other array.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    rng: jax.Array
    frozen: PyTree
    carry: PyTree
