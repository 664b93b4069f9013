"""Device meshes and the logical-axis rules table: the only place mesh axes are named.

Modules name every parameter and activation dimension with a logical axis (`embed`, `mlp`,
`act_batch`, ...). `LOGICAL_AXIS_RULES` maps each logical name to a mesh axis of the
(`data`, `fsdp`, `tensor`) mesh, so data parallelism, FSDP and tensor parallelism are chosen by
the mesh shape alone. A config may override single rules (`config.sharding.rules`).
"""

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axis (or tuple of axes, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    # Parameters.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", None),  # grouped-query kv heads: often fewer than the tensor axis, so replicated
    ("kv", None),
    ("mlp", "tensor"),
    ("layers", None),
    ("position", None),
    ("norm", None),
    ("classes", None),
    ("relpos_buckets", None),
    # Activations.
    ("act_batch", ("data", "fsdp")),
    ("act_len", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", None),
    ("act_kv", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def axis_rules(overrides: Sequence[tuple[str, Any]] = ()) -> tuple[tuple[str, Any], ...]:
    """The rules table with `overrides` replacing the entries of the same logical name."""
    known = {name for name, _ in LOGICAL_AXIS_RULES}
    for name, _ in overrides:
        if name not in known:
            raise ValueError(f"sharding rule override for unknown logical axis {name!r}; known axes: {sorted(known)}")
    replaced = dict(overrides)
    return tuple((name, replaced.get(name, axis)) for name, axis in LOGICAL_AXIS_RULES)


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Joins JAX's multi-controller runtime; must run before anything touches the devices.

    coordinator_address "" = single process; "auto" = let JAX detect the cluster (TPU pods,
    SLURM, ...); "host:port" with num_processes/process_id for explicit launches (GPU hosts, tests).
    """
    if not coordinator_address:
        return
    if coordinator_address == "auto":
        jax.distributed.initialize()
        return
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} must be in [0, num_processes={num_processes})")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh; one -1 entry takes all remaining devices.

    Uses Auto axis types: linen's logical constraints are hints, not asserts, under such a mesh.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != len(MESH_AXES):
        raise ValueError(f"mesh shape {shape} must have one entry per axis {MESH_AXES}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape} may contain at most one -1")
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        if len(devices) % known:
            raise ValueError(f"mesh shape {shape}: {len(devices)} devices are not divisible by {known}")
        shape[shape.index(-1)] = len(devices) // known
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh shape {tuple(shape)} needs {int(np.prod(shape))} devices but {len(devices)} are available; "
            "use -1 for one axis to fill the rest"
        )
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding hint for an activation by logical names; a no-op outside a mesh context."""
    return nn.with_logical_constraint(x, tuple(names))


def logical_to_sharding(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Any:
    """NamedShardings for a (possibly boxed) abstract pytree whose leaves carry logical names."""
    specs = nn.get_partition_spec(tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> NamedSharding:
    """Sharding of a [batch, ...] input array: the batch dimension over the data-parallel axes."""
    spec = nn.logical_to_mesh_axes(("act_batch",), rules)
    return NamedSharding(mesh, PartitionSpec(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Host-local numpy batch -> global arrays, each process supplying its rows of the batch."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
