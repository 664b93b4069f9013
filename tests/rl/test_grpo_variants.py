"""GRPO's successors (Dr. GRPO, DAPO, GSPO, truncated IS) against hand computations and explicit loops."""

import functools
import itertools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from lmzoo.rl import policy_gradient

LENGTHS = (2, 4, 1)  # unequal, so the three aggregations differ
B, T = len(LENGTHS), 4


def _prefix_mask(lengths, t=T):
    return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def _rollout_arrays():
    """Log-probs with ratios on both sides of the clip range, and garbage (finite) on the masked tokens.

    With A = (1.3, −0.7, 0.9) and ε = 0.2 the token ratios clip high at 1.3 and 1.22 (only 1.3 with ε_high = 0.28)
    and low at 0.7; the sequence ratios are about 1.08, 0.98 and 1.22."""
    rng = np.random.default_rng(0)
    mask = _prefix_mask(LENGTHS)
    old = rng.normal(size=(B, T)) - 1.5
    ratios = np.array([[1.3, 0.9, 1.0, 1.0], [0.7, 1.1, 0.95, 1.25], [1.22, 1.0, 1.0, 1.0]])
    logprobs = old + np.log(ratios)
    ref = old + 0.3 * rng.normal(size=(B, T))
    behaviour = old + 0.8 * rng.normal(size=(B, T))
    garbage = 3.0 * rng.normal(size=(B, T))
    logprobs, ref, behaviour = (np.where(mask > 0, x, x + garbage) for x in (logprobs, ref, behaviour))
    advantages = np.array([1.3, -0.7, 0.9])
    return logprobs, old, ref, behaviour, advantages, mask


def _as_rollout(old, behaviour, advantages, mask):
    return {
        "old_logprobs": jnp.asarray(old, jnp.float32),
        "behaviour_logprobs": jnp.asarray(behaviour, jnp.float32),
        "sequence_advantages": jnp.asarray(advantages, jnp.float32),
        "mask": jnp.asarray(mask, jnp.float32),
    }


def _reference_loss(
    logprobs, old, ref, behaviour, advantages, lengths, *, eps_low, eps_high, aggregation, level, kl, beta, cap
):
    """The GRPO-family loss written out token by token: returns (total, policy term, KL term)."""
    surrogate, kl_terms = {}, {}
    for i, n in enumerate(lengths):
        sequence_log_ratio = sum(logprobs[i, t] - old[i, t] for t in range(n)) / n
        for t in range(n):
            log_ratio = sequence_log_ratio if level == "sequence" else logprobs[i, t] - old[i, t]
            ratio = math.exp(log_ratio)
            clipped = min(max(ratio, 1.0 - eps_low), 1.0 + eps_high)
            term = max(-advantages[i] * ratio, -advantages[i] * clipped)
            if cap is not None:
                term *= min(math.exp(old[i, t] - behaviour[i, t]), cap)
            surrogate[i, t] = term
            d = ref[i, t] - logprobs[i, t]  # log π_ref/π
            kl_terms[i, t] = {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1.0 - d, "off": 0.0}[kl]

    def aggregate(terms):
        if aggregation == "token":
            return sum(terms.values()) / sum(lengths)
        if aggregation == "sequence":
            return sum(sum(terms[i, t] for t in range(n)) / n for i, n in enumerate(lengths)) / len(lengths)
        return sum(terms.values()) / (len(lengths) * T)

    policy, kl_term = aggregate(surrogate), aggregate(kl_terms)
    return policy + (0.0 if kl == "off" else beta * kl_term), policy, kl_term


