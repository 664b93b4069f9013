"""The PPO trainer's loss options on a tiny decoder: the PPO-ptx term and the separate value network."""

import pathlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lmzoo import config as config_lib
from lmzoo import models, testing
from lmzoo.models import heads
from lmzoo.objectives import ppo as ppo_objective
from lmzoo.objectives import tasks
from lmzoo.rl import reward
from lmzoo.train import run as run_lib
from lmzoo.trainers import rl

EOS, PAD = 30, 31
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _trainer(value_model: str = "head", **settings) -> rl.PPOTrainer:
    """A PPO trainer on testing.TINY_GPT2 (prompts of 6 tokens, responses of 4), 2 prompts per rollout."""
    decoder = models.build_model("gpt2", testing.TINY_GPT2)
    if value_model == "head":
        policy = heads.LMWithValueHead(decoder)
    else:
        policy = heads.LMWithValueModel(decoder, reward.value_model(models.build_model("gpt2", testing.TINY_GPT2)))
    rm = reward.reward_model(models.build_model("gpt2", testing.TINY_GPT2), testing.TINY_GPT2["emb_dim"])
    settings = dict(prompt_len=6, response_len=4, epochs=1, minibatches=1, missing_eos_penalty=0.0) | settings
    config = ppo_objective.PPOConfig(value_model=value_model, **settings)
    ptx_loss = tasks.causal_lm_task(decoder).loss if config.ptx_coef > 0 else None
    return rl.PPOTrainer(
        policy=policy,
        reward_model=rm,
        settings=config,
        tx=optax.adam(1e-3),
        schedule=optax.constant_schedule(1e-3),
        batch_size=2,
        eos_id=EOS,
        pad_id=PAD,
        ptx_loss=ptx_loss,
    )


def _rollout(trainer):
    """(params, one scored rollout) of fresh random weights."""
    state = nn.unbox(trainer.init(jax.random.key(0)))
    prompts = jnp.asarray(testing.random_tokens((2, 6), vocab_size=30, seed=1))
    batch = {"prompts": prompts, "prompt_mask": jnp.ones_like(prompts)}
    rollout, _ = trainer.rollout(
        state.params, trainer.scoring_models(state), 0.1, batch, jax.random.key(2), samples_per_prompt=1
    )
    return state.params, rollout


def _demonstrations():
    """Two packed SFT rows [2, 10] with weights on part of them."""
    tokens = testing.random_tokens((2, 11), vocab_size=30, seed=3)
    weights = np.zeros((2, 10), np.float32)
    weights[:, 4:] = 1.0
    rows = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": weights,
        "segment_ids": np.ones((2, 10), np.int32),
        "positions": np.tile(np.arange(10, dtype=np.int32), (2, 1)),
    }
    return jax.tree.map(jnp.asarray, rows)


def test_ptx_gradient_is_the_ppo_gradient_plus_coef_times_the_lm_gradient():
    mixed, plain = _trainer(ptx_coef=0.5), _trainer()
    params, rollout = _rollout(plain)
    demonstrations = _demonstrations()
    (_, metrics), mixed_grads = jax.value_and_grad(mixed.minibatch_loss, has_aux=True)(params, rollout, demonstrations)
    ppo_grads = jax.grad(lambda p: plain.minibatch_loss(p, rollout)[0])(params)
    sft_loss = tasks.causal_lm_task(plain.decoder).loss
    lm_grads = jax.grad(lambda d: sft_loss(d, {}, {}, demonstrations, jax.random.key(0), step=0, train=False)[0])(
        params["decoder"]
    )
    expected = {**ppo_grads, "decoder": jax.tree.map(lambda g, h: g + 0.5 * h, ppo_grads["decoder"], lm_grads)}
    chex.assert_trees_all_close(mixed_grads, expected, rtol=1e-5, atol=1e-7)
    assert optax.global_norm(lm_grads) > 0.1 * optax.global_norm(ppo_grads["decoder"])  # the term is not negligible
    np.testing.assert_allclose(metrics["ptx/loss"][1], demonstrations["weights"].sum())
    # With ptx_coef 0 (the default) a batch's demonstrations are ignored and the loss is PPO's alone.
    assert plain.demonstrations({"prompts": 0, "ptx_inputs": demonstrations["inputs"]}) is None
    with pytest.raises(ValueError, match="ptx_"):
        mixed.demonstrations({"prompts": 0})


