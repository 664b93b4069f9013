"""Time of one PPO iteration on this CPU, split into the phases `PPOTrainer.step` is made of (the ones the training
loop runs and logs as time/<phase>_ms): rollout (`generate`: KV-cache sampling), scoring (`score`: policy, reference
and reward-model forwards, shaped rewards, GAE) and update (`update`: epochs x minibatches of clipped PPO steps and
the KL controller), next to the whole step jitted as one program.

    PYTHONPATH=$PWD python bench/ppo_bench.py                  # the model and rollout sizes of configs/hh_ppo.py
    PYTHONPATH=$PWD python bench/ppo_bench.py --variant value_model --ptx_coef 0.5
    PYTHONPATH=$PWD venv-trl/bin/python bench/ppo_bench.py --variant rloo --trl   # + trl's RLOOTrainer

Random weights (nothing is read). Each phase is jitted on its own (`trainer.run_phase`), called on what the step passes it
and timed with `block_until_ready` after warm-up, the parts and the step in alternating order
(`common.interleaved_ms`). The step fuses the parts into one program, so their sum need not equal it.

`--trl` times trl's RLOOTrainer (`--variant rloo`) or GRPOTrainer (`--variant grpo`) on the same shapes (an HF GPT2
of the same config, a GPT2 reward model, the same prompts x samples, response length and updates per rollout). trl
1.16 has no PPOTrainer (moved to `trl.experimental.ppo` in 1.10, removed in huggingface/trl#7020), so PPO has no
trl column. trl is no requirement of lmzoo: put it in a venv of its own that sees the lmzoo venv's
packages, so pip keeps their torch and transformers (check that it installs nothing but trl):

    python -m venv venv-trl && echo $VIRTUAL_ENV/lib/python3.11/site-packages > venv-trl/lib/python3.11/site-packages/lmzoo.pth
    venv-trl/bin/pip install trl==1.16.0
"""

import argparse
import functools
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

from lmzoo import config as config_lib  # noqa: E402
from lmzoo import objectives  # noqa: E402
from lmzoo.train import run as run_lib  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ("ppo", "rloo", "grpo", "value_model")
TRL_VARIANTS = ("rloo", "grpo")  # trl 1.16 has no PPOTrainer


def hh_ppo_config(variant: str, tiny: bool, ptx_coef: float):
    names = [name for name in ("tiny" if tiny else "", "" if variant == "ppo" else variant) if name]
    config = config_lib.load_config_file(ROOT / "configs" / "hh_ppo.py", ",".join(names) or None)
    config.objective.update(sft="ckpt:unused", reward_model="ckpt:unused", ptx_coef=ptx_coef)
    return run_lib.validate(config)


def lmzoo_parts(config, repeats: int) -> dict[str, tuple[float, float]]:
    """(min, median) ms of the jitted phases (rollout, scoring, update: what the training loop times) and the whole
    step of configs/hh_ppo.py's trainer."""
    objective = objectives.build(config)
    trainer = objective.trainer(objective.model())
    s = trainer.settings
    state = jax.jit(trainer.init)(jax.random.key(0))
    prompts = jax.random.randint(jax.random.key(1), (config.train.batch_size, s.prompt_len), 0, 256)
    batch = {"prompts": prompts, "prompt_mask": jnp.ones_like(prompts)}
    if s.ptx_coef > 0:
        tokens = jax.random.randint(jax.random.key(3), (s.ptx_batch_size, config.data.seq_len + 1), 0, 256)
        rows = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "weights": jnp.ones(tokens[:, 1:].shape),
            "segment_ids": jnp.ones_like(tokens[:, 1:]),
            "positions": jnp.broadcast_to(jnp.arange(tokens.shape[1] - 1), tokens[:, 1:].shape),
        }
        batch |= {"ptx_" + k: v for k, v in rows.items()}
    phase = {name: jax.jit(functools.partial(trainer.run_phase, name)) for name in trainer.phases}
    samples = phase["rollout"](state, batch, None)
    targets = phase["scoring"](state, batch, samples)
    step = jax.jit(lambda st: trainer.step(st, batch)[0])
    return common.interleaved_ms(
        {
            "rollout": (lambda st: phase["rollout"](st, batch, None), state),
            "scoring": (lambda st: phase["scoring"](st, batch, samples), state),
            "update": (lambda st: phase["update"](st, batch, targets)[0], state),
            "step": (step, state),
        },
        repeats,
    )


