"""LoRA over a `Task` (`lmzoo.trainers.state`): the trained params are the adapters; the frozen base rides in the
frozen params, so it is never checkpointed (a resumed run reads it again, as its declared "lora_base" role) and the
optimizer state covers the adapters alone. Everything that runs a task (gradient accumulation, steps_per_call,
meshes) is unchanged."""

import dataclasses
from typing import Any

import jax

from lmzoo.lora import transform

BASE = "lora_base"  # the frozen entry holding the base, unless the task already freezes it (DPO's "reference")


def lora_task(task: Any, config: transform.LoraConfig, *, base: str = BASE) -> Any:
    """`task` (a `trainers.state.Task`) trained through adapters on `frozen[base]`: its own init's params, or a frozen
    tree it already holds (`base` "reference": the DPO reference is the policy's base, held once)."""

    def init(rng, batch):
        params, frozen = task.init(rng, batch)
        adapters = transform.init_adapters(jax.random.fold_in(rng, 1), params, config)
        return adapters, {**frozen, base: transform.freeze(frozen.get(base, params), config)}

    adapted = transform.lora_loss(task.loss, config)

    def loss(adapters, frozen, carry, batch, rng, *, step, train):
        return adapted(adapters, frozen[base], frozen, carry, batch, rng, step=step, train=train)

    def model_params(adapters, frozen):
        return transform.merge(frozen[base], adapters, config)

    return dataclasses.replace(task, init=init, loss=loss, model_params=model_params)
