"""Transformer blocks and how they are stacked: `TransformerBlock` and `BlockStack`."""

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import kernels, sharding
from lmzoo.layers.adapters import merge_attached
from lmzoo.layers.attention import Attention, AttentionConfig
from lmzoo.layers.mlp import MOE_COLLECTION, MlpBlock, MoeBlock, MoeConfig
from lmzoo.layers.norms import LayerNorm


class TransformerBlock(nn.Module):
    """Self-attention (+ cross-attention) + MLP with residuals; pre-norm (GPT-2, T5) or post-norm (GPT,
    BERT, BART). [B, T, D] -> [B, T, D].

    Attributes:
        causal: decoder self-attention.
        cross_attention: attend to `context` (encoder-decoder decoders).
        pre_norm: x + f(N(x)) if True, else N(x + f(x)).
        sandwich_norms: pre-norm with each sublayer's output normalised too, x + N'(f(N(x))) (Gemma 2 and 3:
            "ln_attn_out", "ln_mlp_out" beside "ln_attn", "ln_mlp").
        norm: "layer" (LayerNorm) or "rms" (T5: no mean, no bias).
        activations: of the MLP; two give a gated unit (T5 v1.1 gated GELU).
        use_bias: biases of the MLP and the norms (the attention's are in `attention`).
        residual_init_std: std of the output projections (GPT-2 scales it by 1/sqrt(2 L)).
        fan_in_init: T5's initialisation instead of init_std / residual_init_std: every kernel normal with
            std fan_in ** -0.5, queries (D H) ** -0.5 (T5 leaves the 1/sqrt(H) logit scale to the init).
        attention: the self-attention's fields; cross-attention uses the same heads
            (`AttentionConfig.for_cross_attention`).
        moe: with it, the MLP is a mixture of experts (`MoeBlock`, gated SiLU experts; `mlp_dim` and `activations`
            are then unused); None: an `MlpBlock`, with the parameter tree of every dense model.
    """

    attention: AttentionConfig
    mlp_dim: int
    causal: bool = False
    cross_attention: bool = False
    pre_norm: bool = True
    sandwich_norms: bool = False
    norm: str = "layer"
    activations: Sequence[str] = ("gelu",)
    use_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    dropout_rate: float = 0.0
    init_std: float = 0.02
    residual_init_std: float = 0.02
    fan_in_init: bool = False
    moe: MoeConfig | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array | None = None,
        bias: jax.Array | None = None,
        context: jax.Array | None = None,
        context_segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        *,
        deterministic: bool,
        decode: bool = False,
        sliding_window: int | jax.Array | None = None,
        rotary_frequencies: np.ndarray | jax.Array | None = None,
    ) -> jax.Array:
        """x [B, T, D]; bias [1|B, N, T, T] added to self-attention logits (T5 relative positions);
        context [B, S, D] with context_segment_ids [B, S] for cross-attention (decode steps after the first
        may pass context None: its keys/values are cached); positions [B, T] for rotary embeddings and the
        sliding window. sliding_window and rotary_frequencies [H / 2]: this layer's, where the layers of a stack
        differ (`Attention`'s call)."""
        if self.norm not in ("layer", "rms"):
            raise ValueError(f"unknown norm {self.norm!r}; choose 'layer' or 'rms'")
        if self.sandwich_norms and not self.pre_norm:
            raise ValueError("sandwich_norms normalise the sublayers of a pre-norm block; set pre_norm=True")
        rms = self.norm == "rms"
        norm = functools.partial(
            LayerNorm,
            epsilon=self.layer_norm_epsilon,
            use_bias=self.use_bias and not rms,
            use_mean=not rms,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        head_dim = self.attention.head_dim
        d, heads_width = x.shape[-1], self.attention.num_heads * head_dim
        if self.fan_in_init:
            std = {
                "kernel": d**-0.5,
                "query": (d * head_dim) ** -0.5,
                "attn_out": heads_width**-0.5,
                "mlp_out": (self.mlp_dim if self.moe is None else self.moe.expert_mlp_dim) ** -0.5,
            }
        else:
            std = {
                "kernel": self.init_std,
                "query": self.init_std,
                "attn_out": self.residual_init_std,
                "mlp_out": self.residual_init_std,
            }
        normal = nn.initializers.normal
        make_attention = functools.partial(
            Attention,
            kernel_init=normal(std["kernel"]),
            query_init=normal(std["query"]),
            out_init=normal(std["attn_out"]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        if self.moe is None:
            mlp = MlpBlock(
                mlp_dim=self.mlp_dim,
                activations=tuple(self.activations),
                use_bias=self.use_bias,
                kernel_init=normal(std["kernel"]),
                out_init=normal(std["mlp_out"]),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="mlp",
            )
        else:
            mlp = MoeBlock(
                self.moe,
                kernel_init=normal(std["kernel"]),
                out_init=normal(std["mlp_out"]),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="mlp",
            )
        dropout = nn.Dropout(self.dropout_rate)

        def residual(x, norm_name, fn):
            if not self.pre_norm:
                return norm(name=norm_name)(x + dropout(fn(x), deterministic=deterministic))
            h = fn(norm(name=norm_name)(x))
            if self.sandwich_norms:
                h = norm(name=f"{norm_name}_out")(h)
            return x + dropout(h, deterministic=deterministic)

        x = sharding.constrain(x, ("act_batch", "act_len", "act_embed"))
        self_attention = make_attention(self.attention, causal=self.causal, name="attn")
        x = residual(
            x,
            "ln_attn",
            lambda h: self_attention(
                h,
                segment_ids=segment_ids,
                bias=bias,
                positions=positions,
                deterministic=deterministic,
                decode=decode,
                sliding_window=sliding_window,
                rotary_frequencies=rotary_frequencies,
            ),
        )
        if self.cross_attention:
            cross = make_attention(self.attention.for_cross_attention(), cross=True, name="cross_attn")
            x = residual(
                x,
                "ln_cross",
                lambda h: cross(
                    h,
                    context,
                    segment_ids=segment_ids,
                    context_segment_ids=context_segment_ids,
                    deterministic=deterministic,
                    decode=decode,
                ),
            )
        return residual(x, "ln_mlp", lambda h: mlp(h, deterministic=deterministic))


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
SCANNED = "layers"  # the scanned stack's module name: its params are stacked on a leading "layers" axis
SHARED = "shared"  # the one layer of a stack whose params are shared (ALBERT)
LOOPED = "layer_"  # + i: the i-th layer of a stack looped in Python


def is_layer(name: str) -> bool:
    """Whether a module named `name` is a BlockStack's layer: the scanned stack, a looped `layer_{i}`, or the shared
    one (ALBERT)."""
    return name in (SCANNED, SHARED) or (name.startswith(LOOPED) and name[len(LOOPED) :].isdigit())


def _merge_attached_params(variables: dict) -> dict:
    """`nn.map_variables`' view of one layer's params: attached adapters merged (`adapters.merge_attached`)."""
    return {**variables, "params": merge_attached(variables["params"])}


class BlockStack(nn.Module):
    """`num_layers` copies of `block`, looped in Python or with `nn.scan`, optionally rematerialised.

    The block is called as `block(x, *args, deterministic=..., decode=..., **layer_i)` and returns x, layer_i
    holding layer i's value of each `per_layer` keyword. With `scan`, parameters gain a leading "layers" axis and
    compile time no longer grows with depth, and so do the KV cache and what the blocks sow into `MOE_COLLECTION`;
    the `per_layer` values are the scan's inputs, so layers that differ only in them (Gemma 3's sliding and global
    attention, 5:1) still compile as one body. A scanned layer's kernels may carry low-rank adapters
    (`layers.adapters`, LoRA's training form): those its projections do not apply at their inputs (experts' weights)
    each layer merges inside the (rematerialised) scan body, so a merged kernel and its gradient live for one layer
    at a time.
    With `share_params` (ALBERT) one block's parameters are applied num_layers times.

    Attributes:
        block: a module instance used as a template (cloned per layer).
        remat_policy: one of REMAT_POLICIES ("none" keeps every activation), or "auto": the platform's
            (`kernels.remat_policy`).
        per_layer: keyword -> num_layers values (numbers or equal-shaped numpy arrays) of the block's call, one per
            layer: a looped layer gets its own as a Python value (static, as a config field), a scanned stack gets
            them stacked [L, ...] and each layer its traced slice.
    """

    block: nn.Module
    num_layers: int
    scan: bool = False
    remat_policy: str = "none"
    share_params: bool = False
    per_layer: Mapping[str, Sequence[Any]] | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any, deterministic: bool, decode: bool = False) -> jax.Array:
        policy = kernels.remat_policy(self.remat_policy)
        if policy not in REMAT_POLICIES:
            raise ValueError(
                f"unknown remat_policy {self.remat_policy!r}; choose one of {sorted(REMAT_POLICIES)} or 'auto'"
            )
        block_cls = type(self.block)
        attrs = {f.name: getattr(self.block, f.name) for f in self.block.__dataclass_fields__.values() if f.init}
        attrs.pop("parent", None)
        attrs.pop("name", None)

        per_layer = dict(self.per_layer or {})
        wrong = {name: len(values) for name, values in per_layer.items() if len(values) != self.num_layers}
        if wrong:
            raise ValueError(f"per_layer values {wrong} must number num_layers={self.num_layers} each")

        def layer_body(layer: Mapping[str, Any]):
            """The call of a layer with its `per_layer` values (closed over: a looped layer's stay static)."""

            def apply(module, carry, *call_args):
                return module(carry, *call_args, deterministic=deterministic, decode=decode, **layer)

            return nn.remat(apply, policy=REMAT_POLICIES[policy]) if policy != "none" else apply

        if self.share_params or not self.scan:
            shared = block_cls(**attrs, name=SHARED) if self.share_params else None
            for i in range(self.num_layers):
                layer = {name: values[i] for name, values in per_layer.items()}
                module = shared if self.share_params else block_cls(**attrs, name=f"{LOOPED}{i}")
                x = layer_body(layer)(module, x, *args)
            return x

        def scan_body(module, carry, layer):
            return layer_body(layer)(module, carry, *args), None

        # Params are created as they are (initialising) and read through the merge of attached adapters (applying).
        layer_cls = (
            block_cls
            if self.is_initializing()
            else nn.map_variables(block_cls, "params", trans_in_fn=_merge_attached_params)
        )
        scanned = nn.scan(
            scan_body,
            variable_axes={"params": 0, "cache": 0, MOE_COLLECTION: 0},
            split_rngs={"params": True, "dropout": True},
            length=self.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        stacked = {name: jnp.asarray(np.stack(values)) for name, values in per_layer.items()}  # [L, ...] each
        x, _ = scanned(layer_cls(**attrs, name=SCANNED), x, stacked)
        return x