def trl_iterations(config, iterations: int) -> dict[str, list[float]]:
    """Seconds per iteration of trl's RLOOTrainer (`--variant rloo`) or GRPOTrainer (configs/hh_ppo.py:grpo) on the
    shapes of `config`: total, and its rollout (`transformers.generate`), scoring (the rest of generating and scoring)
    and update, from trl's own profiling hooks. The first iteration (warm-up) is dropped."""
    import datasets
    import torch
    import transformers
    import trl
    from trl.extras import profiling

    torch.set_num_threads(os.cpu_count())
    s = objectives.build(config).fields
    tokenizer = common.hf_byte_tokenizer()
    gpt2 = common.hf_gpt2_config(config.model)
    torch.manual_seed(0)
    workdir, policy_dir = common.trl_policy(f"trl_{s.algorithm}_", gpt2, tokenizer)
    gpt2.num_labels = 1
    reward_model = transformers.GPT2ForSequenceClassification(gpt2)
    rng = np.random.default_rng(0)
    prompts = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz "), s.prompt_len)) for _ in range(256)]
    updates = s.epochs * s.minibatches
    rows = config.train.batch_size * s.samples_per_prompt
    Config, Trainer = (trl.GRPOConfig, trl.GRPOTrainer) if s.algorithm == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    args = Config(
        output_dir=workdir,
        **common.TRL_ON_CPU,
        per_device_train_batch_size=rows // s.minibatches,
        steps_per_generation=s.minibatches,
        num_iterations=s.epochs,
        num_generations=s.samples_per_prompt,
        max_completion_length=s.response_len,
        temperature=s.temperature,
        learning_rate=config.optim.learning_rate,
        max_grad_norm=config.optim.grad_clip,
        beta=s.kl_coef,
        max_steps=updates * (iterations + 1),
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=policy_dir,
        reward_funcs=reward_model,
        args=args,
        processing_class=tokenizer,
        reward_processing_classes=tokenizer,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
    )
    events = []  # (name, seconds) from trl's profiling contexts, in order
    step_ends = [time.perf_counter()]

    def record(context, duration):
        events.append((context.name.split(".", 1)[1], duration))

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            step_ends.append(time.perf_counter())

    profiling.ProfilingContext._log_metrics = record
    trainer.add_callback(StepTimes())
    step_ends[0] = time.perf_counter()
    trainer.train()
    generate = [d for name, d in events if name == "transformers.generate"]
    prepare = [d for name, d in events if name == "_prepare_inputs"]
    totals = [step_ends[(i + 1) * updates] - step_ends[i * updates] for i in range(iterations + 1)]
    prepared = [sum(prepare[i * updates : (i + 1) * updates]) for i in range(iterations + 1)]
    return {
        "rollout": generate[1:],
        "scoring": [p - g for p, g in zip(prepared[1:], generate[1:], strict=True)],
        "update": [t - p for t, p in zip(totals[1:], prepared[1:], strict=True)],
        "step": totals[1:],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the 1-layer model of configs/hh_ppo.py:tiny")
    parser.add_argument("--variant", choices=VARIANTS, default="ppo", help="configs/hh_ppo.py's variant")
    parser.add_argument("--ptx_coef", type=float, default=0.0, help="PPO-ptx on ptx_batch_size random rows")
    parser.add_argument(
        "--trl", action="store_true", help="also time trl's RLOOTrainer / GRPOTrainer (--variant rloo / grpo)"
    )
    args = parser.parse_args()
    if args.trl and args.variant not in TRL_VARIANTS:
        parser.error(
            "--trl compares trl's RLOOTrainer or GRPOTrainer (trl has no PPOTrainer any more): use --variant rloo or grpo"
        )
    config = hh_ppo_config(args.variant, args.tiny, args.ptx_coef)
    s = objectives.build(config).fields
    common.announce("ppo", args.variant, f"emb_dim {config.model.emb_dim}, {config.model.num_layers} layers", 1)
    print("f32 matmul peak (GFLOP/s): " + ", ".join(f"{n}: {g:.0f}" for n, g in common.matmul_peak().items()))
    rows = config.train.batch_size * s.samples_per_prompt
    print(
        f"rollout {config.train.batch_size} prompts x {s.samples_per_prompt} samples = {rows} x ({s.prompt_len} + "
        f"{s.response_len}) tokens, {s.epochs} epochs x {s.minibatches} minibatches; value_model {s.value_model}, "
        f"ptx_coef {s.ptx_coef} ({s.ptx_batch_size} x {config.data.seq_len} rows)"
    )
    columns = {"lmzoo": {name: ms[1] for name, ms in lmzoo_parts(config, args.repeats).items()}}
    if args.trl:
        import trl

        seconds = trl_iterations(config, args.repeats)
        columns[f"trl {trl.__version__}"] = {name: 1e3 * statistics.median(v) for name, v in seconds.items()}
    print(f"median ms per iteration; load average now {os.getloadavg()[0]:.2f}")
    print(f"{'part':18s}" + "".join(f"{name:>14s}" for name in columns))
    for part in ("rollout", "scoring", "update", "step"):
        label = "whole iteration" if part == "step" else part
        print(f"{label:18s}" + "".join(f"{column[part]:14.1f}" for column in columns.values()))
    print(
        f"{'sum of the parts':18s}"
        + "".join(f"{sum(c[p] for p in ('rollout', 'scoring', 'update')):14.1f}" for c in columns.values())
    )


if __name__ == "__main__":
    main()
