"""Tasks (see `lmzoo.train.state.Task`) built from a config: which model, which objective."""

import ml_collections

from lmzoo import models
from lmzoo.objectives import causal_lm, mlm
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


def masked_lm_task(model, sentence_loss_weight: float = 1.0) -> Task:
    """MLM for encoders taking (tokens, token_types, segment_ids); adds NSP/SOP when the batch has
    sentence labels and the model a sentence head."""

    def apply(params, batch, rng, train):
        return model.apply(
            {"params": params}, batch["inputs"], token_types=batch.get("token_types"), segment_ids=batch.get("segment_ids"),
            deterministic=not train, rngs={"dropout": rng},
        )  # fmt: skip

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], token_types=batch.get("token_types"))["params"]
        return params, {}, {}

    def loss(params, frozen, carry, batch, rng, *, train):
        outputs = apply(params, batch, rng, train)
        logits, sentence_logits = outputs if isinstance(outputs, tuple) else (outputs, None)
        value, metrics = mlm.loss(logits, batch)
        if sentence_logits is not None and "sentence_labels" in batch:
            sentence_value, sentence_metrics = mlm.sentence_loss(sentence_logits, batch["sentence_labels"], batch.get("sentence_weights"))
            value = value + sentence_loss_weight * sentence_value
            metrics = {**metrics, **sentence_metrics}
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


OBJECTIVES = {
    "causal_lm": lambda model, objective: causal_lm_task(model),
    "mlm": lambda model, objective: masked_lm_task(model, objective.sentence_loss_weight),
    "mlm_nsp": lambda model, objective: masked_lm_task(model, objective.sentence_loss_weight),
    "mlm_sop": lambda model, objective: masked_lm_task(model, objective.sentence_loss_weight),
}


def build_task(config: ml_collections.ConfigDict) -> Task:
    if config.objective.name not in OBJECTIVES:
        raise ValueError(f"unknown config.objective.name {config.objective.name!r}; choose one of {sorted(OBJECTIVES)}")
    model = models.build_model(config.model_name, config.model.to_dict())
    return OBJECTIVES[config.objective.name](model, config.objective)
