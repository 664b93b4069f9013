"""Subprocess entry point of the scale-out tests: tiny runs on N simulated CPU devices.

    python tests/scaleout/run_config.py DEVICES '[{"workdir": ..., "train": {...}, "mesh": [...], "npz": ...}, ...]'

Per job: with "train" (dotted config overrides of configs/default.py:tiny), train in `workdir`;
then restore its latest checkpoint the way a resumed run does, onto "mesh" (default: the saved
config's), write the params to "npz" if given, and print one JSON line
{"step", "param_bytes", "param_bytes_device0"}.
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


def main(devices: int, jobs: list[dict]) -> None:
    jax.config.update("jax_num_cpu_devices", devices)
    from lmzoo import config as config_lib
    from lmzoo.train import loop

    for job in jobs:
        if "train" in job:
            loop.train_and_evaluate(tiny_config(job["train"]), job["workdir"])
        config = config_lib.load_saved(job["workdir"])
        if "mesh" in job:
            config.sharding.mesh_shape = tuple(job["mesh"])
        run = loop.build(config, job["workdir"])
        state, data_state = loop.restore_or_init(run)
        run.checkpointer.close()
        leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
        device0 = jax.devices()[0]
        print(json.dumps({
            "step": data_state["step"],
            "param_bytes": sum(x.nbytes for _, x in leaves),
            "param_bytes_device0": sum(s.data.nbytes for _, x in leaves for s in x.addressable_shards if s.device == device0),
        }))  # fmt: skip
        if "npz" in job:
            np.savez(job["npz"], **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
