"""Device meshes and the logical-axis rules table: the only place mesh axes are named.

Modules name every parameter and activation dimension with a logical axis (`embed`, `mlp`,
`act_batch`, ...). `LOGICAL_AXIS_RULES` maps each logical name to a mesh axis of the
(`data`, `fsdp`, `expert`, `tensor`) mesh, so data parallelism, FSDP, expert parallelism and tensor parallelism
are chosen by the mesh shape alone. A config may override single rules (`config.sharding.rules`).

The expert axis shards the experts of mixture-of-experts layers ("exp"). The batch is split over it too, as over
data and fsdp (as MaxText does): outside the experts its devices are data-parallel, and the capacity form moves
each expert's tokens to its devices with an all-to-all (`layers.mlp.capacity_experts`). A mesh shape of 3 sizes
(data, fsdp, tensor), as every config and saved run before the expert axis has, means expert 1 (`mesh_shape`).
"""

import glob
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical name -> mesh axis (or tuple of axes, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    # Parameters.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", None),  # grouped-query kv heads: often fewer than the tensor axis, so replicated
    ("kv", None),
    ("mlp", "tensor"),
    ("exp", "expert"),
    ("layers", None),
    ("position", None),
    ("norm", None),
    ("classes", None),
    ("relpos_buckets", None),
    # Activations.
    ("act_batch", ("data", "fsdp", "expert")),
    ("act_batch_no_exp", ("data", "fsdp")),  # the batch axis of a tensor whose experts axis takes the expert axis
    ("act_exp", "expert"),
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


def mesh_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """`shape` with one size per axis of MESH_AXES: a (data, fsdp, tensor) shape, as configs and runs saved before
    the expert axis have, gets expert 1; a shape of 4 sizes is returned as it is."""
    shape = tuple(shape)
    if len(shape) == 3:
        return shape[:2] + (1,) + shape[2:]
    if len(shape) != len(MESH_AXES):
        raise ValueError(f"mesh shape {shape} must have one size per axis {MESH_AXES} (or 3: data, fsdp, tensor)")
    return shape


def resolve_mesh_shape(shape: Sequence[int], device_count: int) -> tuple[int, ...]:
    """`shape` (3 or 4 sizes: `mesh_shape`) as one size per axis of MESH_AXES over `device_count` devices, its -1
    taking the devices the other sizes leave; ValueError when they do not fit."""
    given = tuple(shape)  # as the config wrote it, for the messages
    sizes = list(mesh_shape(given))
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh shape {given} may contain at most one -1")
    if any(size < 1 and size != -1 for size in sizes):
        raise ValueError(f"mesh shape {given}: each size must be >= 1 (one may be -1: the remaining devices)")
    if -1 in sizes:
        known = int(np.prod([s for s in sizes if s != -1]))
        if device_count % known:
            raise ValueError(f"mesh shape {given}: {device_count} devices are not divisible by {known}")
        sizes[sizes.index(-1)] = device_count // known
    if int(np.prod(sizes)) != device_count:
        raise ValueError(
            f"mesh shape {given} needs {int(np.prod(sizes))} devices but {device_count} are available; "
            "use -1 for one axis to fill the rest"
        )
    return tuple(sizes)


def make_mesh(shape: Sequence[int] = (-1, 1, 1, 1), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh of `shape` (3 sizes: expert 1, `mesh_shape`); one -1 entry takes all
    remaining devices.

    Uses Auto axis types: linen's logical constraints are hints, not asserts, under such a mesh.
    """
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(np.asarray(devices).reshape(resolve_mesh_shape(shape, len(devices))), MESH_AXES)


def abstract_mesh(sizes: Sequence[int]) -> AbstractMesh:
    """The (data, fsdp, expert, tensor) mesh of `sizes` without devices: a model traced under it
    (`jax.sharding.use_abstract_mesh`) sees the sizes a run on such devices sees, on any machine."""
    return AbstractMesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def split_problems(boxed: Any, rules: Sequence[tuple[str, Any]], sizes: Sequence[int]) -> dict[str, str]:
    """The logical axes of the boxed abstract tree `boxed` (a state traced with its logical names) that the mesh axes
    `rules` map them to, of `sizes` (data, fsdp, expert, tensor), do not divide, each with the first such dimension:
    {"vocab": "'vocab' of size 258 (params/wte/embedding) over tensor=4"}. A parameter split so cannot be placed."""
    size_of = dict(zip(MESH_AXES, sizes, strict=True))
    found: dict[str, str] = {}
    leaves = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    for path, leaf in leaves:
        if not isinstance(leaf, nn.LogicallyPartitioned):
            continue
        mesh_axes = nn.logical_to_mesh_axes(leaf.names, rules)
        # strict=False: dimensions past the names are replicated, as a shorter PartitionSpec leaves them
        for name, axes, length in zip(leaf.names, mesh_axes, leaf.value.shape, strict=False):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            if name in found or length % int(np.prod([size_of[axis] for axis in axes])) == 0:
                continue
            where = "/".join(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path)
            over = " x ".join(f"{axis}={size_of[axis]}" for axis in axes)
            found[name] = f"{name!r} of size {length} ({where}) over {over}"
    return found


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding hint for an activation by logical names; a no-op outside a mesh context."""
    return nn.with_logical_constraint(x, tuple(names))


def logical_axis_size(name: str) -> int:
    """How many shards the logical axis `name` has: the product of the sizes of the mesh axes it maps to under the
    rules in context (`nn.logical_axis_rules`) in the mesh in context; 1 outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    (axes,) = nn.logical_to_mesh_axes((name,))
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[axis] for axis in axes]))


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


# Device files an accelerator's driver creates: NVIDIA GPUs; TPU v4+ (accel) and v2/v3 VMs (vfio).
ACCELERATOR_DEVICE_FILES = {
    "an NVIDIA GPU": "/dev/nvidia[0-9]*",
    "a TPU": "/dev/accel[0-9]*",
    "a TPU (vfio)": "/dev/vfio/[0-9]*",
}
INSTALL_FILES = {
    "an NVIDIA GPU": "requirements-cuda12.txt",
    "a TPU": "requirements-tpu.txt",
    "a TPU (vfio)": "requirements-tpu.txt",
}


def unused_accelerator_warning() -> str | None:
    """A warning when this machine has an accelerator (its driver's device files are present) but JAX runs on the
    CPU, as it does with the CPU-only jaxlib of requirements.txt; None otherwise."""
    if jax.default_backend() != "cpu":
        return None
    for name, pattern in ACCELERATOR_DEVICE_FILES.items():
        if glob.glob(pattern):
            return (
                f"warning: this machine has {name} ({pattern}) but JAX runs on the CPU: install JAX for it with "
                f"`pip install -r {INSTALL_FILES[name]}` (README: Install)"
            )
    return None
