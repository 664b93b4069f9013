"""Preference optimisation without a reward model: the DPO (sigmoid) and IPO losses on the log-probabilities a policy
and its frozen reference give the chosen and rejected replies of each comparison (Rafailov et al. 2023; Azar et
al. 2023), beside PPO's and GRPO's maths in `policy_gradient`. The recipe around them is `lmzoo.objectives.dpo`."""

import jax
import jax.numpy as jnp

from lmzoo.rl import policy_gradient, reward
from lmzoo.rl.policy_gradient import Metrics
from lmzoo.serving import slots

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


def shared_reply_logprobs(
    model, params, tokens: jax.Array, prompt_lengths: jax.Array, *, prompt_budget: int, pad_id: int
):
    """`reply_logprobs` with each comparison's prompt run once for its K replies (`slots.shared_prompt_logits`):
    tokens [B, K, L] as there, cut with a prompt budget P (`comparisons.reward_model_arrays`: prompts of at most P
    tokens, replies ⊕ EOS of at most L - P), prompt_lengths [B] -> (summed log-probs [B, K], token counts [B, K]).
    The model reads B·P + B·K·(L - P) tokens rather than B·K·L."""
    batch, replies_per_prompt, length = tokens.shape
    reply_len = length - prompt_budget
    columns = prompt_lengths[:, None] - prompt_budget + jnp.arange(prompt_budget)  # [B, P]: the prompt, right-aligned
    prompt_mask = columns >= 0
    prompts = jnp.where(prompt_mask, jnp.take_along_axis(tokens[:, 0], jnp.maximum(columns, 0), axis=1), pad_id)
    columns = jnp.broadcast_to(
        (prompt_lengths[:, None] + jnp.arange(reply_len))[:, None], (batch, replies_per_prompt, reply_len)
    )
    replies = jnp.take_along_axis(tokens, columns, axis=2).reshape(batch * replies_per_prompt, reply_len)
    reply_mask = replies != pad_id
    logits = slots.shared_prompt_logits(model, params, prompts, prompt_mask, replies, reply_mask)
    token_logprobs, _ = policy_gradient.response_logprobs(logits, replies)  # [B·K, T]
    # A reply's first token is read after the prompt's last: with no prompt, there is none to predict it from.
    first_read = jnp.repeat(prompt_lengths > 0, replies_per_prompt)[:, None] | (jnp.arange(reply_len) > 0)
    mask = (reply_mask & first_read).astype(jnp.float32)
    summed, counts = jnp.sum(token_logprobs * mask, axis=1), jnp.sum(mask, axis=1)
    return summed.reshape(batch, replies_per_prompt), counts.reshape(batch, replies_per_prompt)


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
