"""The TPU attention form: Pallas' splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`).

Splash attention reads the mask as what it is made of, segment ids and a causal flag, and skips the blocks of keys
no query of a block sees, instead of reading a dense [B, 1, T, S] mask. `lmzoo.kernels.attention_form` chooses it on
TPUs where it computes the same function as the dense mask; elsewhere (the CPU, in tests) it runs in Pallas'
interpret mode, which is how the tests check it without a TPU.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

BLOCK = 128  # the smallest block: splash's key blocks are computed in multiples of the TPU's 128 lanes
BLOCKS = (512, 256, BLOCK)  # the largest that divides the sequence is taken: fewer, larger tiles (MaxText's is 512)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    segment_ids: jax.Array | None,
    causal: bool,
    scale: float | None,
) -> jax.Array:
    """q [B, T, N, H], k/v [B, T, K, H] (K divides N: grouped-query attention when K < N) -> [B, T, N, H].

    Self-attention over whole sequences, T a multiple of BLOCK. segment_ids [B, T] (0 = padding) or None: a query
    sees the keys of its segment (and, if causal, not after it). Rows of a padding query differ from
    `layers.attention.attention_mask`'s: here it attends to the padding keys before it, there to every non-padding
    key of its row; no other query sees a padding key in either, so every other row is the same.

    Under a mesh each device runs the kernel on its rows and heads (XLA cannot partition a Mosaic kernel): the batch
    and heads are split as the logical axes act_batch and act_heads are, kv heads as the query heads.
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    attend = functools.partial(_splash_attention, causal=causal, scale=scale)
    if jax.sharding.get_abstract_mesh().empty:
        return attend(query, key, value, segment_ids)
    batch_axes, _, head_axes, _ = nn.logical_to_mesh_axes(("act_batch", "act_len", "act_heads", "act_kv"))
    spec = PartitionSpec(batch_axes, None, head_axes, None)
    ids_spec = None if segment_ids is None else PartitionSpec(batch_axes, None)
    # check_vma off: the kernel's output declares no variation over mesh axes for shard_map to check.
    sharded = jax.shard_map(attend, in_specs=(spec, spec, spec, ids_spec), out_specs=spec, check_vma=False)
    return sharded(query, key, value, segment_ids)


def _splash_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array | None, *, causal: bool, scale: float
) -> jax.Array:
    """One device's `dot_product_attention`: q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H]."""
    # Imported where used: Pallas' TPU kernels take ~0.09 s to import, which every process would pay at start.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    length, heads = query.shape[1], query.shape[2]
    block = next(b for b in BLOCKS if length % b == 0)
    blocks = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    head_mask = splash_mask.CausalMask((length, length)) if causal else splash_mask.FullMask((length, length))
    kernel = splash.make_splash_mha(
        splash_mask.MultiHeadMask([head_mask] * heads),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        interpret=jax.default_backend() != "tpu",  # the CPU runs the kernel in Pallas' interpreter
    )
    # The kernel takes one sequence, heads first, and its queries already scaled; query head n reads kv head
    # n // (N // K), as grouped-query attention does.
    query, key, value = (jnp.swapaxes(a, 1, 2) for a in (query * scale, key, value))  # [B, N|K, T, H]
    if segment_ids is None:
        out = jax.vmap(kernel)(query, key, value)
    else:
        ids = splash.SegmentIds(q=segment_ids, kv=segment_ids)
        out = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids))(query, key, value, ids)
    return jnp.swapaxes(out, 1, 2)  # [B, T, N, H]
