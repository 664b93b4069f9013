"""Time of one PPO iteration on this CPU, split into rollout (KV-cache sampling), scoring (policy, reference and
reward-model forwards, shaped rewards, GAE) and update (epochs x minibatches of clipped PPO steps).

    PYTHONPATH=$PWD python bench/ppo_bench.py                 # the model and rollout sizes of configs/hh_ppo.py
    PYTHONPATH=$PWD python bench/ppo_bench.py --repeats 3 --tiny

Random weights (nothing is read); every part is jitted on its own and timed after warm-up, the parts in
alternating order (`common.interleaved_ms`). The whole jitted step (`PPOTrainer.step`) is timed too, so
the split can be checked against it. Numbers depend on the machine's load: print them with the CPU model.
"""

import argparse
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

from lmzoo import config as config_lib  # noqa: E402
from lmzoo import decoding, objectives  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def hh_ppo_config(tiny: bool):
    config = config_lib.load_config_file(ROOT / "configs" / "hh_ppo.py", "tiny" if tiny else None)
    config.objective.update(sft="ckpt:unused", reward_model="ckpt:unused")
    return config_lib.validate(config)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the 1-layer model of configs/hh_ppo.py:tiny")
    args = parser.parse_args()
    config = hh_ppo_config(args.tiny)
    objective = objectives.get("ppo")
    trainer = objective.trainer(config, objective.model(config))
    s = trainer.settings
    state = jax.jit(trainer.init)(jax.random.key(0))
    batch_size = config.train.batch_size
    batch = {
        "prompts": jax.random.randint(jax.random.key(1), (batch_size, s.prompt_len), 0, 256),
        "prompt_mask": jax.numpy.ones((batch_size, s.prompt_len), jax.numpy.int32),
    }
    key = jax.random.key(2)
    sample = jax.jit(lambda params: decoding.sample(trainer.decoder, params["decoder"], batch["prompts"], batch["prompt_mask"], key,
                                                    max_new_tokens=s.response_len, temperature=s.temperature,
                                                    eos_id=trainer.eos_id, pad_id=trainer.pad_id))  # fmt: skip
    rollout = jax.jit(
        lambda st: trainer.rollout(
            st.params, st.frozen, st.kl_coef, batch, key, samples_per_prompt=s.samples_per_prompt
        )[0]
    )
    fixed_rollout = rollout(state)
    update = jax.jit(lambda st: trainer.update(st.params, st.opt_state, fixed_rollout, key)[0])
    step = jax.jit(lambda st: trainer.step(st, batch)[0])
    times = common.interleaved_ms(
        {
            "sampling": (sample, state.params),
            "rollout": (rollout, state),
            "update": (update, state),
            "step": (step, state),
        },
        args.repeats,
    )
    model, isa = common.cpu_model_and_isa()
    rows = batch_size * s.samples_per_prompt
    print(f"CPU: {model} ({isa}), {jax.device_count()} device(s); rollout {rows} x ({s.prompt_len} + {s.response_len}) tokens, "
          f"{s.epochs} epochs x {s.minibatches} minibatches; emb_dim {config.model.emb_dim}, {config.model.num_layers} layers")  # fmt: skip
    sampling, scoring = times["sampling"][1], times["rollout"][1] - times["sampling"][1]
    print(f"{'part':10s} {'median ms':>10s} {'share':>7s}")
    for name, value in (("rollout", sampling), ("scoring", scoring), ("update", times["update"][1])):
        print(f"{name:10s} {value:10.1f} {value / times['step'][1]:7.1%}")
    print(f"{'step':10s} {times['step'][1]:10.1f}   (whole jitted iteration; min {times['step'][0]:.1f})")


if __name__ == "__main__":
    main()
