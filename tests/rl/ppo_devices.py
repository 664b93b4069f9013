"""Subprocess entry point of the PPO device test: a tiny PPO run on N simulated CPU devices.

    python tests/rl/ppo_devices.py DEVICES '{"workdir", "data", "sft", "rm", "objective", "variant", "mesh", "steps", "npz"}'

Trains configs/hh_ppo.py:<variant> (with the config.objective overrides of "objective") on `mesh`, then writes the params, optimizer state, β and rng of
its final state to `npz`.
"""

import json
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def main(devices: int, job: dict) -> None:
    jax.config.update("jax_num_cpu_devices", devices)
    from test_alignment import ppo_config, state_arrays

    from lmzoo.train import loop
    from lmzoo.train import run as run_lib

    config = ppo_config(job["data"], job["sft"], job["rm"], job["objective"], job["variant"], steps=job["steps"])
    config.sharding.mesh_shape = tuple(job["mesh"])
    loop.train_and_evaluate(config, job["workdir"])
    run = run_lib.open_run(job["workdir"], mesh_shape=tuple(job["mesh"]))
    _, state = run_lib.restore_step(run, frozen=False)
    run.close()
    np.savez(job["npz"], **state_arrays(state))


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
