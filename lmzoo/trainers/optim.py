"""Optimizer from `config.optim`: AdamW, linear warmup + cosine decay to a floor, clipping, decay mask,
and optionally other settings for parameter subtrees (a value head at its own learning rate).

`optim.groups` is a tuple of (path, overrides) pairs: the params under `path` ("value_head", or
"backbone/blocks" for a nested subtree) get AdamW with the fields of `overrides` replaced (any of
learning_rate, min_learning_rate, warmup_steps, decay_steps, b1, b2, eps, weight_decay); the first
matching group wins, the rest of the params use the section's own settings. Gradients are clipped by
their global norm over all params before the per-group updates.

The routing biases that balance the experts' load (`layers.mlp.CORRECTION_BIAS`, DeepSeek-V3) are not trained by
AdamW: their gradient is each expert's imbalance (`layers.mlp.balancing_signal`), and each step moves them by
`optim.expert_bias_rate` against its sign (auxiliary-loss-free balancing: an overloaded expert's bias goes down);
0 keeps them as loaded. They take no part in clipping, moments or weight decay, and the optimizer's state is the
same with or without them.
"""

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util

from lmzoo.layers import mlp

NO_DECAY_NAMES = ("bias", "scale")
GROUP_FIELDS = ("learning_rate", "min_learning_rate", "warmup_steps", "decay_steps", "b1", "b2", "eps", "weight_decay")


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


def _adamw(optim: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(optim)
    tx = optax.adamw(
        schedule,
        b1=optim.b1,
        b2=optim.b2,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        mask=lambda params: weight_decay_mask(params, decay_embeddings=optim.decay_embeddings),
    )
    return tx, schedule


def group_labels(params, paths: list[str]):
    """The label of every param leaf: the first of `paths` ("a/b") that prefixes its path, else "default".
    Raises ValueError for a path that names no params (a misspelt group would silently train with the defaults)."""
    prefixes = [tuple(p.split("/")) for p in paths]

    def label(path) -> str:
        return next((p for p, prefix in zip(paths, prefixes, strict=True) if path[: len(prefix)] == prefix), "default")

    labels = {path: label(path) for path in traverse_util.flatten_dict(params)}
    unmatched = [p for p in paths if p not in labels.values()]
    if unmatched:
        top = sorted({path[0] for path in labels})
        raise ValueError(
            f"config.optim.groups names {unmatched}, which match no parameters (or only ones an earlier "
            f"group took); paths are '/'-joined param names, top level: {top}"
        )
    return traverse_util.unflatten_dict(labels)


def _is_correction_bias(path) -> bool:
    return getattr(path[-1], "key", None) == mlp.CORRECTION_BIAS


def expert_bias_balancing(tx: optax.GradientTransformation, rate: float) -> optax.GradientTransformation:
    """`tx` for every param but the routing correction biases, whose updates are -rate * sign(gradient) (the
    gradient being the expert's load minus the mean load); `tx` sees zeros in their place, so they add nothing to
    its clipping norm or moments. The state is `tx`'s own."""

    def update(grads, state, params=None):
        balanced = jax.tree_util.tree_map_with_path(lambda path, g: _is_correction_bias(path), grads)
        others = jax.tree.map(lambda g, b: jnp.zeros_like(g) if b else g, grads, balanced)
        updates, state = tx.update(others, state, params)
        updates = jax.tree.map(
            lambda u, g, b: -rate * jnp.sign(g).astype(u.dtype) if b else u, updates, grads, balanced
        )
        return updates, state

    return optax.GradientTransformation(tx.init, update)


def make_optimizer(optim: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(transformation, the default group's schedule). Gradient accumulation lives in the trainer, not here."""
    if optim.name != "adamw":
        raise ValueError(f"unknown config.optim.name {optim.name!r}; supported: 'adamw'")
    tx, schedule = _adamw(optim)
    groups = [(path, dict(overrides)) for path, overrides in optim.get("groups", ())]
    if groups:
        transforms = {"default": tx}
        for path, overrides in groups:
            unknown = sorted(set(overrides) - set(GROUP_FIELDS))
            if unknown:
                raise ValueError(f"config.optim.groups[{path!r}] sets {unknown}; a group may set {list(GROUP_FIELDS)}")
            settings = ml_collections.ConfigDict(optim.to_dict())
            settings.update(overrides)
            transforms[path] = _adamw(settings)[0]
        paths = [path for path, _ in groups]
        tx = optax.multi_transform(transforms, lambda params: group_labels(params, paths))
    clip = optax.clip_by_global_norm(optim.grad_clip) if optim.grad_clip > 0 else optax.identity()
    return expert_bias_balancing(optax.chain(clip, tx), optim.get("expert_bias_rate", 0.0)), schedule
