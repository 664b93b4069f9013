"""Subprocess entry point of the scale-out tests: tiny runs on N simulated CPU devices.

    python tests/scaleout/run_config.py DEVICES '[{"workdir": ..., "train": {...}, "mesh": [...], "npz": ...}, ...]'

Per job: with "train" (dotted config overrides of configs/default.py:tiny), train in `workdir`;
then restore its latest checkpoint the way a resumed run does, onto "mesh" (default: the saved
config's), write the params to "npz" if given, with "sample" write `sample_from_checkpoint` of the
sharded (never gathered) params there, and print one JSON line {"step", "param_bytes", "param_bytes_device0"}.
"""

import importlib.util
import json
import pathlib
import sys

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tiny_config(overrides: dict):
    spec = importlib.util.spec_from_file_location("default_config", ROOT / "configs" / "default.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for name in parents:
            node = node[name]
        node[leaf] = tuple(value) if isinstance(value, list) else value
    return config


def sample_from_checkpoint(run, params) -> dict[str, np.ndarray]:
    """`decoding.sample` in the run's mesh on its params as they are sharded: 4 left-padded prompts, 8 new tokens."""
    from lmzoo import decoding

    prompts = np.array([[0, 0, 5, 6], [7, 8, 9, 10], [0, 11, 12, 13], [14, 15, 16, 17]], np.int32)
    with run.context():
        samples = decoding.sample(
            run.model,
            params,
            prompts,
            (prompts != 0).astype(np.int32),
            jax.random.key(3),
            max_new_tokens=8,
            temperature=1.0,
            top_k=20,
        )
    return {"tokens": np.asarray(samples.tokens), "log_probs": np.asarray(samples.log_probs)}


def main(devices: int, jobs: list[dict]) -> None:
    jax.config.update("jax_num_cpu_devices", devices)
    from lmzoo.train import loop
    from lmzoo.train import run as run_lib

    for job in jobs:
        if "train" in job:
            loop.train_and_evaluate(tiny_config(job["train"]), job["workdir"])
        config = run_lib.load_saved(job["workdir"])
        if "mesh" in job:
            config.sharding.mesh_shape = tuple(job["mesh"])
        run = run_lib.build(config, job["workdir"])
        state, data_state = run_lib.restore_or_init(run)
        run.close()
        leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
        device0 = jax.devices()[0]
        print(
            json.dumps(
                {
                    "step": data_state["step"],
                    "param_bytes": sum(x.nbytes for _, x in leaves),
                    "param_bytes_device0": sum(
                        s.data.nbytes for _, x in leaves for s in x.addressable_shards if s.device == device0
                    ),
                }
            )
        )
        if "sample" in job:
            np.savez(job["sample"], **sample_from_checkpoint(run, state.params))
        if "npz" in job:
            np.savez(job["npz"], **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
