"""PPO's training forward sees the rollout exactly as the KV-cache sampler did (same positions and padding)."""

import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import decoding, testing
from lmzoo.rl import policy_gradient
from lmzoo.trainers import rl

EOS, PAD = 30, 31


def test_forward_over_rollout_inputs_reproduces_the_sampler_log_probs():
    model, params = testing.tiny_gpt2()
    prompts = jnp.array([[PAD, PAD, 5, 6, 7], [1, 2, 3, 4, 5], [PAD, PAD, PAD, PAD, 9]], jnp.int32)
    prompt_mask = (prompts != PAD).astype(jnp.int32)
    samples = decoding.sample(
        model,
        params,
        prompts,
        prompt_mask,
        jax.random.key(3),
        max_new_tokens=8,
        temperature=0.7,
        eos_id=EOS,
        pad_id=PAD,
    )
    inputs = rl.rollout_inputs(prompts, prompt_mask, samples.tokens, samples.mask)
    np.testing.assert_array_equal(inputs["positions"][0, 2:7], np.arange(5))  # the left padding is not counted
    logits = model.apply(
        {"params": params}, inputs["sequences"], segment_ids=inputs["segment_ids"], positions=inputs["positions"]
    )
    logprobs, _ = policy_gradient.response_logprobs(
        policy_gradient.align_to_responses(logits, prompts.shape[1]), samples.tokens, temperature=0.7
    )
    mask = np.asarray(samples.mask) > 0
    assert mask.sum() > 3
    np.testing.assert_allclose(np.asarray(logprobs)[mask], np.asarray(samples.log_probs)[mask], atol=1e-4)
