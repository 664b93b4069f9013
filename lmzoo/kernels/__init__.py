"""The platform seam: which form of a building block runs, chosen in one place from the mesh's platform.

`lmzoo.layers` holds the plain forms (what runs on GPUs and TPUs); `kernels.cpu` the forms XLA:CPU runs
faster; `kernels.host_memory` the glibc settings of a process running XLA:CPU programs. The platform is
that of the mesh a program is traced under (`jax.set_mesh`, as every compiled trainer is), else JAX's
default backend; `use_platform` overrides it (tests run the accelerator forms on the CPU with it).
"""

import contextlib
import threading

import jax

_override = threading.local()


def platform() -> str:
    """ "cpu", "gpu" or "tpu": the override, else the platform of the mesh in context, else JAX's default backend."""
    forced = getattr(_override, "platform", None)
    if forced is not None:
        return forced
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def on_cpu() -> bool:
    return platform() == "cpu"


@contextlib.contextmanager
def use_platform(name: str):
    """Traces the forms of platform `name` whatever the devices (e.g. the accelerator forms on the CPU)."""
    previous = getattr(_override, "platform", None)
    _override.platform = name
    try:
        yield
    finally:
        _override.platform = previous


def head_chunk_bytes() -> int:
    """Budget of one chunk of float32 logits in the fused LM head (`objectives.losses.fused_head_loss`): small on
    the CPU, where a chunk that stays in the last-level cache is fastest; on GPUs 2 GiB, where fewer, larger head
    matmuls win (GPT-2's microbatch of 12 x 1,024 positions takes 2 chunks, not 10 of 256 MiB) and memory is ample;
    256 MiB on TPUs, whose memory is smaller (GPT-2's real shape, batch 8, takes 8 chunks of 128 positions)."""
    return {"cpu": 16 << 20, "gpu": 2 << 30}.get(platform(), 256 << 20)
