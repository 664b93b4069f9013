"""Optimizer from `config.optim`: AdamW, linear warmup + cosine decay to a floor, clipping, decay mask."""

import ml_collections
import optax
from flax import traverse_util

NO_DECAY_NAMES = ("bias", "scale")


def learning_rate_schedule(optim: ml_collections.ConfigDict) -> optax.Schedule:
    """0 -> learning_rate over warmup_steps, then cosine down to min_learning_rate at decay_steps."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=optim.learning_rate,
        warmup_steps=optim.warmup_steps,
        decay_steps=max(optim.decay_steps, optim.warmup_steps + 1),
        end_value=optim.min_learning_rate,
    )


def weight_decay_mask(params, *, decay_embeddings: bool):
    """True for matrices that get weight decay: kernels, and embeddings when configured.

    Norm scales and biases never decay (a common cause of instability when they do).
    """
    flat = traverse_util.flatten_dict(params)

    def decays(path) -> bool:
        name = path[-1]
        if name in NO_DECAY_NAMES or name.endswith("_bias"):  # mlm_bias, final_logits_bias
            return False
        if name == "embedding":
            return decay_embeddings
        return True

    return traverse_util.unflatten_dict({path: decays(path) for path in flat})


def make_optimizer(optim: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(transformation, schedule). Gradient accumulation lives in the train step, not here."""
    if optim.name != "adamw":
        raise ValueError(f"unknown config.optim.name {optim.name!r}; supported: 'adamw'")
    schedule = learning_rate_schedule(optim)
    tx = optax.chain(
        optax.clip_by_global_norm(optim.grad_clip) if optim.grad_clip > 0 else optax.identity(),
        optax.adamw(
            schedule,
            b1=optim.b1,
            b2=optim.b2,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            mask=lambda params: weight_decay_mask(params, decay_embeddings=optim.decay_embeddings),
        ),
    )
    return tx, schedule