def _todays_grpo_loss(logprobs, ref_logprobs, rollout, clip_eps=0.2, kl_coef=0.04):
    """A copy of grpo_loss's formula before the keywords were added (policy_loss's clipped surrogate + β·k3)."""
    mask = rollout["mask"]
    advantages = jax.lax.stop_gradient(rollout["sequence_advantages"])[:, None] * mask
    ratio = jnp.exp(logprobs - rollout["old_logprobs"])
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg_loss = jnp.sum(jnp.maximum(unclipped, clipped) * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    log_ratio = logprobs - ref_logprobs
    k3 = jnp.expm1(-log_ratio) + log_ratio
    kl_loss = jnp.sum(k3 * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    return pg_loss + kl_coef * kl_loss


class AdvantageTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_dr_grpo_advantages_only_centre_and_the_default_is_unchanged(self):
        returns = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 0.0, 1.0, 0.0]])
        centred = self.variant(functools.partial(policy_gradient.group_advantages, scale_by_std=False))(returns)
        np.testing.assert_allclose(centred, [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [2.0, -1.0, 0.0, -1.0]], atol=1e-6)
        expected = np.zeros_like(returns)
        for p, group in enumerate(returns):
            mean = sum(group) / len(group)
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
            expected[p] = [(r - mean) / (std + 1e-4) for r in group]
        np.testing.assert_allclose(self.variant(policy_gradient.group_advantages)(returns), expected, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_informative_groups_are_those_whose_returns_differ(self):
        returns = jnp.array([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 3.0]])
        keep = self.variant(policy_gradient.informative_groups)(returns)
        self.assertEqual(keep.dtype, jnp.bool_)
        np.testing.assert_array_equal(keep, [False, True, False, True])

    @chex.variants(with_jit=True, without_jit=True)
    def test_overlong_penalty_is_piecewise_with_its_boundaries(self):
        penalty = self.variant(functools.partial(policy_gradient.overlong_penalty, max_len=10, cache_len=4))
        lengths = jnp.array([0, 5, 6, 7, 8, 9, 10, 11, 20])  # soft region (6, 10]
        np.testing.assert_allclose(penalty(lengths), [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0], atol=1e-7)
        hard = policy_gradient.overlong_penalty(jnp.array([10, 11]), max_len=10, cache_len=0)
        np.testing.assert_array_equal(hard, [0.0, -1.0])
        with self.assertRaisesRegex(ValueError, "cache_len <= max_len"):
            policy_gradient.overlong_penalty(lengths, max_len=4, cache_len=5)


class TokenPiecesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_truncated_is_weights_are_capped_masked_and_constant(self):
        old = jnp.log(jnp.array([[0.5, 3.0, 1.0], [1.5, 7.0, 2.5]]))
        behaviour = jnp.zeros((2, 3))
        mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
        weights = self.variant(functools.partial(policy_gradient.truncated_is_weights, cap=2.0))
        np.testing.assert_allclose(weights(old, behaviour, mask), [[0.5, 2.0, 1.0], [1.5, 0.0, 2.0]], rtol=1e-6)
        grads = jax.grad(lambda o, b: jnp.sum(weights(o, b, mask)), argnums=(0, 1))(old, behaviour)
        chex.assert_trees_all_equal(grads, (jnp.zeros((2, 3)), jnp.zeros((2, 3))))

    @chex.variants(with_jit=True, without_jit=True)
    def test_aggregations_by_hand(self):
        x = jnp.array([[1.0, 3.0, 9.0, 9.0], [2.0, 2.0, 2.0, 6.0], [4.0, 9.0, 9.0, 9.0]])
        mask = jnp.asarray(_prefix_mask(LENGTHS))  # valid: [1, 3], [2, 2, 2, 6], [4]
        aggregate = self.variant(policy_gradient.aggregate_tokens, static_argnames="aggregation")
        np.testing.assert_allclose(aggregate(x, mask, aggregation="token"), 20.0 / 7.0, rtol=1e-6)
        np.testing.assert_allclose(aggregate(x, mask, aggregation="sequence"), (2.0 + 3.0 + 4.0) / 3.0, rtol=1e-6)
        np.testing.assert_allclose(aggregate(x, mask, aggregation="constant"), 20.0 / 12.0, rtol=1e-6)

    def test_the_aggregations_of_the_grpo_loss_differ_as_the_papers_say(self):
        # At ratio 1 every valid token's surrogate is −A_i: lengths 2, 4, 1 with A = 1, −0.5, 2.
        mask = _prefix_mask(LENGTHS)
        logprobs = jnp.full((B, T), -1.0)
        rollout = _as_rollout(np.full((B, T), -1.0), np.full((B, T), -1.0), np.array([1.0, -0.5, 2.0]), mask)
        expected = {"token": -2.0 / 7.0, "sequence": -2.5 / 3.0, "constant": -2.0 / 12.0}
        for aggregation, value in expected.items():
            loss, metrics = policy_gradient.grpo_loss(
                logprobs, None, rollout, aggregation=aggregation, kl_estimator="off"
            )
            np.testing.assert_allclose(loss, value, rtol=1e-6, err_msg=aggregation)
            np.testing.assert_allclose(metrics["loss/policy"][0], value, rtol=1e-6)

    def test_clip_higher_lets_positive_tokens_grow_further(self):
        # Row 0: A = +1 at ratio 1.25 (above 1 + 0.2, below 1 + 0.28); row 1: A = −1 at ratio 0.75 (below 1 − 0.2).
        mask = np.ones((2, 2), np.float32)
        old = jnp.zeros((2, 2))
        logprobs = jnp.log(jnp.array([[1.25, 1.25], [0.75, 0.75]]))
        rollout = _as_rollout(old, old, np.array([1.0, -1.0]), mask)
        for eps_high, loss_value, row0_grad, fractions in (
            (None, (-1.2 * 2 + 0.8 * 2) / 4, 0.0, (1.0, 0.5, 0.5)),
            (0.28, (-1.25 * 2 + 0.8 * 2) / 4, -1.25 / 4, (0.5, 0.5, 0.0)),
        ):
            loss_fn = functools.partial(policy_gradient.grpo_loss, clip_eps_high=eps_high, kl_estimator="off")
            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(logprobs, None, rollout)
            np.testing.assert_allclose(loss, loss_value, rtol=1e-6)
            np.testing.assert_allclose(grads, [[row0_grad] * 2, [0.0, 0.0]], atol=1e-7)
            for key, fraction in zip(("policy/clipfrac", "policy/clipfrac_low", "policy/clipfrac_high"), fractions):
                total, count = metrics[key]
                np.testing.assert_allclose(total / count, fraction, err_msg=f"{key} at eps_high={eps_high}")


