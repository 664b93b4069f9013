"""Subprocess entry point of tests/scaleout/test_moe_scaleout.py: a tiny MoE Llama's loss, metrics and gradients on
each mesh shape, on 8 simulated CPU devices, from the same parameters and batch.

    python tests/scaleout/moe_mesh.py OUT.npz '[[8, 1, 1, 1], [1, 2, 2, 2], ...]'

Writes, per form ("dropless", "capacity") and mesh (data, fsdp, expert, tensor), "FORM/MESH/loss",
"FORM/MESH/metric/NAME" (sum / count), "FORM/MESH/grad/PATH" and "FORM/MESH/wi_0_shard" (the shape of device 0's
piece of layer 0's stacked wi_0 kernel), and "error", the message of a mesh whose expert axis (8) does not divide
num_experts (4).
"""

import json
import sys

import jax
import numpy as np

# Scanned, rematerialised layers; every mesh axis divides what it shards (heads, mlp, vocab, experts, batch).
FIELDS = dict(
    vocab_size=64,
    max_len=16,
    emb_dim=32,
    num_heads=4,
    num_kv_heads=2,
    num_layers=2,
    mlp_dim=32,
    num_experts=4,
    experts_per_token=2,
    capacity_factor=1.0,  # C = 8 of a row's 32 assignments: the capacity form drops some
    scan_layers=True,
    remat_policy="full",
)


def main(out: str, meshes: list[list[int]]) -> None:
    jax.config.update("jax_num_cpu_devices", 8)
    from flax import linen as nn

    from lmzoo import models, sharding
    from lmzoo.objectives import tasks

    tokens = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((8, 16), np.float32)}
    rules = sharding.axis_rules()
    results = {}
    for form in ("dropless", "capacity"):
        model = models.build_model("llama", {**FIELDS, "moe_form": form})
        task = tasks.causal_lm_task(model)

        def init():
            return model.init(jax.random.key(0), batch["inputs"])["params"]  # noqa: B023

        def loss_and_grads(params, batch):
            return jax.value_and_grad(task.loss, has_aux=True)(  # noqa: B023
                params, {}, None, batch, jax.random.key(1), step=0, train=True
            )

        params = jax.device_get(nn.unbox(init()))
        for shape in meshes:
            mesh = sharding.make_mesh(shape)
            with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
                shardings = sharding.logical_to_sharding(jax.eval_shape(init), mesh, rules)
                placed = jax.device_put(params, shardings)
                (value, (metrics, _)), grads = jax.jit(loss_and_grads)(
                    placed, sharding.put_batch(batch, sharding.batch_sharding(mesh, rules))
                )
            key = f"{form}/{','.join(map(str, shape))}"
            results[f"{key}/loss"] = np.asarray(value)
            results.update({f"{key}/metric/{k}": np.asarray(s / c) for k, (s, c) in metrics.items()})
            flat, _ = jax.tree_util.tree_flatten_with_path(grads)
            results.update({f"{key}/grad/{jax.tree_util.keystr(path)}": np.asarray(g) for path, g in flat})
            wi_0 = placed["blocks"]["layers"]["mlp"]["wi_0"]
            results[f"{key}/wi_0_shard"] = np.array(wi_0.addressable_shards[0].data.shape)
    model = models.build_model("llama", FIELDS)
    with jax.set_mesh(sharding.make_mesh((1, 1, 8, 1))), nn.logical_axis_rules(rules):
        try:
            jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"]))
            results["error"] = np.array("")
        except ValueError as e:
            results["error"] = np.array(str(e))
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
