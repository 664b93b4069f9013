"""Alignment stage 3: PPO of the SFT policy against the frozen HH reward model (REINFORCE / RLOO as variants).

    python train.py --config=configs/hh_ppo.py --workdir=runs/hh_ppo \
        --config.objective.sft=ckpt:runs/hh_sft --config.objective.reward_model=ckpt:runs/hh_rm

Rollouts of 32 prompts (the last 64 bytes of each training prompt) with 32-byte responses; the
reward is normalised so SFT samples score mean 0, std 1; adaptive KL towards `kl_target` nats per
response. Variants: `nokl` (β = 0: the reward-hacking run), `rloo` (4 samples per prompt, leave-one-out
baseline), `grpo` (groups of 4 samples per prompt, group-normalised scores, β = 0.04 times the k3 KL as a loss
term, no value loss), `value_model` (a separate value network initialised from the reward model, at its own learning
rate, instead of the value head on the policy), `tiny` (a few steps of the 1-layer model of
configs/hh_sft.py:tiny). PPO-ptx: `--config.objective.ptx_coef=0.5` mixes in the SFT loss on
`ptx_batch_size` packed training demonstrations per iteration.
"""

import pathlib

from lmzoo.config import check_variants, load_config_file
from lmzoo.objectives import objective_section


def get_config(arg: str | None = None):
    variants = check_variants(arg, ("tiny", "nokl", "rloo", "grpo", "value_model"))
    tiny = "tiny" in variants
    c = load_config_file(pathlib.Path(__file__).with_name("hh_sft.py"), "tiny" if tiny else None)
    objective = dict(
        prompt_len=64,
        response_len=32,
        temperature=1.0,
        epochs=4,
        minibatches=2,
        kl_coef=0.1,
        kl_target=4.0,
        kl_horizon=2000.0,
        missing_eos_penalty=1.0,
        normalize_samples=128,
    )
    if "nokl" in variants:
        objective.update(kl_coef=0.0, kl_target=0.0)
    name = "ppo"
    if "rloo" in variants:  # its defaults: 4 samples per prompt, one update per rollout
        name = "rloo"
        del objective["epochs"]
    if "grpo" in variants:  # its defaults: groups of 4, one update per rollout, beta 0.04 on the k3 KL, no controller
        name = "grpo"
        for field in ("epochs", "minibatches", "kl_coef", "kl_target"):
            del objective[field]
    if "value_model" in variants:
        objective.update(value_model="reward")
    if tiny:
        objective.update(prompt_len=24, response_len=8, normalize_samples=8)
    c.objective = objective_section(name, **objective)
    c.optim.learning_rate, c.optim.min_learning_rate = 2e-5, 2e-5
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0
    c.optim.groups = (
        ("value_head", {"learning_rate": 1e-3, "min_learning_rate": 1e-3}),
    )  # the zero-init head learns fast
    if "value_model" in variants:  # a whole network that starts as the reward model: a smaller step
        c.optim.groups = (("value_model", {"learning_rate": 1e-4, "min_learning_rate": 1e-4}),)
    c.train.batch_size = 8 if {"rloo", "grpo"} & set(variants) else 32
    c.train.steps = c.optim.decay_steps = 60
    c.train.log_every = 1
    c.train.eval_every = c.train.checkpoint_every = 20
    c.eval.batch_size = 64
    c.eval.max_batches = 2
    if tiny:
        c.train.steps, c.train.batch_size, c.train.log_every = 3, 4, 1
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.batch_size, c.eval.max_batches = 4, 1
    return c
