"""PPO / REINFORCE maths on hand-computed examples, masks and gradients."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from lmzoo.rl import policy_gradient

B, T, V = 2, 8, 32


def _random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _prefix_mask(lengths):
    return (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def _gae_loop(rewards, values, gamma, lam):
    """Textbook backwards loop over one row (episode ends after the last entry)."""
    advantages, next_advantage, next_value = [], 0.0, 0.0
    for r, v in zip(rewards[::-1], values[::-1]):
        next_advantage = r + gamma * next_value - v + gamma * lam * next_advantage
        next_value = v
        advantages.append(next_advantage)
    return np.array(advantages[::-1])


class MaskTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_response_mask_keeps_the_first_eos_and_nothing_after(self):
        eos = 3
        responses = jnp.array([[5, 6, eos, 7, eos, 0, 0, 0], [5, 6, 7, 8, 9, 10, 11, 12]])
        mask, has_eos = self.variant(policy_gradient.response_mask, static_argnums=1)(responses, eos)
        np.testing.assert_array_equal(mask, [[1, 1, 1, 0, 0, 0, 0, 0], [1] * T])
        np.testing.assert_array_equal(has_eos, [True, False])

    @chex.variants(with_jit=True, without_jit=True)
    def test_whitening_ignores_masked_tokens(self):
        x, mask = _random((B, T), 0), jnp.asarray(_prefix_mask([5, 3]))
        whitened = self.variant(policy_gradient.whiten)(x, mask)
        valid = np.asarray(whitened)[np.asarray(mask) > 0]
        np.testing.assert_allclose(valid.mean(), 0.0, atol=1e-6)
        np.testing.assert_allclose(valid.std(), 1.0, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(whitened)[np.asarray(mask) == 0], 0.0)
        garbage = jnp.where(mask > 0, x, 1e6)
        chex.assert_trees_all_close(self.variant(policy_gradient.whiten)(garbage, mask), whitened, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_reward_whitening_keeps_the_mean(self):
        x, mask = _random((B, T), 1) + 3.0, jnp.asarray(_prefix_mask([8, 2]))
        whitened = self.variant(lambda a, m: policy_gradient.whiten(a, m, shift_mean=False))(x, mask)
        np.testing.assert_allclose(
            policy_gradient.masked_mean(whitened, mask), policy_gradient.masked_mean(x, mask), rtol=1e-5
        )
        np.testing.assert_allclose(policy_gradient.masked_var(whitened, mask), 1.0, rtol=1e-5)


class LogprobTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_logprobs_and_entropy_of_tempered_logits(self):
        logits, responses = _random((B, T, V), 2), jnp.asarray(np.random.default_rng(3).integers(0, V, (B, T)))
        logprobs, entropy = self.variant(lambda z, y: policy_gradient.response_logprobs(z, y, temperature=0.7))(
            logits, responses
        )
        chex.assert_shape((logprobs, entropy), (B, T))
        probs = np.asarray(jax.nn.softmax(logits / 0.7, axis=-1))
        expected = np.log(np.take_along_axis(probs, np.asarray(responses)[..., None], axis=-1)[..., 0])
        np.testing.assert_allclose(logprobs, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(entropy, -np.sum(probs * np.log(probs), axis=-1), rtol=1e-5)

    def test_align_to_responses_takes_the_positions_predicting_each_response_token(self):
        outputs = jnp.arange(2 * 7).reshape(2, 7)  # prompt length 3, response length 4
        np.testing.assert_array_equal(policy_gradient.align_to_responses(outputs, 3), outputs[:, 2:6])


class KLTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_estimators_on_hand_values(self):
        logprobs = jnp.log(jnp.array([[0.5, 0.2], [0.1, 0.4]]))
        ref = jnp.log(jnp.array([[0.25, 0.4], [0.1, 0.8]]))
        log_ratio = np.log([[2.0, 0.5], [1.0, 0.5]])
        estimate = self.variant(policy_gradient.kl_estimate, static_argnums=2)
        np.testing.assert_allclose(estimate(logprobs, ref, "k1"), log_ratio, rtol=1e-6)
        np.testing.assert_allclose(estimate(logprobs, ref, "k2"), 0.5 * log_ratio**2, rtol=1e-5)
        np.testing.assert_allclose(
            estimate(logprobs, ref, "k3"), [[0.5 - 1 + np.log(2), 2 - 1 - np.log(2)], [0, 2 - 1 - np.log(2)]], atol=1e-6
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_kl_term_is_zero_when_policy_equals_reference(self):
        logprobs, mask = -jnp.abs(_random((B, T), 4)), jnp.asarray(_prefix_mask([6, 2]))
        for estimator in policy_gradient.KL_ESTIMATORS:
            rewards, kl = self.variant(
                lambda s, a, b, m, e=estimator: policy_gradient.shaped_rewards(s, a, b, m, kl_coef=0.3, estimator=e)
            )(jnp.zeros(B), logprobs, logprobs, mask)
            np.testing.assert_array_equal(kl, 0.0)
            np.testing.assert_array_equal(rewards, 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_score_lands_on_the_last_valid_token_and_kl_only_on_valid_tokens(self):
        logprobs, ref = _random((B, T), 5), _random((B, T), 6)
        mask = jnp.asarray(_prefix_mask([3, 8]))
        rewards, kl = self.variant(lambda *a: policy_gradient.shaped_rewards(*a, kl_coef=0.1))(
            jnp.array([2.0, -1.0]), logprobs, ref, mask
        )
        expected_kl = np.asarray(logprobs - ref) * np.asarray(mask)
        np.testing.assert_allclose(kl, expected_kl, rtol=1e-6)
        expected = -0.1 * expected_kl
        expected[0, 2] += 2.0
        expected[1, 7] += -1.0
        np.testing.assert_allclose(rewards, expected, rtol=1e-5, atol=1e-6)

    def test_missing_eos_penalty(self):
        scores, has_eos = jnp.array([0.5, 0.5]), jnp.array([True, False])
        np.testing.assert_allclose(policy_gradient.penalize_missing_eos(scores, has_eos, penalty=1.0), [0.5, -0.5])
        np.testing.assert_allclose(
            policy_gradient.penalize_missing_eos(scores, has_eos, penalty=1.0, mode="replace"), [0.5, -1.0]
        )


class GAETest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_computed_example(self):
        # Row 0: r = [0, 0, 1], V = [.5, .2, .4], γ = .9, λ = .5:
        #   δ2 = 1 − .4 = .6               A2 = .6
        #   δ1 = .9·.4 − .2 = .16          A1 = .16 + .45·.6 = .43
        #   δ0 = .9·.2 − .5 = −.32         A0 = −.32 + .45·.43 = −.1265
        # Row 1: the same with the last token masked: A1 = 0 − .2 = −.2, A0 = −.32 + .45·(−.2) = −.41.
        rewards = jnp.array([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
        values = jnp.array([[0.5, 0.2, 0.4], [0.5, 0.2, 0.4]])
        mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
        advantages, returns = self.variant(lambda *a: policy_gradient.gae(*a, gamma=0.9, lam=0.5))(
            rewards, values, mask
        )
        np.testing.assert_allclose(advantages, [[-0.1265, 0.43, 0.6], [-0.41, -0.2, 0.0]], atol=1e-6)
        np.testing.assert_allclose(returns, [[0.3735, 0.63, 1.0], [0.09, 0.0, 0.0]], atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_a_python_loop_and_ignores_padding(self):
        rewards, values, lengths = _random((B, T), 7), _random((B, T), 8), [5, 8]
        mask = jnp.asarray(_prefix_mask(lengths))
        advantages, _ = self.variant(lambda *a: policy_gradient.gae(*a, gamma=1.0, lam=0.95))(rewards, values, mask)
        for row, n in enumerate(lengths):
            expected = _gae_loop(np.asarray(rewards[row, :n]), np.asarray(values[row, :n]), 1.0, 0.95)
            np.testing.assert_allclose(advantages[row, :n], expected, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(advantages[row, n:], 0.0)


class LossTest(chex.TestCase):
    def _rollout(self, seed=9):
        mask = jnp.asarray(_prefix_mask([5, 8]))
        return {
            "old_logprobs": -jnp.abs(_random((B, T), seed)),
            "old_values": _random((B, T), seed + 1),
            "advantages": _random((B, T), seed + 2),
            "returns": _random((B, T), seed + 3),
            "mask": mask,
        }

    @chex.variants(with_jit=True, without_jit=True)
    def test_zero_advantages_give_zero_policy_gradient(self):
        logits, responses = _random((B, T, V), 10), jnp.asarray(np.random.default_rng(11).integers(0, V, (B, T)))
        rollout = self._rollout()

        def loss(z, advantages):
            logprobs, _ = policy_gradient.response_logprobs(z, responses)
            return policy_gradient.policy_loss(logprobs, rollout["old_logprobs"], advantages, rollout["mask"])[0]

        grad = self.variant(jax.grad(loss))
        np.testing.assert_array_equal(grad(logits, jnp.zeros((B, T))), 0.0)
        self.assertGreater(float(jnp.abs(grad(logits, rollout["advantages"])).max()), 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_padding_and_post_eos_tokens_carry_no_loss(self):
        rollout = self._rollout()
        mask = rollout["mask"]
        logprobs, entropy, values = -jnp.abs(_random((B, T), 20)), jnp.abs(_random((B, T), 21)), _random((B, T), 22)
        loss_fn = self.variant(lambda lp, h, v, r: policy_gradient.ppo_loss(lp, h, v, r, entropy_coef=0.01))
        loss, metrics = loss_fn(logprobs, entropy, values, rollout)
        garbage = {k: (v if k == "mask" else jnp.where(mask > 0, v, 123.0)) for k, v in rollout.items()}
        noisy = [jnp.where(mask > 0, x, -77.0) for x in (logprobs, entropy, values)]
        noisy_loss, noisy_metrics = loss_fn(*noisy, garbage)
        np.testing.assert_allclose(noisy_loss, loss, rtol=1e-6)
        chex.assert_trees_all_close(noisy_metrics, metrics, rtol=1e-5)
        grads = jax.grad(lambda *a: loss_fn(*a, rollout)[0], argnums=(0, 1, 2))(logprobs, entropy, values)
        for grad in grads:
            self.assertGreater(float(jnp.abs(grad).max()), 0.0)
            np.testing.assert_array_equal(np.asarray(grad)[np.asarray(mask) == 0], 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_masked_loss_equals_the_loss_of_the_valid_tokens_alone(self):
        rollout = self._rollout()
        logprobs = rollout["old_logprobs"] + 0.3 * _random((B, T), 30)
        loss, _ = self.variant(
            lambda lp, r: policy_gradient.policy_loss(lp, r["old_logprobs"], r["advantages"], r["mask"])
        )(logprobs, rollout)
        valid = np.asarray(rollout["mask"]) > 0
        ratio = np.exp(np.asarray(logprobs - rollout["old_logprobs"])[valid])
        advantages = np.asarray(rollout["advantages"])[valid]
        expected = np.mean(np.maximum(-advantages * ratio, -advantages * np.clip(ratio, 0.8, 1.2)))
        np.testing.assert_allclose(loss, expected, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_clipping_and_metrics_on_hand_values(self):
        # ratio 1.5, A>0: the clipped −1.2 is the larger (pessimistic) term; ratio 0.5, A>0: the unclipped −0.5
        # is larger than the clipped −0.8, so the gradient still flows; ratio 1: both equal 2.
        old = jnp.zeros((1, 3))
        logprobs = jnp.log(jnp.array([[1.5, 0.5, 1.0]]))
        advantages, mask = jnp.array([[1.0, 1.0, -2.0]]), jnp.ones((1, 3))
        loss, metrics = self.variant(policy_gradient.policy_loss)(logprobs, old, advantages, mask)
        np.testing.assert_allclose(loss, np.mean([-1.2, -0.5, 2.0]), rtol=1e-6)
        np.testing.assert_allclose(np.divide(*metrics["policy/clipfrac"]), 1 / 3, rtol=1e-6)
        log_ratio = np.log([1.5, 0.5, 1.0])
        np.testing.assert_allclose(np.divide(*metrics["policy/approxkl"]), np.mean(0.5 * log_ratio**2), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_first_minibatch_has_ratio_one_and_no_clipping(self):
        rollout = self._rollout()
        loss, metrics = self.variant(policy_gradient.policy_loss)(
            rollout["old_logprobs"], rollout["old_logprobs"], rollout["advantages"], rollout["mask"]
        )
        np.testing.assert_allclose(
            loss, -policy_gradient.masked_mean(rollout["advantages"], rollout["mask"]), rtol=1e-6
        )
        np.testing.assert_allclose(np.divide(*metrics["policy/ratio"]), 1.0)
        for name in ("policy/clipfrac", "policy/approxkl", "policy/policykl"):
            np.testing.assert_array_equal(metrics[name][0], 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_value_loss_clips_around_the_old_values(self):
        values, old, returns = jnp.array([[1.0, 0.1]]), jnp.array([[0.0, 0.0]]), jnp.array([[2.0, -1.0]])
        loss, metrics = self.variant(lambda *a: policy_gradient.value_loss(*a, clip_eps=0.2))(
            values, old, returns, jnp.ones((1, 2))
        )
        # token 0: unclipped (1−2)² = 1, clipped (0.2−2)² = 3.24; token 1: (1.1)² = 1.21 both.
        np.testing.assert_allclose(loss, 0.5 * np.mean([3.24, 1.21]), rtol=1e-6)
        np.testing.assert_allclose(np.divide(*metrics["value/clipfrac"]), 0.5)

    def test_explained_variance(self):
        returns, mask = _random((B, T), 40), jnp.asarray(_prefix_mask([6, 4]))
        np.testing.assert_allclose(policy_gradient.explained_variance(returns, returns, mask), 1.0)
        constant = jnp.full((B, T), policy_gradient.masked_mean(returns, mask))
        np.testing.assert_allclose(policy_gradient.explained_variance(constant, returns, mask), 0.0, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_rollout_targets_whiten_advantages_and_keep_returns(self):
        mask = jnp.asarray(_prefix_mask([4, 8]))
        logprobs, ref, values = -jnp.abs(_random((B, T), 50)), -jnp.abs(_random((B, T), 51)), _random((B, T), 52)
        scores, has_eos = jnp.array([1.0, 2.0]), jnp.array([True, False])
        targets = self.variant(
            lambda *a: policy_gradient.ppo_rollout_targets(*a, kl_coef=0.05, missing_eos_penalty=1.0)
        )
        rollout, metrics = targets(scores, has_eos, logprobs, ref, values, mask)
        rewards, kl = policy_gradient.shaped_rewards(jnp.array([1.0, 1.0]), logprobs, ref, mask, kl_coef=0.05)
        advantages, returns = policy_gradient.gae(rewards, values, mask)
        np.testing.assert_allclose(rollout["returns"], returns, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            rollout["advantages"], policy_gradient.whiten(advantages, mask), rtol=1e-4, atol=1e-5
        )
        np.testing.assert_allclose(np.divide(*metrics["objective/scores"]), 1.0)
        np.testing.assert_allclose(np.divide(*metrics["objective/kl"]), jnp.sum(kl) / B, rtol=1e-5)
        np.testing.assert_allclose(np.divide(*metrics["tokens/response_len"]), 6.0)


class KLControllerTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_adaptive_update(self):
        update = self.variant(policy_gradient.update_kl_controller)
        state = policy_gradient.KLController(kl_coef=0.2, target=6.0, horizon=10000.0)
        np.testing.assert_allclose(update(state, 12.0, 512).kl_coef, 0.2 * (1 + 0.2 * 512 / 10000), rtol=1e-6)
        np.testing.assert_allclose(update(state, 6.0, 512).kl_coef, 0.2, rtol=1e-6)
        np.testing.assert_allclose(update(state, 5.4, 100).kl_coef, 0.2 * (1 - 0.1 * 100 / 10000), rtol=1e-6)
        np.testing.assert_allclose(update(state, 0.0, 100).kl_coef, 0.2 * (1 - 0.2 * 100 / 10000), rtol=1e-6)

    def test_fixed_coefficient_never_moves(self):
        state = policy_gradient.KLController(kl_coef=0.05)
        self.assertEqual(policy_gradient.update_kl_controller(state, 100.0, 512), state)


class ReinforceTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_baselines_on_hand_values(self):
        returns = jnp.array([[1.0, 2.0, 6.0]])
        baselines = self.variant(policy_gradient.reinforce_advantages, static_argnames="baseline")
        np.testing.assert_allclose(baselines(returns, baseline="mean"), [[-2.0, -1.0, 3.0]])
        np.testing.assert_allclose(baselines(returns, baseline="leave_one_out"), [[-3.0, -1.5, 4.5]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_loss_gradient_is_advantage_weighted_and_masked(self):
        logprobs, mask = _random((B, T), 60), jnp.asarray(_prefix_mask([3, 8]))
        advantages = jnp.array([2.0, -0.5])
        grads = self.variant(jax.grad(lambda lp: policy_gradient.reinforce_loss(lp, advantages, mask)[0]))(logprobs)
        np.testing.assert_allclose(grads, -np.asarray(advantages)[:, None] * np.asarray(mask) / B, rtol=1e-6)

    def test_sequence_returns(self):
        kl, mask = jnp.ones((B, T)), jnp.asarray(_prefix_mask([3, 8]))
        np.testing.assert_allclose(
            policy_gradient.sequence_returns(jnp.array([1.0, 1.0]), kl, mask, kl_coef=0.1), [0.7, 0.2], rtol=1e-6
        )


class GRPOTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_group_advantages_sum_to_zero_with_unit_std_per_group(self):
        returns = _random((3, 4), 70) * 5.0
        advantages = self.variant(policy_gradient.group_advantages)(returns)
        np.testing.assert_allclose(jnp.sum(advantages, axis=1), 0.0, atol=1e-5)
        np.testing.assert_allclose(jnp.std(advantages, axis=1, ddof=1), 1.0, rtol=1e-3)  # eps 1e-4 on std ~ 5
        np.testing.assert_allclose(  # the order within a group is kept
            jnp.argsort(advantages, axis=1), jnp.argsort(returns, axis=1)
        )
        np.testing.assert_array_equal(
            policy_gradient.group_advantages(jnp.ones((2, 3))), 0.0
        )  # equal scores: no signal

    @chex.variants(with_jit=True, without_jit=True)
    def test_loss_is_the_clipped_surrogate_plus_beta_times_k3(self):
        logprobs, old, ref = _random((B, T), 71) - 2.0, _random((B, T), 72) - 2.0, _random((B, T), 73) - 2.0
        mask = jnp.asarray(_prefix_mask([3, 8]))
        rollout = {"old_logprobs": old, "mask": mask, "sequence_advantages": jnp.array([1.5, -0.5])}
        loss = self.variant(functools.partial(policy_gradient.grpo_loss, clip_eps=0.2, kl_coef=0.1))
        value, metrics = loss(logprobs, ref, rollout)
        advantages = jnp.array([1.5, -0.5])[:, None] * mask
        surrogate, _ = policy_gradient.policy_loss(logprobs, old, advantages, mask, clip_eps=0.2)
        log_ratio = ref - logprobs
        k3 = np.sum((np.exp(log_ratio) - 1 - log_ratio) * mask) / np.sum(mask)
        np.testing.assert_allclose(value, surrogate + 0.1 * k3, rtol=1e-6)
        np.testing.assert_allclose(metrics["loss/kl"][0], k3, rtol=1e-6)
        # At the reference the KL term and its gradient vanish: only the surrogate pushes.
        at_reference = jax.grad(lambda lp: loss(lp, lp, rollout)[0])(logprobs)
        plain = jax.grad(lambda lp: policy_gradient.policy_loss(lp, old, advantages, mask, clip_eps=0.2)[0])(logprobs)
        np.testing.assert_allclose(at_reference, plain, rtol=1e-6, atol=1e-8)


if __name__ == "__main__":
    absltest.main()
