"""The tasks (init + loss, `trainers.state.Task`) of each model kind, shared by the objectives that train it:
a decoder's next-token loss with the head fused, an encoder-decoder's loss on its targets, an encoder's masked-LM
loss at the masked positions only."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from lmzoo.models import experts
from lmzoo.objectives import losses
from lmzoo.trainers.state import Task


def causal_lm_task(model) -> Task:
    """Next-token prediction for a decoder taking (tokens, positions, segment_ids) with `return_hidden` and
    `output_embedding` (GPT-2): the head and loss are fused so the [B, T, V] logits are never stored. A model with
    experts (`models.experts.has_experts`) is applied through `models.experts.AuxCollector`: its layers' auxiliary
    losses join the loss and their statistics the metrics."""
    has_experts = experts.has_experts(model)

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], positions=batch.get("positions"))[
            "params"
        ]
        return params, {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        applied = experts.AuxCollector(model) if has_experts else model
        _, hidden = applied.apply(
            {"params": params},
            batch["inputs"],
            positions=batch.get("positions"),
            segment_ids=batch.get("segment_ids"),
            deterministic=not train,
            return_hidden=True,
            rngs={"dropout": rng},
        )
        embedding = model.apply({"params": params}, method=model.output_embedding)
        value, metrics = losses.fused_head_loss(hidden, embedding, batch)
        if has_experts:
            aux, aux_metrics = applied.terms()
            value, metrics = value + aux, {**metrics, **aux_metrics}
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def seq2seq_task(model) -> Task:
    """Encoder-decoder next-token loss on the targets (span corruption, denoising, translation)."""

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], batch["decoder_inputs"])["params"]
        return params, {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        logits = model.apply(
            {"params": params},
            batch["inputs"],
            batch["decoder_inputs"],
            encoder_segment_ids=batch.get("encoder_segment_ids"),
            deterministic=not train,
            rngs={"dropout": rng},
        )
        value, metrics = losses.token_loss(logits, batch)
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def seq2seq_real_tokens(batch: dict[str, np.ndarray]) -> int:
    """Encoder tokens plus decoder targets that are not padding."""
    return int(np.count_nonzero(batch["encoder_segment_ids"]) + np.count_nonzero(batch["weights"]))


def num_predictions(length: int, mask_rate: float) -> int:
    """Positions per row that hold every masked position: ceil(mask_rate * T) + 1 (masking selects
    round(mask_rate * candidates) <= that), at most T."""
    return min(length, math.ceil(mask_rate * length) + 1)


def gather_predictions(batch: dict[str, jax.Array], mask_rate: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The highest-weight positions [B, M] of each row and the targets / weights there [B, M]."""
    positions = jax.lax.top_k(batch["weights"], num_predictions(batch["inputs"].shape[1], mask_rate))[1]
    return positions, {k: jnp.take_along_axis(batch[k], positions, axis=1) for k in ("targets", "weights")}


def masked_lm_task(model, *, mask_rate: float, sentence_loss_weight: float = 1.0) -> Task:
    """MLM for encoders with `pretraining_logits`; adds NSP/SOP when the batch has sentence labels.
    Logits are computed only at the `num_predictions` highest-weight positions of each row."""

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], token_types=batch.get("token_types"))[
            "params"
        ]
        return params, {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        positions, gathered = gather_predictions(batch, mask_rate)
        logits, sentence_logits = model.apply(
            {"params": params},
            batch["inputs"],
            positions,
            token_types=batch.get("token_types"),
            segment_ids=batch.get("segment_ids"),
            deterministic=not train,
            rngs={"dropout": rng},
            method=model.pretraining_logits,
        )
        value, metrics = losses.token_loss(logits, gathered)
        if sentence_logits is not None and "sentence_labels" in batch:
            weights = batch.get("example_weights", jnp.ones(batch["sentence_labels"].shape, jnp.float32))
            sentence_value, sentence_metrics = losses.weighted_loss(
                sentence_logits, batch["sentence_labels"], weights, "sentence_"
            )
            value = value + sentence_loss_weight * sentence_value
            metrics = {**metrics, **sentence_metrics}
        return value, (metrics, carry)

    return Task(init=init, loss=loss)
