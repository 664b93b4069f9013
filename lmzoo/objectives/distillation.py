"""Knowledge distillation losses (DistilBERT, Sanh et al. 2019)."""

import jax
import jax.numpy as jnp


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


def cosine_loss(student_hidden: jax.Array, teacher_hidden: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """1 - cos(student, teacher) of hidden states [..., D] at weighted positions [...] -> (sum, count)."""
    s, t = student_hidden.astype(jnp.float32), teacher_hidden.astype(jnp.float32)
    cos = jnp.sum(s * t, axis=-1) / (jnp.linalg.norm(s, axis=-1) * jnp.linalg.norm(t, axis=-1) + 1e-8)
    weights = weights.astype(jnp.float32)
    return jnp.sum((1.0 - cos) * weights), jnp.sum(weights)
