"""The PPO pieces composed into a full update reach the closed-form optimum of a one-token bandit.

With response length 1 the KL-regularised objective E[r(y)] − β·KL(π ‖ π_ref) is maximised by
π*(y) ∝ π_ref(y)·exp(r(y)/β). The policy is free logits, the value a scalar; everything else is
the production path: sampling, tempered log-probs, shaped reward, GAE, advantage whitening,
clipped policy and value losses, 4 epochs per rollout. The gap to the optimal objective
is exactly β·KL(π ‖ π*).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lmzoo.rl import policy_gradient

V, B, EPOCHS, ITERATIONS = 8, 256, 4, 100
REF_LOGITS = jnp.asarray(np.random.default_rng(0).normal(size=V), jnp.float32)
REWARDS = jnp.linspace(-1.0, 1.0, V)


def _objective(log_policy: jax.Array, kl_coef: float) -> float:
    kl = jnp.sum(jnp.exp(log_policy) * (log_policy - jax.nn.log_softmax(REF_LOGITS)))
    return float(jnp.sum(jnp.exp(log_policy) * REWARDS) - kl_coef * kl)


def _train(kl_coef: float) -> jax.Array:
    optimizer = optax.adam(optax.linear_schedule(0.05, 0.0, EPOCHS * ITERATIONS))  # linear decay to 0, as in RLHF PPO

    def forward(params, tokens):
        logits = jnp.broadcast_to(params["logits"], (B, 1, V))
        logprobs, entropy = policy_gradient.response_logprobs(logits, tokens)
        return logprobs, entropy, jnp.full((B, 1), params["value"])

    @jax.jit
    def iteration(params, opt_state, key):
        tokens = jax.random.categorical(key, jnp.broadcast_to(params["logits"], (B, 1, V)))  # [B, 1]
        logprobs, _, values = forward(params, tokens)
        ref_logprobs, _ = policy_gradient.response_logprobs(jnp.broadcast_to(REF_LOGITS, (B, 1, V)), tokens)
        rollout, _ = policy_gradient.ppo_rollout_targets(
            REWARDS[tokens[:, 0]], jnp.ones(B, bool), logprobs, ref_logprobs, values, jnp.ones((B, 1)), kl_coef=kl_coef
        )
        for _ in range(EPOCHS):
            grads = jax.grad(lambda p: policy_gradient.ppo_loss(*forward(p, tokens), rollout)[0])(params)
            updates, opt_state = optimizer.update(grads, opt_state)
            params = optax.apply_updates(params, updates)
        return params, opt_state

    params = {"logits": REF_LOGITS, "value": jnp.zeros(())}
    opt_state = optimizer.init(params)
    for key in jax.random.split(jax.random.key(0), ITERATIONS):
        params, opt_state = iteration(params, opt_state, key)
    return jax.nn.log_softmax(params["logits"])


@pytest.mark.parametrize("kl_coef", [0.5, 2.0])
def test_ppo_reaches_the_kl_regularised_optimum(kl_coef):
    optimum = jax.nn.log_softmax(REF_LOGITS + REWARDS / kl_coef)
    start = jax.nn.log_softmax(REF_LOGITS)
    learned = _train(kl_coef)
    assert float(jnp.sum(jnp.exp(learned) * (learned - optimum))) < 1e-4
    assert _objective(start, kl_coef) < _objective(optimum, kl_coef) - 0.05
    assert _objective(learned, kl_coef) > _objective(optimum, kl_coef) - 1e-3 * abs(_objective(optimum, kl_coef))
