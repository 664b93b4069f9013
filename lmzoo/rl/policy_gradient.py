"""Pure, jittable pieces of RLHF policy optimisation: PPO (Ziegler et al. 2019; Ouyang et al. 2022), REINFORCE and
GRPO (Shao et al. 2024), with GRPO's successors as keywords of `grpo_loss` and `group_advantages`: Dr. GRPO (Liu et
al. 2025), DAPO (Yu et al. 2025), GSPO (Zheng et al. 2025) and truncated importance sampling for off-policy rollouts.

Conventions. A rollout is B prompts, left-padded to a common length L_q, each followed by a
response of T (static) sampled tokens. Every per-token array is [B, T] over response tokens;
`mask` [B, T] is 1 on valid response tokens, the EOS included (it is an action), and 0 after it.
Logits and values from one forward over prompt ⊕ response ([B, L_q + T, ...]) are aligned to the
response tokens with `align_to_responses`. Variances divide by N (TF `moments`, as the original).

Metrics are (sum, count) pairs like `lmzoo.objectives.causal_lm`, so `lmzoo.metrics`
averages them exactly over minibatches.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

Metrics = dict[str, tuple[jax.Array, jax.Array]]
KL_ESTIMATORS = ("k1", "k2", "k3")
EOS_PENALTIES = ("subtract", "replace")
BASELINES = ("mean", "leave_one_out")
GRPO_KL_ESTIMATORS = ("off", *KL_ESTIMATORS)  # "off": no KL term (DAPO, GSPO), no reference model needed
AGGREGATIONS = ("token", "sequence", "constant")
RATIO_LEVELS = ("token", "sequence")


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose one of {choices}")


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x over the positions where mask is 1 (0 when the mask is empty); any equal shapes."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def masked_var(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Variance (÷N) of x over the positions where mask is 1."""
    return masked_mean(jnp.square(x - masked_mean(x, mask)), mask)


def whiten(x: jax.Array, mask: jax.Array, *, shift_mean: bool = True, eps: float = 1e-8) -> jax.Array:
    """x [B, T] scaled to unit variance over the masked tokens (and mean 0 if shift_mean); 0 where mask is 0.

    shift_mean=False keeps the mean (reward whitening); advantages use shift_mean=True."""
    mean = masked_mean(x, mask)
    scaled = (x - mean) * jax.lax.rsqrt(masked_var(x, mask) + eps)
    return jnp.where(mask > 0, scaled if shift_mean else scaled + mean, 0.0)


