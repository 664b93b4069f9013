"""Knowledge distillation (DistilBERT, Sanh et al. 2019): its losses and the recipe."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from lmzoo import models, weights
from lmzoo.objectives import base, losses, masking, tasks
from lmzoo.trainers.state import Task


def soft_cross_entropy(
    student_logits: jax.Array, teacher_logits: jax.Array, weights: jax.Array, temperature: float
) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy of the student against the teacher's softened distribution, scaled by T² so its
    gradients keep their size as T changes (Hinton et al. 2015). logits [..., V], weights [...] ->
    (summed loss, summed weights). Equals KL(teacher || student) * T² up to the teacher's entropy."""
    teacher = jax.nn.softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    student = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    per_position = -jnp.sum(teacher * student, axis=-1) * temperature**2
    weights = weights.astype(jnp.float32)
    return jnp.sum(per_position * weights), jnp.sum(weights)


def cosine_loss(
    student_hidden: jax.Array, teacher_hidden: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """1 - cos(student, teacher) of hidden states [..., D] at weighted positions [...] -> (sum, count)."""
    s, t = student_hidden.astype(jnp.float32), teacher_hidden.astype(jnp.float32)
    cos = jnp.sum(s * t, axis=-1) / (jnp.linalg.norm(s, axis=-1) * jnp.linalg.norm(t, axis=-1) + 1e-8)
    weights = weights.astype(jnp.float32)
    return jnp.sum((1.0 - cos) * weights), jnp.sum(weights)


@dataclasses.dataclass(frozen=True)
class DistillationConfig(masking.MaskedLMConfig):
    """Attributes (besides the MLM masking fields), DistilBERT's defaults:
    teacher: "ckpt:WORKDIR" or "hf:PATH" of the teacher, read at every start (never checkpointed).
    teacher_model: the teacher's model section (`lmzoo.config.model_section("bert", ...)`).
    init_student_from_teacher: student layer i <- teacher layer 2i before training.
    temperature, alpha_ce, alpha_mlm, alpha_cos: soft cross-entropy temperature and the loss weights.
    """

    teacher: str = ""
    teacher_model: Any = dataclasses.field(default_factory=dict)
    init_student_from_teacher: bool = True
    temperature: float = 2.0
    alpha_ce: float = 5.0
    alpha_mlm: float = 2.0
    alpha_cos: float = 1.0


def distillation_task(student, teacher, fields: DistillationConfig) -> Task:
    """DistilBERT: alpha_ce * soft cross-entropy against the frozen teacher at temperature T (x T²)
    + alpha_mlm * MLM + alpha_cos * (1 - cos) between final hidden states. The teacher lives in
    state.frozen, so both models run inside the same jitted step and only the student is updated."""

    def init(rng, batch):
        student_rng, teacher_rng = jax.random.split(rng)
        student_params = student.init({"params": student_rng, "dropout": rng}, batch["inputs"])["params"]
        teacher_params = teacher.init({"params": teacher_rng, "dropout": rng}, batch["inputs"])["params"]
        return student_params, {"teacher": teacher_params}

    def forward(model, params, batch, positions, rng, train):
        hidden, _ = model.apply(
            {"params": params},
            batch["inputs"],
            token_types=batch.get("token_types"),
            segment_ids=batch.get("segment_ids"),
            deterministic=not train,
            rngs={"dropout": rng},
            method=model.encode,
        )
        gathered = jnp.take_along_axis(hidden, positions[..., None], axis=1)
        return hidden, model.apply({"params": params}, gathered, method=model.mlm_logits)

    def loss(params, frozen, carry, batch, rng, *, step, train):
        positions, gathered = tasks.gather_predictions(batch, fields.mask_rate)
        teacher_hidden, teacher_logits = jax.lax.stop_gradient(
            forward(teacher, frozen["teacher"], batch, positions, rng, False)
        )
        student_hidden, student_logits = forward(student, params, batch, positions, rng, train)
        mlm_value, metrics = losses.token_loss(student_logits, gathered)
        soft_sum, soft_count = soft_cross_entropy(
            student_logits, teacher_logits, gathered["weights"], fields.temperature
        )
        real = jnp.ones(batch["inputs"].shape) if batch.get("segment_ids") is None else (batch["segment_ids"] != 0)
        cos_sum, cos_count = cosine_loss(student_hidden, teacher_hidden, real)
        value = (
            fields.alpha_ce * soft_sum / jnp.maximum(soft_count, 1.0)
            + fields.alpha_mlm * mlm_value
            + fields.alpha_cos * cos_sum / jnp.maximum(cos_count, 1.0)
        )
        return value, ({**metrics, "distill_loss": (soft_sum, soft_count), "cosine_loss": (cos_sum, cos_count)}, carry)

    return Task(init=init, loss=loss)


class Distillation(masking.MaskedWindows):
    """A smaller BERT student trained on MLM windows against a frozen teacher read from `objective.teacher`."""

    name = "distill"
    Config = DistillationConfig
    loss_is_token_nll = False  # soft cross-entropy + MLM + cosine terms

    def task(self, model):
        fields = self.fields
        return distillation_task(model, models.build_model("bert", dict(fields.teacher_model)), fields)

    def frozen_roles(self):
        return {"teacher": base.Role(self.fields.teacher, "bert", self.fields.teacher_model.to_dict())}

    def init_params(self, params, frozen):
        if not self.fields.init_student_from_teacher:
            return params
        from lmzoo.models import bert

        student = bert.distilbert_student_params(frozen["teacher"], self.fields.teacher_model.num_layers)
        return weights.merge_pretrained(params, student, self.config.model_name, name="teacher layers")
