"""Subprocess entry point of the sharded engine test: greedy replies of a tiny Llama (`build`) on 4 simulated CPU
devices, params sharded over a (data 2, tensor 2) mesh, printed as JSON with the lanes a 64-slot engine takes by
default on that mesh and with no mesh (4 devices listed, one used).

    python tests/serving/engine_devices.py '{"prompts": [[...], ...], "max_tokens": N}'
"""

import json
import sys

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 4)

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402

from lmzoo import models, sharding  # noqa: E402
from lmzoo.serving import engine  # noqa: E402

FIELDS = dict(vocab_size=64, max_len=32, emb_dim=32, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=48)


def build():
    """(model, boxed params, params): sharper than init's (x 8), so that replies differ between prompts."""
    model = models.build_model("llama", FIELDS)
    boxed = model.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
    return model, boxed, jax.tree.map(lambda x: x * 8.0, nn.unbox(boxed))


def main(job: dict) -> None:
    model, boxed, params = build()
    mesh = sharding.make_mesh((2, 1, 1, 2))
    rules = sharding.axis_rules()
    placed = jax.device_put(params, nn.unbox(sharding.logical_to_sharding(boxed, mesh, rules)))
    assert any(len(leaf.sharding.device_set) > 1 for leaf in jax.tree.leaves(placed))
    requests = [engine.Request(tuple(p), job["max_tokens"], 0.0) for p in job["prompts"]]
    sharded = engine.Engine(model, placed, slots=4, chunk=4, mesh=mesh, rules=rules).generate(requests)
    lanes = {"mesh": engine.default_lanes(64, mesh), "no_mesh": engine.default_lanes(64)}
    print(json.dumps({"replies": [t.outputs[0].tokens for t in sharded], "default_lanes": lanes}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
