"""Preference optimisation without a reward model: the DPO (sigmoid) and IPO losses on the log-probabilities a policy
and its frozen reference give the chosen and rejected replies of each comparison (Rafailov et al. 2023; Azar et
al. 2023), beside PPO's and GRPO's maths in `policy_gradient`. The recipe around them is `lmzoo.objectives.dpo`."""

import jax
import jax.numpy as jnp

from lmzoo.rl import policy_gradient, reward
from lmzoo.rl.policy_gradient import Metrics

LOSS_TYPES = ("sigmoid", "ipo")


def reply_logprobs(model, params, tokens: jax.Array, prompt_lengths: jax.Array, *, pad_id: int):
    """tokens [B, K, L] (prompt ⊕ reply ⊕ EOS, right-padded with pad_id), prompt_lengths [B] ->
    (log π(reply ⊕ EOS | prompt) summed over its tokens [B, K], the number of those tokens [B, K])."""
    flat = tokens.reshape(-1, tokens.shape[-1])
    segment_ids, positions = reward.padding_inputs(flat, pad_id)
    logits = model.apply({"params": params}, flat, segment_ids=segment_ids, positions=positions)
    token_logprobs, _ = policy_gradient.response_logprobs(logits[:, :-1], flat[:, 1:])  # [B·K, L − 1]
    starts = jnp.repeat(prompt_lengths, tokens.shape[1])[:, None]
    mask = (jnp.arange(1, flat.shape[1])[None] >= starts) & (segment_ids[:, 1:] > 0)  # target t + 1 is a reply token
    mask = mask.astype(jnp.float32)
    summed, counts = jnp.sum(token_logprobs * mask, axis=1), jnp.sum(mask, axis=1)
    return summed.reshape(tokens.shape[:2]), counts.reshape(tokens.shape[:2])


def dpo_loss(
    policy: jax.Array,
    reference: jax.Array,
    weights: jax.Array,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[jax.Array, Metrics]:
    """policy, reference [B, 2]: log-probs of the (chosen, rejected) replies; weights [B] (0 = padding row) ->
    (mean loss over the weighted comparisons, metrics as (sum, count) pairs: "loss", the implicit rewards'
    "rewards/accuracy" (ties count as wrong), "rewards/margin", "rewards/chosen", "rewards/rejected")."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose one of {LOSS_TYPES}")
    rewards = beta * (policy - reference)  # [B, 2]
    h = (policy[:, 0] - policy[:, 1]) - (reference[:, 0] - reference[:, 1])
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * h) - label_smoothing * jax.nn.log_sigmoid(-beta * h)
    else:
        losses = jnp.square(h - 1 / (2 * beta))
    weights = weights.astype(jnp.float32)
    count = jnp.sum(weights)
    total = jnp.sum(losses * weights)
    margin = rewards[:, 0] - rewards[:, 1]
    metrics = {
        "loss": (total, count),
        "rewards/accuracy": (jnp.sum((margin > 0) * weights), count),
        "rewards/margin": (jnp.sum(margin * weights), count),
        "rewards/chosen": (jnp.sum(rewards[:, 0] * weights), count),
        "rewards/rejected": (jnp.sum(rewards[:, 1] * weights), count),
    }
    return total / jnp.maximum(count, 1.0), jax.tree.map(jax.lax.stop_gradient, metrics)