class GRPOLossTest(chex.TestCase):
    def test_every_keyword_combination_matches_the_token_loop(self):
        logprobs, old, ref, behaviour, advantages, mask = _rollout_arrays()
        rollout = _as_rollout(old, behaviour, advantages, mask)
        lp32, ref32 = jnp.asarray(logprobs, jnp.float32), jnp.asarray(ref, jnp.float32)
        arrays = [
            np.asarray(x, np.float64) for x in (lp32, rollout["old_logprobs"], ref32, rollout["behaviour_logprobs"])
        ]
        for aggregation, level, kl, cap, eps_high in itertools.product(
            policy_gradient.AGGREGATIONS,
            policy_gradient.RATIO_LEVELS,
            ("off", "k1", "k2", "k3"),
            (None, 1.5),
            (None, 0.28),
        ):
            combo = f"{aggregation=} {level=} {kl=} {cap=} {eps_high=}"
            loss, metrics = policy_gradient.grpo_loss(
                lp32,
                ref32,
                rollout,
                clip_eps=0.2,
                kl_coef=0.1,
                clip_eps_high=eps_high,
                aggregation=aggregation,
                ratio_level=level,
                kl_estimator=kl,
                tis_cap=cap,
            )
            total, policy, kl_term = _reference_loss(
                *arrays,
                advantages.astype(np.float32).astype(np.float64),
                LENGTHS,
                eps_low=0.2,
                eps_high=0.2 if eps_high is None else eps_high,
                aggregation=aggregation,
                level=level,
                kl=kl,
                beta=0.1,
                cap=cap,
            )
            np.testing.assert_allclose(loss, total, rtol=1e-5, atol=1e-7, err_msg=combo)
            np.testing.assert_allclose(metrics["loss/policy"][0], policy, rtol=1e-5, atol=1e-7, err_msg=combo)
            np.testing.assert_allclose(metrics["loss/kl"][0], kl_term, rtol=1e-5, atol=1e-7, err_msg=combo)
            self.assertEqual("policy/tis_weight" in metrics, cap is not None)

    @chex.variants(with_jit=True, without_jit=True)
    def test_defaults_are_todays_loss_and_gradient(self):
        logprobs, old, ref, behaviour, advantages, mask = _rollout_arrays()
        logprobs, ref = jnp.asarray(logprobs, jnp.float32), jnp.asarray(ref, jnp.float32)
        rollout = _as_rollout(old, behaviour, advantages, mask)  # behaviour_logprobs present but tis_cap None: unused
        for kwargs in ({}, {"clip_eps": 0.1, "kl_coef": 0.3}):
            new = self.variant(functools.partial(policy_gradient.grpo_loss, **kwargs))
            (loss, metrics), grads = jax.value_and_grad(new, has_aux=True)(logprobs, ref, rollout)
            today, today_grads = jax.value_and_grad(functools.partial(_todays_grpo_loss, **kwargs))(
                logprobs, ref, rollout
            )
            np.testing.assert_allclose(loss, today, rtol=1e-7, atol=0)
            np.testing.assert_allclose(grads, today_grads, rtol=1e-7, atol=0)
            clip_eps = kwargs.get("clip_eps", 0.2)
            advantages_bt = rollout["sequence_advantages"][:, None] * rollout["mask"]
            _, surrogate_metrics = policy_gradient.policy_loss(
                logprobs, rollout["old_logprobs"], advantages_bt, rollout["mask"], clip_eps=clip_eps
            )
            for key, value in surrogate_metrics.items():  # today's keys keep today's values
                chex.assert_trees_all_close(metrics[key], value, rtol=1e-7)
            self.assertTrue({"loss/policy", "loss/kl", "loss/total"} <= metrics.keys())
            low, high = metrics["policy/clipfrac_low"][0], metrics["policy/clipfrac_high"][0]
            np.testing.assert_allclose(low + high, metrics["policy/clipfrac"][0])
            self.assertGreater(low, 0)  # the example clips on both sides
            self.assertGreater(high, 0)

    def test_defaults_are_bit_identical_to_todays_formula_eagerly(self):
        logprobs, old, ref, behaviour, advantages, mask = _rollout_arrays()
        logprobs, ref = jnp.asarray(logprobs, jnp.float32), jnp.asarray(ref, jnp.float32)
        rollout = _as_rollout(old, behaviour, advantages, mask)
        (loss, _), grads = jax.value_and_grad(policy_gradient.grpo_loss, has_aux=True)(logprobs, ref, rollout)
        today, today_grads = jax.value_and_grad(_todays_grpo_loss)(logprobs, ref, rollout)
        np.testing.assert_array_equal(loss, today)
        np.testing.assert_array_equal(grads, today_grads)

    def test_kl_off_needs_no_reference(self):
        logprobs, old, ref, behaviour, advantages, mask = _rollout_arrays()
        rollout = _as_rollout(old, behaviour, advantages, mask)
        logprobs = jnp.asarray(logprobs, jnp.float32)
        off = jax.jit(functools.partial(policy_gradient.grpo_loss, kl_estimator="off", kl_coef=0.5))
        loss, metrics = off(logprobs, None, rollout)
        garbage_loss, _ = off(logprobs, jnp.full((B, T), jnp.nan), rollout)
        np.testing.assert_array_equal(loss, garbage_loss)
        np.testing.assert_array_equal(metrics["loss/kl"][0], 0.0)
        np.testing.assert_allclose(loss, policy_gradient.grpo_loss(logprobs, logprobs, rollout, kl_coef=0.0)[0])
        with self.assertRaisesRegex(ValueError, "needs ref_logprobs"):
            policy_gradient.grpo_loss(logprobs, None, rollout)

    def test_truncated_is_multiplies_each_tokens_surrogate(self):
        # Ratio 1 and A = 1 on both tokens: the surrogate is −1 per token, times min(π_old/π_behaviour, 2) = 0.5, 2.
        mask = np.ones((1, 2), np.float32)
        old = jnp.zeros((1, 2))
        rollout = _as_rollout(old, np.log([[2.0, 1.0 / 3.0]]), np.array([1.0]), mask)
        loss, metrics = policy_gradient.grpo_loss(old, None, rollout, kl_estimator="off", tis_cap=2.0)
        np.testing.assert_allclose(loss, -(0.5 + 2.0) / 2, rtol=1e-6)
        np.testing.assert_allclose(metrics["policy/tis_weight"][0] / metrics["policy/tis_weight"][1], 1.25, rtol=1e-6)
        np.testing.assert_allclose(metrics["policy/tis_capped"][0], 1.0)
        without = policy_gradient.grpo_loss(old, None, {**rollout, "behaviour_logprobs": old}, kl_estimator="off")[0]
        np.testing.assert_allclose(without, -1.0, rtol=1e-6)
        del rollout["behaviour_logprobs"]
        with self.assertRaisesRegex(ValueError, "behaviour_logprobs"):
            policy_gradient.grpo_loss(old, None, rollout, kl_estimator="off", tis_cap=2.0)

    def test_string_keywords_are_checked(self):
        logprobs, old, ref, behaviour, advantages, mask = _rollout_arrays()
        rollout = _as_rollout(old, behaviour, advantages, mask)
        for keyword, choices in (
            ("aggregation", policy_gradient.AGGREGATIONS),
            ("ratio_level", policy_gradient.RATIO_LEVELS),
            ("kl_estimator", policy_gradient.GRPO_KL_ESTIMATORS),
        ):
            with self.assertRaisesRegex(ValueError, f"choose one of {choices}".replace("(", r"\(").replace(")", r"\)")):
                policy_gradient.grpo_loss(logprobs, ref, rollout, **{keyword: "nope"})
        self.assertEqual(policy_gradient.GRPO_KL_ESTIMATORS, ("off", "k1", "k2", "k3"))


class GSPOTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_gspo_token_ratio_is_the_sequence_ratio_with_per_token_gradients(self):
        logprobs, old, _, _, _, mask = _rollout_arrays()
        lp, old, mask = (jnp.asarray(x, jnp.float32) for x in (logprobs, old, mask))
        ratio_fn = self.variant(policy_gradient.gspo_token_ratio)
        ratio = ratio_fn(lp, old, mask)
        weights = jnp.arange(1.0, B * T + 1).reshape(B, T)
        grads = jax.grad(lambda x: jnp.sum(ratio_fn(x, old, mask) * weights))(lp)
        for i, n in enumerate(LENGTHS):
            s_i = math.exp(sum(float(lp[i, t]) - float(old[i, t]) for t in range(n)) / n)
            np.testing.assert_allclose(ratio[i], s_i, rtol=1e-5)  # on every token, masked ones too
            np.testing.assert_allclose(grads[i], s_i * weights[i], rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gspo_token_has_gspos_value_and_gradient(self):
        logprobs, old, _, _, _, mask = _rollout_arrays()
        lp, old, mask = (jnp.asarray(x, jnp.float32) for x in (logprobs, old, mask))
        lp = lp.at[1, :].set(old[1] - 0.5)  # response 1 (A < 0) far below 1 − ε: clipped, no gradient
        advantages = np.array([1.3, -0.7, 0.9], np.float32)
        rollout = _as_rollout(old, old, advantages, mask)
        gspo_token = self.variant(
            functools.partial(
                policy_gradient.grpo_loss, ratio_level="sequence", aggregation="sequence", kl_estimator="off"
            )
        )

        def gspo(x):  # Zheng et al.'s sequence-level loss, the gradient flowing through s_i's mean
            s = jnp.exp(jnp.sum((x - old) * mask, axis=1) / jnp.sum(mask, axis=1))
            return -jnp.mean(jnp.minimum(s * advantages, jnp.clip(s, 0.8, 1.2) * advantages))

        (loss, metrics), grads = jax.value_and_grad(gspo_token, has_aux=True)(lp, None, rollout)
        np.testing.assert_allclose(loss, gspo(lp), rtol=1e-6)
        np.testing.assert_allclose(grads, jax.grad(gspo)(lp), rtol=1e-5, atol=1e-8)
        # By hand: dL/dlp_{i,t} = −(1/B)·A_i·s_i/|y_i| on the valid tokens of an unclipped response, 0 otherwise.
        expected, value = np.zeros((B, T)), 0.0
        for i, n in enumerate(LENGTHS):
            s_i = math.exp(sum(float(lp[i, t]) - float(old[i, t]) for t in range(n)) / n)
            clipped = min(max(s_i, 0.8), 1.2)
            value -= min(s_i * advantages[i], clipped * advantages[i]) / B
            if s_i * advantages[i] <= clipped * advantages[i]:
                expected[i, :n] = -advantages[i] * s_i / n / B
        self.assertTrue(np.all(expected[1] == 0) and np.all(expected[0, : LENGTHS[0]] != 0))
        np.testing.assert_allclose(loss, value, rtol=1e-5)
        np.testing.assert_allclose(grads, expected, rtol=1e-5, atol=1e-8)
        total, count = metrics["policy/clipfrac_low"]
        np.testing.assert_allclose(total / count, LENGTHS[1] / sum(LENGTHS))  # every token of response 1


if __name__ == "__main__":
    absltest.main()
