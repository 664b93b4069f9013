"""Mixture-of-experts models in training: the auxiliary loss of their layers (`moe_aux_loss`, from what each
`layers.mlp.MoeBlock` sows into `layers.mlp.MOE_COLLECTION`) and `AuxCollector`, for the objectives and trainers
whose maths applies the model itself (DPO's reply log-probs, a reward model's scores, a PPO policy's update): the
layers' losses join the loss and their statistics the metrics wherever a model with experts is trained."""

import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from lmzoo.layers import mlp

Metrics = dict[str, tuple[jax.Array, jax.Array]]


def has_experts(model: Any) -> bool:
    """Whether `model`, or the decoder or backbone it wraps (a classifier, a policy with a value head), has
    mixture-of-experts layers."""
    inner = [getattr(model, name, None) for name in ("backbone", "decoder")]
    return any(getattr(m, "has_experts", False) for m in (model, *inner))


def moe_aux_loss(variables: dict[str, Any]) -> tuple[jax.Array, Metrics]:
    """The auxiliary loss of a model's mixture-of-experts layers and their metrics, from the "stats" each layer sowed
    into `variables[layers.mlp.MOE_COLLECTION]` (`layers.mlp.MoeBlock`; under nn.scan, stacked on a leading layers
    axis).

    Returns the mean over layers of each layer's weighted aux_loss (HF's Mixtral and MaxText add one layer's worth)
    and, as (sum, count) pairs, the means over layers of "moe/aux_loss", "moe/load_balance", "moe/router_z" and
    "moe/dropped", and "expert_load/L_E", the fraction of layer L's assignments expert E received.
    """
    sown = traverse_util.flatten_dict(variables[mlp.MOE_COLLECTION])  # path -> the values of each call

    def model_order(path: tuple[str, ...]) -> list:  # "layer_10" after "layer_9"
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", "/".join(path))]

    calls = [call for path in sorted(sown, key=model_order) for call in sown[path]]
    stats = {name: jnp.concatenate([jnp.reshape(call[name], (-1,)) for call in calls]) for name in calls[0]}
    num_layers = stats["aux_loss"].shape[0]
    loads = stats.pop("expert_load").reshape(num_layers, -1)  # [L, E]
    count = jnp.asarray(num_layers, jnp.float32)
    metrics = {f"moe/{name}": (jnp.sum(values), count) for name, values in stats.items()}
    metrics.update(
        {
            f"expert_load/{layer}_{expert}": (loads[layer, expert], jnp.ones((), jnp.float32))
            for layer in range(num_layers)
            for expert in range(loads.shape[1])
        }
    )
    return jnp.mean(stats["aux_loss"]), metrics


class AuxCollector:
    """`model` whose `apply` also collects, call by call, its mixture-of-experts layers' auxiliary loss and metrics
    (`moe_aux_loss`): hand it to maths that applies the model (e.g. `rl.preference.reply_logprobs`) inside a loss,
    then add `terms()` to that loss. Built anew in each traced loss call; other attributes are the model's."""

    def __init__(self, model: Any):
        self.model, self.collected = model, []

    def apply(self, variables: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        outputs, sown = self.model.apply(variables, *args, mutable=[mlp.MOE_COLLECTION], **kwargs)
        self.collected.append(moe_aux_loss(sown))
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def terms(self) -> tuple[jax.Array, Metrics]:
        """(the mean of the collected calls' aux losses, their metrics summed over the calls)."""
        losses, metrics = zip(*self.collected, strict=True)
        summed = jax.tree.map(lambda *values: sum(values), *metrics)
        return jnp.mean(jnp.stack(losses)), summed
