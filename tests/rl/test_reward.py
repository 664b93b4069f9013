"""Reward model: K-wise ranking loss, accuracy, normalisation, and the score read at the last non-pad token."""

import itertools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from lmzoo import models, testing
from lmzoo.models import heads
from lmzoo.rl import reward

PAD = 0


def _pairwise(r_w, r_l):
    return -np.log(1.0 / (1.0 + np.exp(-(r_w - r_l))))


class RankingLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_kwise_loss_equals_the_mean_of_its_pairwise_losses(self):
        rewards = jnp.array([[2.0, 1.0, 0.0, -0.5]])
        ranks, valid = jnp.array([[0, 1, 2, 3]]), jnp.ones((1, 4), bool)
        loss, metrics = self.variant(reward.ranking_loss)(rewards, ranks, valid)
        r = np.asarray(rewards[0])
        expected = np.mean([_pairwise(r[i], r[j]) for i, j in itertools.combinations(range(4), 2)])
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
        pairwise = [
            self.variant(reward.ranking_loss)(rewards[:, [i, j]], jnp.array([[0, 1]]), valid[:, :2])[0]
            for i, j in itertools.combinations(range(4), 2)
        ]
        np.testing.assert_allclose(loss, np.mean(pairwise), rtol=1e-6)
        np.testing.assert_allclose(np.divide(*metrics["accuracy"]), 1.0)
        np.testing.assert_allclose(metrics["accuracy"][1], 6.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_ties_and_padding_form_no_pairs(self):
        # Prompt 0: responses 0 and 1 tie, both above 2 -> pairs (0,2), (1,2). Prompt 1: K = 2 of 3.
        rewards = jnp.array([[0.3, 1.0, 0.5], [1.0, 2.0, 99.0]])
        ranks = jnp.array([[0, 0, 1], [1, 0, 0]])
        valid = jnp.array([[True, True, True], [True, True, False]])
        loss, metrics = self.variant(reward.ranking_loss)(rewards, ranks, valid)
        prompt0 = np.mean([_pairwise(0.3, 0.5), _pairwise(1.0, 0.5)])
        prompt1 = _pairwise(2.0, 1.0)
        np.testing.assert_allclose(loss, (prompt0 + prompt1) / 2, rtol=1e-6)
        np.testing.assert_allclose(metrics["accuracy"], (2.0, 3.0))
        np.testing.assert_allclose(np.divide(*metrics["margin"]), (-0.2 + 0.5 + 1.0) / 3, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_permuting_responses_with_their_ranks_changes_nothing(self):
        rewards = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4)), jnp.float32)
        ranks, valid = jnp.array([[0, 1, 2, 3], [2, 0, 1, 1]]), jnp.array([[True] * 4, [True, True, True, False]])
        order = np.array([2, 0, 3, 1])
        loss, metrics = self.variant(reward.ranking_loss)(rewards, ranks, valid)
        permuted, permuted_metrics = self.variant(reward.ranking_loss)(
            rewards[:, order], ranks[:, order], valid[:, order]
        )
        np.testing.assert_allclose(permuted, loss, rtol=1e-6)
        chex.assert_trees_all_close(permuted_metrics, metrics, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_stable_for_large_margins(self):
        rewards, ranks, valid = jnp.array([[-200.0, 200.0]]), jnp.array([[0, 1]]), jnp.ones((1, 2), bool)
        loss, _ = self.variant(reward.ranking_loss)(rewards, ranks, valid)
        grad = jax.grad(lambda r: reward.ranking_loss(r, ranks, valid)[0])(rewards)
        np.testing.assert_allclose(loss, 400.0, rtol=1e-6)
        np.testing.assert_allclose(grad, [[-1.0, 1.0]], rtol=1e-6)

    def test_normalization_centres_reference_scores(self):
        scores = jnp.asarray(np.random.default_rng(1).normal(3.0, 2.0, size=64), jnp.float32)
        gain, bias = reward.fit_normalization(scores)
        normalized = reward.normalize(scores, gain, bias)
        np.testing.assert_allclose(jnp.mean(normalized), 0.0, atol=1e-5)
        np.testing.assert_allclose(jnp.std(normalized), 1.0, rtol=1e-5)


class RewardModelTest(absltest.TestCase):
    def test_score_is_read_at_the_last_non_pad_token_on_either_side(self):
        backbone = models.build_model("gpt2", testing.TINY_GPT2)
        model = reward.reward_model(backbone, testing.TINY_GPT2["emb_dim"])
        text = jnp.asarray(testing.random_tokens((1, 5), seed=3) % 31 + 1)  # no pad id inside
        params = nn.unbox(model.init(jax.random.key(0), text)["params"])
        alone = reward.score(model, params, text, pad_id=PAD)
        pads = jnp.full((1, 3), PAD, jnp.int32)
        right, left = jnp.concatenate([text, pads], axis=1), jnp.concatenate([pads, text], axis=1)
        scores = reward.score(model, params, jnp.stack([right, left], axis=1), pad_id=PAD)  # [1, K=2]
        chex.assert_shape(scores, (1, 2))
        np.testing.assert_allclose(scores[0], jnp.repeat(alone, 2), rtol=1e-5, atol=1e-6)
        truncated = reward.score(model, params, text[:, :4], pad_id=PAD)
        self.assertGreater(float(jnp.abs(truncated - alone)[0]), 1e-4)

    def test_value_model_starts_as_a_copy_of_the_reward_model(self):
        backbone = models.build_model("gpt2", testing.TINY_GPT2)
        rm = reward.reward_model(backbone, testing.TINY_GPT2["emb_dim"])
        tokens = jnp.asarray(testing.random_tokens((2, 8), seed=4) % 31 + 1).at[1, :3].set(PAD)  # row 1 left-padded
        params = nn.unbox(rm.init(jax.random.key(0), tokens)["params"])
        segment_ids, positions = reward.padding_inputs(tokens, PAD)
        values = reward.value_model(backbone).apply(
            {"params": params}, tokens, segment_ids=segment_ids, positions=positions
        )
        chex.assert_shape(values, (2, 8, 1))
        np.testing.assert_allclose(values[:, -1, 0], reward.score(rm, params, tokens, pad_id=PAD), rtol=1e-5, atol=1e-6)

    def test_lm_with_value_head_keeps_the_decoder_logits_and_starts_at_zero_value(self):
        decoder, decoder_params = testing.tiny_gpt2()
        policy = heads.LMWithValueHead(decoder)
        tokens = jnp.asarray(testing.random_tokens())
        params = nn.unbox(policy.init(jax.random.key(1), tokens)["params"])
        params = {**params, "decoder": decoder_params}
        logits, values = policy.apply({"params": params}, tokens)
        chex.assert_shape(values, (2, 8))
        np.testing.assert_array_equal(values, 0.0)
        np.testing.assert_allclose(logits, decoder.apply({"params": decoder_params}, tokens), rtol=1e-6, atol=1e-6)
        grads = jax.grad(lambda p: jnp.sum(policy.apply({"params": p}, tokens)[1] * tokens))(params)
        self.assertGreater(float(jnp.abs(grads["value_head"]["kernel"]).max()), 0.0)

    def test_pool_last_on_left_and_right_padding(self):
        hidden = jnp.arange(2 * 5 * 3, dtype=jnp.float32).reshape(2, 5, 3)
        pooled = heads.pool(hidden, jnp.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]]), "last")
        np.testing.assert_array_equal(pooled, np.stack([hidden[0, 2], hidden[1, 4]]))

    def test_head_is_a_zero_bias_scalar(self):
        backbone = models.build_model("gpt2", testing.TINY_GPT2)
        model = reward.reward_model(backbone, testing.TINY_GPT2["emb_dim"])
        params = nn.unbox(model.init(jax.random.key(0), jnp.ones((2, 8), jnp.int32))["params"])
        chex.assert_shape(params["classifier"]["kernel"], (16, 1))
        np.testing.assert_array_equal(params["classifier"]["bias"], 0.0)


if __name__ == "__main__":
    absltest.main()
