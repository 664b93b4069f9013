"""The platform seam: which form of a building block runs, chosen in one place from the mesh's platform.

`lmzoo.layers` holds the plain forms (what runs on GPUs and TPUs); `kernels.cpu` the forms XLA:CPU runs
faster (and JAX's random hash lowered unrolled on the CPU, set on import: the same bits); `kernels.explicit` the
attention form with materialised probabilities and `kernels.tpu` Pallas' splash attention (`attention_form` says where
each runs); `kernels.host_memory` the glibc settings of a process running XLA:CPU programs or reading a checkpoint. The
platform is that of the mesh a program is traced under (`jax.set_mesh`, as every compiled trainer is), else JAX's
default backend; `use_platform` overrides it (tests run the accelerator forms on the CPU with it).
"""

import contextlib
import threading

import jax
import jax.numpy as jnp

from lmzoo import sharding
from lmzoo.kernels import cpu, tpu

cpu.lower_threefry_unrolled()  # the same random bits, several times faster on XLA:CPU

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


def remat_policy(name: str) -> str:
    """The rematerialisation a layer stack applies for `config.model.remat_policy` `name`: "auto" (what the base-size
    configs set) is "none" on the CPU, whose memory (the host's) is seldom what limits a run, so recomputing in the
    backward pass would cost step and compile time for nothing, and "dots_no_batch" on GPUs and TPUs, where the
    activations fill the device: each layer keeps its projections' outputs and recomputes the rest (norms,
    activations, attention). Any other name is returned as it is."""
    if name != "auto":
        return name
    return "none" if on_cpu() else "dots_no_batch"


def head_chunk_bytes() -> int:
    """Budget of one chunk of float32 logits in the fused LM head (`objectives.losses.fused_head_loss`): small on
    the CPU, where a chunk that stays in the last-level cache is fastest; on GPUs 2 GiB, where fewer, larger head
    matmuls win (GPT-2's microbatch of 12 x 1,024 positions takes 2 chunks, not 10 of 256 MiB) and memory is ample;
    256 MiB on TPUs, whose memory is smaller (GPT-2's real shape, batch 8, takes 8 chunks of 128 positions)."""
    return {"cpu": 16 << 20, "gpu": 2 << 30}.get(platform(), 256 << 20)


def attention_form(
    query: jax.Array,
    key: jax.Array,
    *,
    mask: jax.Array | None,
    bias: jax.Array | None,
    dropout: bool,
    segment_ids: jax.Array | None = None,
    sinks: bool = False,
) -> str:
    """Which form computes `layers.attention.dot_product_attention` for query [B, T, N, H], keys [B, S, K, H]:

    - "explicit" (`kernels.explicit`): on the CPU, wherever attention dropout needs the probabilities, and with
      attention sinks (`sinks`: a logit per head joined to the softmax, which the fused forms have no place for);
    - "cudnn": cuDNN's fused flash attention on GPUs where it applies (bf16/fp16, head size a multiple of 8 up to
      128, no additive bias, and a boolean mask [B, 1, T, S] only over a whole sequence: packed documents,
      padding (a decoding step attends to the cache in `layers.attention.cached_attention`, never here));
    - "splash" (`kernels.tpu`): Pallas' splash attention on TPUs over a whole sequence (T == S, a multiple of
      `tpu.BLOCK`) with no additive bias and no mask beyond the causal flag and `segment_ids` [B, T], which the
      caller passes only when `mask` is exactly theirs (no sliding window; a decoding step's mask over the cache
      is not); the batch and heads must split evenly over the mesh, kv heads as the query heads, and the
      sequence not at all;
    - "xla": `jax.nn.dot_product_attention`'s XLA form.
    """
    if on_cpu() or dropout or sinks:
        return "explicit"
    if platform() == "tpu":
        head_shards = sharding.logical_axis_size("act_heads")
        splash = (
            query.shape[1] == key.shape[1]
            and query.shape[1] % tpu.BLOCK == 0
            and bias is None
            and (mask is None or segment_ids is not None)
            and query.shape[0] % sharding.logical_axis_size("act_batch") == 0
            and query.shape[2] % head_shards == 0
            and key.shape[2] % head_shards == 0
            and sharding.logical_axis_size("act_len") == 1
        )
        return "splash" if splash else "xla"
    fused = (
        platform() == "gpu"
        and jax.default_backend() == "gpu"  # the GPU forms traced on a CPU (tests) have no cuDNN to call
        and (mask is None or query.shape[1] == key.shape[1])
        and bias is None
        and query.dtype in (jnp.bfloat16, jnp.float16)
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 128
    )
    return "cudnn" if fused else "xla"