def masked_stats(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(Σ mask·x, Σ mask): one token-mean metric as a (sum, count) pair."""
    return jnp.sum(x * mask), jnp.sum(mask).astype(jnp.float32)


def response_mask(responses: jax.Array, eos_id: int) -> tuple[jax.Array, jax.Array]:
    """responses [B, T] int -> (mask [B, T] float, 1 up to and including the first EOS; has_eos [B] bool).

    Without an EOS every token is valid (the response was truncated at T)."""
    is_eos = responses == eos_id
    before_eos = jnp.cumsum(is_eos, axis=1) - is_eos == 0
    return before_eos.astype(jnp.float32), jnp.any(is_eos, axis=1)


def align_to_responses(outputs: jax.Array, prompt_len: int) -> jax.Array:
    """Outputs of a forward over prompt ⊕ response [B, L_q + T, ...] -> [B, T, ...] at the positions predicting each response token."""
    return outputs[:, prompt_len - 1 : -1]


def response_logprobs(
    logits: jax.Array, responses: jax.Array, *, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """logits [B, T, V] aligned to responses [B, T] -> (log π(y_t) [B, T], entropy of π(·|s_t) [B, T]).

    The logits are divided by the sampling temperature, so the log-probabilities refer to the
    distribution the tokens were sampled from (policy, old policy and reference alike)."""
    logits = logits.astype(jnp.float32) / temperature
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(log_probs, responses[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return chosen, entropy


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "k1") -> jax.Array:
    """Per-token estimate of KL(π ‖ π_ref) from sampled-token log-probs [B, T] (Schulman's k1, k2, k3).

    k1 = log π − log π_ref (unbiased, signed); k2 = ½ (log π − log π_ref)²;
    k3 = π_ref/π − 1 − log(π_ref/π) (unbiased and ≥ 0)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * jnp.square(log_ratio)
    if estimator == "k3":
        return jnp.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


def penalize_missing_eos(scores: jax.Array, has_eos: jax.Array, *, penalty: float, mode: str = "subtract") -> jax.Array:
    """scores [B] of responses without an EOS lowered by `penalty` ("subtract", TRL) or set to −penalty ("replace", Ziegler)."""
    if mode == "subtract":
        penalized = scores - penalty
    elif mode == "replace":
        penalized = jnp.full_like(scores, -penalty)
    else:
        raise ValueError(f"unknown missing-EOS penalty mode {mode!r}; choose one of {EOS_PENALTIES}")
    return jnp.where(has_eos, scores, penalized)


def last_token_indicator(mask: jax.Array) -> jax.Array:
    """mask [B, T] (a prefix of ones) -> [B, T] float, 1 on the last valid token of each row."""
    next_mask = jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
    return mask * (1.0 - next_mask)


def shaped_rewards(
    scores: jax.Array,
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    mask: jax.Array,
    *,
    kl_coef: float | jax.Array,
    estimator: str = "k1",
) -> tuple[jax.Array, jax.Array]:
    """Per-token rewards r_t = −β·kl_t + [t = last]·score.

    scores [B] (already normalised and penalised), logprobs/ref_logprobs/mask [B, T] ->
    (rewards [B, T], kl [B, T]); both 0 where mask is 0. The score lands on the last valid token
    (the EOS), never on the padding after it."""
    kl = kl_estimate(logprobs, ref_logprobs, estimator) * mask
    rewards = -kl_coef * kl + last_token_indicator(mask) * scores[:, None]
    return rewards, kl


def gae(
    rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over response tokens (Schulman et al. 2016).

    rewards, values, mask [B, T] -> (advantages [B, T], returns = advantages + values [B, T]),
    0 where mask is 0. Values after the last valid token count as 0, so the episode ends there:
    A_last = r_last − V_last. Both outputs are constants for the losses (stop_gradient).
    """
    rewards, values = rewards * mask, values * mask
    next_values = jnp.pad(values[:, 1:], ((0, 0), (0, 1)))
    deltas = rewards + gamma * next_values - values

    def backward(next_advantage, delta_t):
        advantage = delta_t + gamma * lam * next_advantage
        return advantage, advantage

    _, advantages_tb = jax.lax.scan(backward, jnp.zeros(rewards.shape[0], deltas.dtype), deltas.T, reverse=True)
    advantages = advantages_tb.T * mask  # [T, B] -> [B, T]
    return jax.lax.stop_gradient(advantages), jax.lax.stop_gradient(advantages + values)


def policy_loss(
    logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array, *, clip_eps: float = 0.2
) -> tuple[jax.Array, Metrics]:
    """Clipped surrogate: masked mean of max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)), ρ = π/π_old; all inputs [B, T].

    Metrics: clip fraction (tokens where the clipped term is the larger), approx KL ½(log ρ)²
    and policy KL −log ρ between iterations, and the mean ratio."""
    log_ratio = logprobs - old_logprobs
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = masked_mean(jnp.maximum(unclipped, clipped), mask)
    metrics = {
        "policy/clipfrac": masked_stats((clipped > unclipped).astype(jnp.float32), mask),
        "policy/approxkl": masked_stats(0.5 * jnp.square(log_ratio), mask),
        "policy/policykl": masked_stats(-log_ratio, mask),
        "policy/ratio": masked_stats(ratio, mask),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def value_loss(
    values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array, *, clip_eps: float = 0.2
) -> tuple[jax.Array, Metrics]:
    """½ masked mean of max((V − R)², (V_clip − R)²), V_clip = V_old + clip(V − V_old, ±ε); inputs [B, T]."""
    clipped_values = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
    unclipped_error = jnp.square(values - returns)
    clipped_error = jnp.square(clipped_values - returns)
    loss = 0.5 * masked_mean(jnp.maximum(unclipped_error, clipped_error), mask)
    metrics = {"value/clipfrac": masked_stats((clipped_error > unclipped_error).astype(jnp.float32), mask)}
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
    """1 − Var(R − V) / Var(R) over the masked tokens (cleanrl); 1 is perfect, ≤ 0 no better than a constant."""
    return 1.0 - masked_var(returns - values, mask) / jnp.maximum(masked_var(returns, mask), 1e-8)


def ppo_loss(
    logprobs: jax.Array,
    entropy: jax.Array,
    values: jax.Array,
    rollout: dict[str, jax.Array],
    *,
    clip_eps: float = 0.2,
    value_clip_eps: float = 0.2,
    value_coef: float = 0.1,
    entropy_coef: float = 0.0,
) -> tuple[jax.Array, Metrics]:
    """L = L_policy + c_v·L_value − c_H·entropy for one minibatch.

    logprobs, entropy, values [B, T] from the current parameters; rollout holds the fixed
    "old_logprobs", "old_values", "advantages", "returns", "mask" [B, T]. Metrics are
    token means as (sum, count) pairs; explained variance is per minibatch as (value, 1).
    """
    mask = rollout["mask"]
    pg_loss, pg_metrics = policy_loss(logprobs, rollout["old_logprobs"], rollout["advantages"], mask, clip_eps=clip_eps)
    vf_loss, vf_metrics = value_loss(values, rollout["old_values"], rollout["returns"], mask, clip_eps=value_clip_eps)
    mean_entropy = masked_mean(entropy, mask)
    loss = pg_loss + value_coef * vf_loss - entropy_coef * mean_entropy
    one = jnp.ones((), jnp.float32)
    metrics = {
        **pg_metrics,
        **vf_metrics,
        "loss/policy": (pg_loss, one),
        "loss/value": (vf_loss, one),
        "loss/total": (loss, one),
        "policy/entropy": masked_stats(entropy, mask),
        "value/explained_variance": (explained_variance(values, rollout["returns"], mask), one),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def ppo_rollout_targets(
    scores: jax.Array,
    has_eos: jax.Array,
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    *,
    kl_coef: float | jax.Array,
    gamma: float = 1.0,
    lam: float = 0.95,
    kl_estimator: str = "k1",
    missing_eos_penalty: float | None = None,
    missing_eos_mode: str = "subtract",
    whiten_rewards: bool = False,
) -> tuple[dict[str, jax.Array], Metrics]:
    """Everything PPO needs from one scored rollout, computed once before the epochs.

    scores [B] (normalised RM scores), has_eos [B], logprobs/ref_logprobs/values/mask [B, T] ->
    (rollout dict with "old_logprobs", "old_values", "advantages" (whitened), "returns",
    "rewards", "mask" [B, T]; metrics). Returns are taken before the advantages are whitened.
    """
    if missing_eos_penalty is not None:
        scores = penalize_missing_eos(scores, has_eos, penalty=missing_eos_penalty, mode=missing_eos_mode)
    rewards, kl = shaped_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=kl_coef, estimator=kl_estimator)
    if whiten_rewards:
        rewards = whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, values * mask, mask, gamma=gamma, lam=lam)
    rollout = {
        "old_logprobs": logprobs,
        "old_values": values * mask,
        "advantages": whiten(advantages, mask),
        "returns": returns,
        "rewards": rewards,
        "mask": mask,
    }
    batch = jnp.asarray(scores.shape[0], jnp.float32)
    sequence_kl = jnp.sum(kl, axis=1)
    metrics = {
        **score_metrics(scores, has_eos, mask),
        "objective/kl": (jnp.sum(sequence_kl), batch),
        "objective/non_score_reward": (jnp.sum(-kl_coef * sequence_kl), batch),
        "objective/rlhf_reward": (jnp.sum(sequence_returns(scores, kl, mask, kl_coef=kl_coef)), batch),
        "objective/kl_coef": (jnp.asarray(kl_coef, jnp.float32) * batch, batch),
    }
    return rollout, metrics


def score_metrics(scores: jax.Array, has_eos: jax.Array, mask: jax.Array) -> Metrics:
    """The rollout's scores [B], how many responses ended [B] and their lengths (mask [B, T]) as (sum, B) metrics."""
    batch = jnp.asarray(scores.shape[0], jnp.float32)
    return {
        "objective/scores": (jnp.sum(scores), batch),
        "tokens/response_len": (jnp.sum(mask), batch),
        "tokens/has_eos": (jnp.sum(has_eos.astype(jnp.float32)), batch),
    }


class KLController(NamedTuple):
    """β of the KL penalty; adaptive towards `target` nats per response over `horizon` episodes, fixed when target is None."""

    kl_coef: float | jax.Array
    target: float | None = None
    horizon: float = 10000.0


def update_kl_controller(state: KLController, observed_kl: float | jax.Array, n_steps: int | jax.Array) -> KLController:
    """Ziegler et al.'s proportional controller, once per rollout batch.

    observed_kl: mean over the batch of the per-response KL (Σ_t kl_t); n_steps: episodes in the
    batch summed over all workers. β ← β·(1 + clip(KL/target − 1, ±0.2)·n_steps/horizon).
    """
    if state.target is None:
        return state
    error = jnp.clip(observed_kl / state.target - 1.0, -0.2, 0.2)
    return state._replace(kl_coef=state.kl_coef * (1.0 + error * n_steps / state.horizon))


def sequence_returns(scores: jax.Array, kl: jax.Array, mask: jax.Array, *, kl_coef: float | jax.Array) -> jax.Array:
    """Whole-response return R = score − β·Σ_t kl_t: scores [B], kl/mask [B, T] -> [B]."""
    return scores - kl_coef * jnp.sum(kl * mask, axis=1)


def reinforce_advantages(returns: jax.Array, *, baseline: str = "leave_one_out") -> jax.Array:
    """returns [P, K] of K responses per prompt -> advantages [P, K] against a per-prompt baseline.

    "mean": R_i − mean_j R_j; "leave_one_out" (RLOO, Ahmadian et al. 2024): R_i − mean_{j≠i} R_j,
    an unbiased baseline because it does not depend on response i.
    """
    k = returns.shape[1]
    if baseline == "mean":
        return returns - jnp.mean(returns, axis=1, keepdims=True)
    if baseline == "leave_one_out":
        if k < 2:
            raise ValueError("the leave-one-out baseline needs at least 2 responses per prompt")
        return returns - (jnp.sum(returns, axis=1, keepdims=True) - returns) / (k - 1)
    raise ValueError(f"unknown baseline {baseline!r}; choose one of {BASELINES}")


def group_advantages(returns: jax.Array, *, eps: float = 1e-4, scale_by_std: bool = True) -> jax.Array:
    """returns [P, G] of G responses per prompt -> GRPO advantages (R_i − mean_g R) / (std_g R + eps) [P, G]
    (Shao et al. 2024), with trl's unbiased std and eps; a group of equal returns gets 0.

    scale_by_std=False is Dr. GRPO's R_i − mean_g R (Liu et al. 2025, "Understanding R1-Zero-Like Training"):
    dividing by the std weights groups whose rewards barely differ (too easy or too hard prompts) the most."""
    centred = returns - jnp.mean(returns, axis=1, keepdims=True)
    if not scale_by_std:
        return centred
    return centred / (jnp.std(returns, axis=1, keepdims=True, ddof=1) + eps)


def informative_groups(returns: jax.Array) -> jax.Array:
    """returns [P, G] -> bool [P], True where a group's returns are not all equal (DAPO's dynamic sampling, Yu et al.
    2025): a group of equal returns has zero advantages and so no policy gradient; the caller drops it and refills
    the batch with fresh groups."""
    return jnp.any(returns != returns[:, :1], axis=1)


def overlong_penalty(lengths: jax.Array, *, max_len: int, cache_len: int) -> jax.Array:
    """DAPO's soft overlong punishment (Yu et al. 2025), added to the task reward: lengths [B] -> penalties [B] float.

    With L_soft = max_len − cache_len: 0 if L ≤ L_soft; (L_soft − L) / cache_len, falling linearly from 0 to −1,
    if L_soft < L ≤ max_len; −1 if L > max_len."""
    if not 0 <= cache_len <= max_len:
        raise ValueError(
            f"overlong_penalty needs 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    lengths = jnp.asarray(lengths, jnp.float32)
    soft_len = max_len - cache_len
    ramp = (soft_len - lengths) / max(cache_len, 1)
    return jnp.where(lengths <= soft_len, 0.0, jnp.where(lengths <= max_len, ramp, -1.0))


def truncated_is_weights(
    old_logprobs: jax.Array, behaviour_logprobs: jax.Array, mask: jax.Array, *, cap: float
) -> jax.Array:
    """Truncated importance weights min(π_old / π_behaviour, cap) [B, T], 0 where mask is 0, held constant.

    old_logprobs, behaviour_logprobs, mask [B, T]. For rollouts sampled by another policy than the one the clipped
    ratio is taken against: an older version in asynchronous RL, or the same parameters in an inference engine whose
    numerics differ ("Your efficient RL framework secretly brings you off-policy RL training", Yao et al. 2025;
    truncated IS after Espeholt et al. 2018's IMPALA). The cap bounds the variance at the price of a small bias."""
    weights = jnp.minimum(jnp.exp(old_logprobs - behaviour_logprobs), cap)
    return jax.lax.stop_gradient(weights * mask)


def aggregate_tokens(x: jax.Array, mask: jax.Array, *, aggregation: str = "token") -> jax.Array:
    """Per-token losses x [B, T] -> a scalar, over the tokens where mask [B, T] is 1.

    "token": Σ mask·x / Σ mask, every token of the minibatch weighs the same (DAPO's token-level loss, Yu et al.
    2025); "sequence": each response's token mean, then the mean over the B responses (GRPO, Shao et al. 2024), so a
    token of a long response weighs less; "constant": Σ mask·x / (B·T), T the response length (Dr. GRPO, Liu et al.
    2025): a normaliser that depends on no response's length, so no length bias."""
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    if aggregation == "token":
        return masked_mean(x, mask)
    if aggregation == "sequence":
        return jnp.mean(jnp.sum(x * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0))
    return jnp.sum(x * mask) / (mask.shape[0] * mask.shape[1])


def sequence_log_ratio(logprobs: jax.Array, old_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO's length-normalised log-ratio log s_i = (1/|y_i|) Σ_t (log π(y_t) − log π_old(y_t)): [B, T] inputs -> [B]."""
    return jnp.sum((logprobs - old_logprobs) * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)


def gspo_token_ratio(logprobs: jax.Array, old_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO-token's ratio s_{i,t} = sg[s_i]·π(y_t)/sg[π(y_t)] [B, T] (Zheng et al. 2025, "Group Sequence Policy
    Optimization"); logprobs, old_logprobs, mask [B, T].

    Its value is the sequence ratio s_i = exp(log s_i) on every token of response i (clipping it clips the whole
    response); its gradient is s_i·∇log π(y_t), per token. Averaged over a response's tokens with a per-token
    advantage A_i it gives GSPO's gradient s_i·A_i·(1/|y_i|) Σ_t ∇log π(y_t)."""
    log_ratio = jax.lax.stop_gradient(sequence_log_ratio(logprobs, old_logprobs, mask))[:, None]
    return jnp.exp(log_ratio + (logprobs - jax.lax.stop_gradient(logprobs)))  # value exactly s_i


def grpo_loss(
    logprobs: jax.Array,
    ref_logprobs: jax.Array | None,
    rollout: dict[str, jax.Array],
    *,
    clip_eps: float = 0.2,
    kl_coef: float = 0.04,
    clip_eps_high: float | None = None,
    aggregation: str = "token",
    ratio_level: str = "token",
    kl_estimator: str = "k3",
    tis_cap: float | None = None,
) -> tuple[jax.Array, Metrics]:
    """L = L_policy + β·KL for one minibatch, no value function: the clipped surrogate with each response's group
    advantage on all its tokens, and an estimate of KL(π ‖ π_ref) as a loss term (not in the reward).

    logprobs, ref_logprobs [B, T]; rollout holds "old_logprobs", "mask" [B, T] and "sequence_advantages" [B], and for
    truncated importance sampling "behaviour_logprobs" [B, T]. The default keywords are GRPO as before (Shao et al.
    2024, with the token-level loss); each keyword switches one piece to a successor's:

    clip_eps, clip_eps_high: the ratio is clipped to [1 − clip_eps, 1 + clip_eps_high]; clip_eps_high=None uses
        clip_eps on both sides. A larger ε_high is DAPO's clip-higher (Yu et al. 2025: ε_low 0.2, ε_high 0.28), which
        lets unlikely tokens with a positive advantage grow and so keeps the entropy from collapsing.
    aggregation: how per-token terms (surrogate and KL alike) become a scalar, `aggregate_tokens`: "token" (DAPO),
        "sequence" (GRPO's paper) or "constant" (Dr. GRPO, Liu et al. 2025).
    ratio_level: "token", ρ_t = π(y_t)/π_old(y_t); "sequence", GSPO's s_i (Zheng et al. 2025) in its GSPO-token form
        `gspo_token_ratio`, clipped per response. GSPO's loss −mean_i min(s_i·A_i, clip(s_i)·A_i) is
        ratio_level="sequence" with aggregation="sequence" (value and gradient); "token" aggregation weighs each
        response's term by its length instead.
    kl_estimator: "k3" (GRPO), "k1", "k2" (`kl_estimate`) or "off": no KL term, β and ref_logprobs unused (None
        allowed); DAPO and GSPO train without one.
    tis_cap: when given, each token's surrogate is multiplied by `truncated_is_weights`(old_logprobs,
        rollout["behaviour_logprobs"], cap=tis_cap), for rollouts sampled by another policy than π_old; None: weight
        1 (any "behaviour_logprobs" unused). The KL term is not reweighted.

    Metrics: "loss/policy", "loss/kl" (0 when off), "loss/total" as (value, 1); token means as (sum, count) pairs:
    "policy/clipfrac" (tokens where the clipped term is the larger), split into "policy/clipfrac_low" (ratio below
    1 − ε_low, A < 0) and "policy/clipfrac_high" (above 1 + ε_high, A > 0), "policy/approxkl" ½(log ρ_t)² and
    "policy/policykl" −log ρ_t of the token ratio ρ_t whatever the ratio level, "policy/ratio" (the ratio clipped:
    s_i on each token at the sequence level); with tis_cap, "policy/tis_weight" and "policy/tis_capped" (the
    fraction of tokens at the cap)."""
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_choice("ratio level", ratio_level, RATIO_LEVELS)
    _check_choice("KL estimator", kl_estimator, GRPO_KL_ESTIMATORS)
    if kl_estimator != "off" and ref_logprobs is None:
        raise ValueError(f"kl_estimator={kl_estimator!r} needs ref_logprobs; pass kl_estimator='off' to train without")
    if tis_cap is not None and "behaviour_logprobs" not in rollout:
        raise ValueError(f"tis_cap={tis_cap} needs rollout['behaviour_logprobs'], the sampler's log-probs [B, T]")
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    mask, old_logprobs = rollout["mask"], rollout["old_logprobs"]
    advantages = jax.lax.stop_gradient(rollout["sequence_advantages"])[:, None] * mask
    log_ratio = logprobs - old_logprobs
    if ratio_level == "token":
        ratio = jnp.exp(log_ratio)
    else:
        ratio = gspo_token_ratio(logprobs, old_logprobs, mask)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    surrogate = jnp.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    metrics = {
        "policy/clipfrac": masked_stats(is_clipped.astype(jnp.float32), mask),
        "policy/clipfrac_low": masked_stats((is_clipped & (ratio < 1.0 - eps_low)).astype(jnp.float32), mask),
        "policy/clipfrac_high": masked_stats((is_clipped & (ratio > 1.0 + eps_high)).astype(jnp.float32), mask),
        "policy/approxkl": masked_stats(0.5 * jnp.square(log_ratio), mask),
        "policy/policykl": masked_stats(-log_ratio, mask),
        "policy/ratio": masked_stats(ratio, mask),
    }
    if tis_cap is not None:
        weights = truncated_is_weights(old_logprobs, rollout["behaviour_logprobs"], mask, cap=tis_cap)
        surrogate = surrogate * weights
        metrics["policy/tis_weight"] = masked_stats(weights, mask)
        metrics["policy/tis_capped"] = masked_stats((weights >= tis_cap).astype(jnp.float32), mask)
    pg_loss = aggregate_tokens(surrogate, mask, aggregation=aggregation)
    if kl_estimator == "off":
        kl_loss = jnp.zeros((), jnp.float32)
        loss = pg_loss
    else:
        kl_loss = aggregate_tokens(kl_estimate(logprobs, ref_logprobs, kl_estimator), mask, aggregation=aggregation)
        loss = pg_loss + kl_coef * kl_loss
    one = jnp.ones((), jnp.float32)
    losses = {"loss/policy": (pg_loss, one), "loss/kl": (kl_loss, one), "loss/total": (loss, one)}
    return loss, jax.tree.map(jax.lax.stop_gradient, {**metrics, **losses})


def reinforce_loss(logprobs: jax.Array, advantages: jax.Array, mask: jax.Array) -> tuple[jax.Array, Metrics]:
    """−mean_b A_b·Σ_t mask·log π(y_t): logprobs/mask [B, T], advantages [B] (one per response, held constant)."""
    sequence_logprob = jnp.sum(logprobs * mask, axis=1)
    advantages = jax.lax.stop_gradient(advantages)
    loss = -jnp.mean(advantages * sequence_logprob)
    batch = jnp.asarray(advantages.shape[0], jnp.float32)
    return loss, {"loss/policy": (jax.lax.stop_gradient(loss) * batch, batch)}