def test_ptx_update_uses_each_demonstration_part_once_per_epoch():
    trainer = _trainer(ptx_coef=0.5, epochs=2, minibatches=2)
    params, rollout = _rollout(trainer)
    opt_state = trainer.tx.init(params)
    _, _, metrics = trainer.update(params, opt_state, rollout, jax.random.key(4), _demonstrations())
    # 2 epochs x 2 minibatches, each with one of the 2 rows: every weighted token counted twice.
    np.testing.assert_allclose(metrics["ptx/loss"][1], 2 * _demonstrations()["weights"].sum())


def test_separate_value_network_shares_nothing_with_the_policy():
    trainer = _trainer(value_model="reward")
    no_value_loss = _trainer(value_model="reward", value_coef=0.0)
    params, rollout = _rollout(trainer)
    assert set(params) == {"decoder", "value_model"}
    grads = jax.grad(lambda p: trainer.minibatch_loss(p, rollout)[0])(params)
    policy_only = jax.grad(lambda p: no_value_loss.minibatch_loss(p, rollout)[0])(params)
    chex.assert_trees_all_close(grads["decoder"], policy_only["decoder"])  # the value loss never reaches the policy
    assert optax.global_norm(policy_only["value_model"]) == 0.0  # nor the policy loss the value network
    assert optax.global_norm(grads["value_model"]) > 0.0


@pytest.mark.parametrize("value_model", ["reward", "sft"])
def test_separate_value_network_starts_from_the_reward_model_or_the_sft_trunk(value_model):
    config = config_lib.load_config_file(ROOT / "configs" / "hh_ppo.py", "tiny,value_model")
    config.objective.update(sft="ckpt:unused", reward_model="ckpt:unused", value_model=value_model)
    objective = run_lib.validated_objective(config)
    trainer = objective.trainer(objective.model())
    state = jax.device_get(nn.unbox(jax.jit(trainer.init)(jax.random.key(0))))
    state = state.replace(params=objective.init_params(state.params, state.frozen))
    prompt_len = config.objective.prompt_len
    prompts = {
        "prompts": testing.random_tokens((5, prompt_len), vocab_size=256, seed=3),
        "prompt_mask": np.ones((5, prompt_len), np.int32),
    }
    state, fitted = jax.jit(trainer.prepare)(state, prompts)
    gain, bias = (float(state.reward_normalization[k]) for k in ("reward_gain", "reward_bias"))
    assert (gain, bias) == (
        pytest.approx(float(fitted["reward_normalization/gain"])),
        pytest.approx(float(fitted["reward_normalization/bias"])),
    )
    assert float(fitted["reward_normalization/raw_std"]) > 0 and gain == pytest.approx(
        1 / float(fitted["reward_normalization/raw_std"]), rel=1e-5
    )
    assert bias == pytest.approx(-gain * float(fitted["reward_normalization/raw_mean"]), rel=1e-5, abs=1e-6)
    tokens = jnp.asarray(testing.random_tokens((3, 12), vocab_size=256, seed=5))
    _, values = trainer.policy.apply({"params": state.params}, tokens)
    jax.tree.map(np.testing.assert_array_equal, state.params["decoder"], state.frozen["reference"])
    if value_model == "reward":  # its value of a whole sequence is the normalised score
        raw = trainer.reward_model.apply({"params": state.frozen["reward"]}, tokens)[:, 0]
        np.testing.assert_allclose(values[:, -1], gain * raw + bias, rtol=1e-5, atol=1e-5)
    else:
        for name, subtree in state.params["value_model"]["backbone"].items():
            jax.tree.map(np.testing.assert_array_equal, subtree, state.frozen["reference"][name])
        np.testing.assert_array_equal(values, 0.0)
