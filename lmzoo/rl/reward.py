"""Reward model: a decoder with a scalar head on the last non-pad token, the K-wise ranking loss, normalisation.

InstructGPT (Ouyang et al. 2022, §3.5): each prompt comes with K ranked responses; all
K-choose-2 pairs of one prompt form one batch element and share the K forward passes, and the
loss is −log σ(r_w − r_l) averaged over the pairs (ties dropped). Since that loss ignores a
shift of every score, scores are normalised afterwards so samples of the SFT policy score
mean 0 (std 1), which gives the KL coefficient β of PPO a stable meaning.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo.models import heads

Metrics = dict[str, tuple[jax.Array, jax.Array]]


def reward_model(backbone: nn.Module, emb_dim: int) -> heads.SequenceClassifier:
    """A scalar head on the backbone's hidden state at the last non-pad token.

    The head kernel is N(0, 1/sqrt(emb_dim + 1)) and the bias 0 (Ziegler et al.'s reward head);
    no dropout, so rollouts, training and evaluation score the same way.
    """
    return heads.SequenceClassifier(
        backbone,
        1,
        head="linear",
        pooling="last",
        dropout_rate=0.0,
        classifier_init=nn.initializers.normal((emb_dim + 1) ** -0.5),
    )


def value_model(backbone: nn.Module) -> heads.TokenClassifier:
    """tokens [B, T] -> values [B, T, 1]: a separate value network (InstructGPT, TRL's PPO).

    Its parameters have the reward model's names and shapes, so it starts as a copy of the RM:
    the value at the last non-pad token is then the RM score.
    """
    return heads.TokenClassifier(backbone, 1, dropout_rate=0.0)


def padding_inputs(tokens: jax.Array, pad_id: int) -> tuple[jax.Array, jax.Array]:
    """tokens [B, L] padded on either side -> (segment_ids [B, L], 1 on real tokens; positions [B, L]).

    Positions count real tokens only, so a left-padded sequence is seen like the unpadded one."""
    valid = tokens != pad_id
    return valid.astype(jnp.int32), jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)


def score(model: heads.SequenceClassifier, params, tokens: jax.Array, *, pad_id: int) -> jax.Array:
    """tokens [..., L] (prompt ⊕ response, padded on either side with pad_id) -> rewards [...]."""
    flat = tokens.reshape(-1, tokens.shape[-1])
    segment_ids, positions = padding_inputs(flat, pad_id)
    logits = model.apply({"params": params}, flat, segment_ids=segment_ids, positions=positions)
    return logits[:, 0].reshape(tokens.shape[:-1])


def preference_pairs(ranks: jax.Array, valid: jax.Array) -> jax.Array:
    """ranks, valid [B, K] -> [B, K, K] float, 1 where response i is ranked strictly above j (smaller rank wins)."""
    both_valid = valid[:, :, None] & valid[:, None, :]
    return (both_valid & (ranks[:, :, None] < ranks[:, None, :])).astype(jnp.float32)


def ranking_loss(rewards: jax.Array, ranks: jax.Array, valid: jax.Array) -> tuple[jax.Array, Metrics]:
    """K-wise loss: per prompt the mean over its pairs (w above l) of −log σ(r_w − r_l), then the mean over prompts.

    rewards [B, K]; ranks [B, K] int (smaller = better; equal ranks are ties and form no pair);
    valid [B, K] bool (padding of K). Prompts without a pair do not count. Metrics (sum, count):
    "loss" per prompt; "accuracy" (exact ties count as wrong) and "margin" r_w − r_l per pair.
    """
    pairs = preference_pairs(ranks, valid)
    margins = rewards[:, :, None] - rewards[:, None, :]  # [B, K, K]: r_i − r_j
    pair_count = jnp.sum(pairs, axis=(1, 2))
    prompt_loss = -jnp.sum(pairs * jax.nn.log_sigmoid(margins), axis=(1, 2)) / jnp.maximum(pair_count, 1.0)
    has_pairs = (pair_count > 0).astype(jnp.float32)
    prompts = jnp.sum(has_pairs)
    loss = jnp.sum(prompt_loss * has_pairs) / jnp.maximum(prompts, 1.0)
    total_pairs = jnp.sum(pair_count)
    metrics = {
        "loss": (jnp.sum(prompt_loss * has_pairs), prompts),
        "accuracy": (jnp.sum(pairs * (margins > 0)), total_pairs),
        "margin": (jnp.sum(pairs * margins), total_pairs),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def fit_normalization(
    reference_scores: jax.Array, *, target_mean: float = 0.0, target_std: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """(gain, bias) such that gain·s + bias has the target mean and std over reference_scores [N].

    reference_scores are raw scores of responses sampled from the SFT (reference) policy.
    """
    gain = target_std / jnp.maximum(jnp.std(reference_scores), 1e-8)
    return gain, target_mean - gain * jnp.mean(reference_scores)


def normalize(scores: jax.Array, gain: jax.Array, bias: jax.Array) -> jax.Array:
    """Raw scores [...] -> gain·scores + bias."""
    return gain * scores + bias
