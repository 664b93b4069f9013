"""Tasks (see `lmzoo.train.state.Task`) built from a config: which model, which objective."""

import ml_collections

from lmzoo import models
from lmzoo.objectives import causal_lm
from lmzoo.train.state import Task


def causal_lm_task(model) -> Task:
    """Next-token prediction for a decoder taking (tokens, positions, segment_ids)."""

    def apply(params, batch, rng, train):
        return model.apply(
            {"params": params},
            batch["inputs"],
            positions=batch.get("positions"),
            segment_ids=batch.get("segment_ids"),
            deterministic=not train,
            rngs={"dropout": rng},
        )

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], positions=batch.get("positions"))["params"]
        return params, {}, {}

    def loss(params, frozen, carry, batch, rng, *, train):
        value, metrics = causal_lm.loss(apply(params, batch, rng, train), batch)
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


OBJECTIVES = {"causal_lm": causal_lm_task}


def build_task(config: ml_collections.ConfigDict) -> Task:
    if config.objective.name not in OBJECTIVES:
        raise ValueError(f"unknown config.objective.name {config.objective.name!r}; choose one of {sorted(OBJECTIVES)}")
    model = models.build_model(config.model_name, config.model.to_dict())
    return OBJECTIVES[config.objective.name](model)
