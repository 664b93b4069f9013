"""PPO's training forward sees the rollout exactly as the KV-cache sampler did (same positions and padding), and
its rollouts draw only ids the tokenizer has."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import config as config_lib
from lmzoo import decoding, testing
from lmzoo.objectives import base
from lmzoo.rl import policy_gradient
from lmzoo.train import run as run_lib
from lmzoo.trainers import rl

ROOT = pathlib.Path(__file__).resolve().parents[2]

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


@pytest.mark.parametrize("variant", ["tiny", "tiny,rloo", "tiny,grpo"])
def test_rollouts_of_a_padded_vocabulary_draw_only_the_tokenizers_ids(variant):
    """configs/hh_ppo.py (PPO, RLOO, GRPO) with config.model.vocab_size 2048 over the byte tokenizer's 258 ids, the policy's weights
    zeroed: every id is as likely as any other, so a rollout that did not mask the 1,790 padded ids would draw them
    almost every time."""
    config = config_lib.load_config_file(ROOT / "configs" / "hh_ppo.py", variant)
    config.objective.update(sft="ckpt:unused", reward_model="ckpt:unused")
    config.model.vocab_size = 2048
    objective = run_lib.validated_objective(config)
    trainer = objective.trainer(objective.model())
    tokenizer = base.fixed_tokenizer(config)
    assert tokenizer.vocab_size < 300
    params = jax.tree.map(jnp.zeros_like, nn.unbox(jax.eval_shape(trainer.init, jax.random.key(0))).params)
    prompts = jnp.asarray(testing.random_tokens((4, trainer.settings.prompt_len), vocab_size=200, seed=0))
    batch = {"prompts": prompts, "prompt_mask": jnp.ones_like(prompts)}
    rollout = trainer.generate(params, batch, jax.random.key(1), samples_per_prompt=2)
    drawn = np.asarray(rollout["responses"])[np.asarray(rollout["mask"]) > 0]
    assert drawn.size >= 8 and drawn.max() < tokenizer.vocab_size, drawn
