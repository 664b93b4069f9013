"""LoRA over a `Task` (`lmzoo.models.lora`): the trained params are the adapters; the frozen base rides in the frozen
params, so it is never checkpointed (a resumed run reads it again) and the optimizer state covers the adapters
alone. Everything that runs a task (gradient accumulation, steps_per_call, meshes) is unchanged."""

import jax

from lmzoo.models import lora
from lmzoo.trainers.state import Task

BASE = "lora_base"  # the frozen entry holding the base, unless the task already freezes it (DPO's "reference")


def lora_task(task: Task, config: lora.LoraConfig, *, base: str = BASE) -> Task:
    """`task` trained through adapters on `frozen[base]`: its own init's params, or a frozen tree it already holds
    (`base` "reference": the DPO reference is the policy's base, held once)."""

    def init(rng, batch):
        params, frozen = task.init(rng, batch)
        adapters = lora.init_adapters(jax.random.fold_in(rng, 1), params, config)
        return adapters, {**frozen, base: lora.freeze(frozen.get(base, params), config)}

    adapted = lora.lora_loss(task.loss, config)

    def loss(adapters, frozen, carry, batch, rng, *, step, train):
        return adapted(adapters, frozen[base], frozen, carry, batch, rng, step=step, train=train)

    def model_params(adapters, frozen):
        return lora.merge(frozen[base], adapters, config)

    return Task(init=init, loss=loss, initial_carry=task.initial_carry, model_params=model_params)
