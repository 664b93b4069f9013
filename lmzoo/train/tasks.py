"""Tasks (see `lmzoo.train.state.Task`) built from a config: which model, which objective."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from lmzoo import models
from lmzoo.models import heads
from lmzoo.objectives import causal_lm, distillation, mlm
from lmzoo.train.state import Task


def causal_lm_task(model) -> Task:
    """Next-token prediction for a decoder taking (tokens, positions, segment_ids) with `return_hidden` and
    `output_embedding` (GPT-2): the head and loss are fused so the [B, T, V] logits are never stored."""

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], positions=batch.get("positions"))["params"]
        return params, {}, {}

    def loss(params, frozen, carry, batch, rng, *, train):
        _, hidden = model.apply(
            {"params": params}, batch["inputs"], positions=batch.get("positions"), segment_ids=batch.get("segment_ids"),
            deterministic=not train, return_hidden=True, rngs={"dropout": rng},
        )  # fmt: skip
        embedding = model.apply({"params": params}, method=model.output_embedding)
        value, metrics = causal_lm.fused_head_loss(hidden, embedding, batch)
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def masked_lm_task(model, *, mask_rate: float, sentence_loss_weight: float = 1.0) -> Task:
    """MLM for encoders with `pretraining_logits`; adds NSP/SOP when the batch has sentence labels.

    Logits are computed at the M = ceil(mask_rate * T) + 1 highest-weight positions of each row,
    which hold every masked position (masking selects round(mask_rate * candidates) <= M).
    """

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], token_types=batch.get("token_types"))["params"]
        return params, {}, {}

    def loss(params, frozen, carry, batch, rng, *, train):
        num_predictions = min(batch["inputs"].shape[1], math.ceil(mask_rate * batch["inputs"].shape[1]) + 1)
        positions = jax.lax.top_k(batch["weights"], num_predictions)[1]
        logits, sentence_logits = model.apply(
            {"params": params}, batch["inputs"], positions, token_types=batch.get("token_types"),
            segment_ids=batch.get("segment_ids"), deterministic=not train, rngs={"dropout": rng},
            method=model.pretraining_logits,
        )  # fmt: skip
        gathered = {k: jnp.take_along_axis(batch[k], positions, axis=1) for k in ("targets", "weights")}
        value, metrics = mlm.loss(logits, gathered)
        if sentence_logits is not None and "sentence_labels" in batch:
            sentence_value, sentence_metrics = mlm.sentence_loss(
                sentence_logits, batch["sentence_labels"], batch.get("example_weights")
            )
            value = value + sentence_loss_weight * sentence_value
            metrics = {**metrics, **sentence_metrics}
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def distillation_task(student, teacher, objective: ml_collections.ConfigDict) -> Task:
    """DistilBERT: alpha_ce * soft cross-entropy against the frozen teacher at temperature T (x T²)
    + alpha_mlm * MLM + alpha_cos * (1 - cos) between final hidden states. The teacher lives in
    state.frozen, so both models run inside the same jitted step and only the student is updated."""

    def init(rng, batch):
        student_rng, teacher_rng = jax.random.split(rng)
        student_params = student.init({"params": student_rng, "dropout": rng}, batch["inputs"])["params"]
        teacher_params = teacher.init({"params": teacher_rng, "dropout": rng}, batch["inputs"])["params"]
        return student_params, {"teacher": teacher_params}, {}

    def forward(model, params, batch, positions, rng, train):
        hidden, _ = model.apply(
            {"params": params}, batch["inputs"], token_types=batch.get("token_types"), segment_ids=batch.get("segment_ids"),
            deterministic=not train, rngs={"dropout": rng}, method=model.encode,
        )  # fmt: skip
        gathered = jnp.take_along_axis(hidden, positions[..., None], axis=1)
        return hidden, model.apply({"params": params}, gathered, method=model.mlm_logits)

    def loss(params, frozen, carry, batch, rng, *, train):
        num_predictions = min(batch["inputs"].shape[1], math.ceil(objective.mask_rate * batch["inputs"].shape[1]) + 1)
        positions = jax.lax.top_k(batch["weights"], num_predictions)[1]
        teacher_hidden, teacher_logits = jax.lax.stop_gradient(forward(teacher, frozen["teacher"], batch, positions, rng, False))
        student_hidden, student_logits = forward(student, params, batch, positions, rng, train)
        gathered = {k: jnp.take_along_axis(batch[k], positions, axis=1) for k in ("targets", "weights")}
        mlm_value, metrics = mlm.loss(student_logits, gathered)
        soft_sum, soft_count = distillation.soft_cross_entropy(student_logits, teacher_logits, gathered["weights"], objective.temperature)
        real = jnp.ones(batch["inputs"].shape) if batch.get("segment_ids") is None else (batch["segment_ids"] != 0)
        cos_sum, cos_count = distillation.cosine_loss(student_hidden, teacher_hidden, real)
        value = (objective.alpha_ce * soft_sum / jnp.maximum(soft_count, 1.0) + objective.alpha_mlm * mlm_value
                 + objective.alpha_cos * cos_sum / jnp.maximum(cos_count, 1.0))  # fmt: skip
        return value, ({**metrics, "distill_loss": (soft_sum, soft_count), "cosine_loss": (cos_sum, cos_count)}, carry)

    return Task(init=init, loss=loss)


def classification_task(model) -> Task:
    """Sequence classification: model(tokens, token_types, segment_ids) -> logits [B, C]; batch["labels"] [B]."""

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], token_types=batch.get("token_types"),
                            segment_ids=batch.get("segment_ids"))["params"]  # fmt: skip
        return params, {}, {}

    def loss(params, frozen, carry, batch, rng, *, train):
        logits = model.apply(
            {"params": params}, batch["inputs"], token_types=batch.get("token_types"), segment_ids=batch.get("segment_ids"),
            deterministic=not train, rngs={"dropout": rng},
        )  # fmt: skip
        weights = batch.get("example_weights", jnp.ones(batch["labels"].shape, jnp.float32))
        total, count = causal_lm.cross_entropy(logits, batch["labels"], weights)
        correct = jnp.sum((jnp.argmax(logits, axis=-1) == batch["labels"]) * weights).astype(jnp.float32)
        return total / jnp.maximum(count, 1.0), ({"loss": (total, count), "accuracy": (correct, count)}, carry)

    return Task(init=init, loss=loss)


def seq2seq_task(model) -> Task:
    """Encoder-decoder next-token loss on the targets (span corruption, denoising, translation)."""

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], batch["decoder_inputs"])["params"]
        return params, {}, {}

    def loss(params, frozen, carry, batch, rng, *, train):
        logits = model.apply(
            {"params": params}, batch["inputs"], batch["decoder_inputs"], encoder_segment_ids=batch.get("encoder_segment_ids"),
            deterministic=not train, rngs={"dropout": rng},
        )  # fmt: skip
        value, metrics = causal_lm.loss(logits, batch)
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def build_model(config: ml_collections.ConfigDict) -> nn.Module:
    """The network the objective trains: the family's model, wrapped in a head for classification."""
    model = models.build_model(config.model_name, config.model.to_dict())
    if config.objective.name == "classify":
        o = config.objective
        model = heads.SequenceClassifier(model, o.num_classes, head=o.head, pooling=o.pooling, dropout_rate=o.head_dropout_rate)
    return model


OBJECTIVES = {
    "causal_lm": lambda model, objective: causal_lm_task(model),
    "mlm": lambda model, o: masked_lm_task(model, mask_rate=o.mask_rate, sentence_loss_weight=o.sentence_loss_weight),
    "mlm_nsp": lambda model, o: masked_lm_task(model, mask_rate=o.mask_rate, sentence_loss_weight=o.sentence_loss_weight),
    "mlm_sop": lambda model, o: masked_lm_task(model, mask_rate=o.mask_rate, sentence_loss_weight=o.sentence_loss_weight),
    "classify": lambda model, objective: classification_task(model),
    "span_corruption": lambda model, objective: seq2seq_task(model),
    "denoising": lambda model, objective: seq2seq_task(model),
    "distill": lambda model, o: distillation_task(model, models.build_model("bert", o.teacher_model.to_dict()), o),
    "text_to_text": lambda model, objective: seq2seq_task(model),
}


def build_task(config: ml_collections.ConfigDict, model: nn.Module) -> Task:
    if config.objective.name not in OBJECTIVES:
        raise ValueError(f"unknown config.objective.name {config.objective.name!r}; choose one of {sorted(OBJECTIVES)}")
    return OBJECTIVES[config.objective.name](model, config.objective)
