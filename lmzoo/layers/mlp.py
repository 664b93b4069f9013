"""Activations, the position-wise feed-forward block (`MlpBlock`) and the mixture-of-experts feed-forward
(`MoeFields`, `MoeConfig`, `MoeBlock`) with the same call: [B, T, D] -> [B, T, D].

Einsum letters besides the shared ones: E experts, R a token's routed choices (the router's top-k), C an expert's
capacity per sequence.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo import kernels, sharding
from lmzoo.kernels import cpu
from lmzoo.layers.linears import Einsum, Initializer


def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, x * Phi(x) (`kernels.cpu.gelu` on the CPU)."""
    if kernels.on_cpu():
        return cpu.gelu(x)
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "linear": lambda x: x,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MlpBlock(nn.Module):
    """Position-wise feed-forward, D -> F -> D. Several activations give a gated unit (T5 v1.1).

    Attributes:
        mlp_dim: F.
        activations: one name per input projection, multiplied together (("gelu", "linear") = GeGLU).
    """

    mlp_dim: int
    activations: Sequence[str] = ("gelu",)
    use_bias: bool = True
    dropout_rate: float = 0.0
    kernel_init: Initializer = nn.initializers.normal(0.02)
    out_init: Initializer = nn.initializers.normal(0.02)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool) -> jax.Array:
        """x: [B, T, D] -> [B, T, D]."""
        d = x.shape[-1]
        proj = functools.partial(Einsum, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype)
        h = None
        for i, name in enumerate(self.activations):
            wi_name = "wi" if len(self.activations) == 1 else f"wi_{i}"
            a = activation(name)(
                proj((d, self.mlp_dim), ("embed", "mlp"), kernel_init=self.kernel_init, name=wi_name)("BTD,DF->BTF", x)
            )
            h = a if h is None else h * a
        h = sharding.constrain(h, ("act_batch", "act_len", "act_mlp"))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        return proj((self.mlp_dim, d), ("mlp", "embed"), kernel_init=self.out_init, name="wo")("BTF,FD->BTD", h)


CORRECTION_BIAS = "correction_bias"  # the routing bias that load balancing sets (`balancing_signal`)
MOE_COLLECTION = "moe"  # the Flax collection `MoeBlock` sows its auxiliary losses and statistics into
MOE_FORMS = ("dropless", "capacity")


@dataclasses.dataclass(frozen=True)
class MoeFields:
    """The fields of a mixture-of-experts feed-forward, declared once: `MoeConfig`, what `MoeBlock` and the blocks
    that build it take, has them, and a family config that offers experts inherits them as `config.model` keys
    (Llama's), where num_experts 0 means a dense feed-forward and expert_mlp_dim 0 the model's mlp_dim.

    Attributes:
        num_experts: E.
        experts_per_token: R, the router's top-k (Mixtral 2).
        expert_mlp_dim: F of each expert.
        shared_expert_mlp_dim: F of a shared expert every token goes through, scaled by a sigmoid gate (Qwen2-MoE);
            0 = none.
        moe_form: "dropless" or "capacity" (`MoeBlock`).
        capacity_factor: the capacity form's slack: each expert takes ceil(capacity_factor * T * R / E) assignments
            of a sequence of T tokens (`capacity`).
        router_z_loss_coef: weight of the router z-loss, mean logsumexp(router logits)^2 (ST-MoE).
        load_balance_coef: weight of the load-balancing loss E * sum_e f_e P_e (Switch, Mixtral).
        renormalize_expert_weights: divide the top-R probabilities by their sum (Mixtral; Qwen2-MoE's
            norm_topk_prob), else use them as they are. With softmax scores this is the softmax of the top-R logits
            (gpt-oss's router).
        router_bias: a bias [E] on the router's logits ("router/bias"; gpt-oss).
        expert_bias: biases on each expert's projections, "wi_0_bias", "wi_1_bias" [E, F] and "wo_bias" [E, D]
            (gpt-oss).
        swiglu_limit: 0: the experts' unit is silu(gate) * up; > 0: gpt-oss's clamped SwiGLU, the gate clipped
            from above and up to [-limit, limit], then (up + 1) * gate * sigmoid(swiglu_alpha * gate)
            (`expert_unit`).
        swiglu_alpha: the sigmoid's gain in that unit (gpt-oss: 1.702).
    """

    num_experts: int = 0
    experts_per_token: int = 2
    expert_mlp_dim: int = 0
    shared_expert_mlp_dim: int = 0
    moe_form: str = "dropless"
    capacity_factor: float = 1.25
    router_z_loss_coef: float = 1e-3
    load_balance_coef: float = 1e-2
    renormalize_expert_weights: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702

    def check_expert_axis(self) -> None:
        """Raises unless the expert mesh axis in context (`sharding.logical_axis_size("exp")`) divides num_experts:
        each device holds whole experts."""
        shards = sharding.logical_axis_size("exp")
        if self.num_experts % shards:
            raise ValueError(
                f"config.model.num_experts={self.num_experts} must be a multiple of the {shards} devices of the "
                f"expert mesh axis; set --config.model.num_experts to a multiple of {shards}, or the expert size of "
                f"config.sharding.mesh_shape (data, fsdp, expert, tensor) to a divisor of {self.num_experts}"
            )


ROUTER_SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoeConfig(MoeFields):
    """The `MoeFields` of one `MoeBlock`: num_experts >= 1 and expert_mlp_dim the experts' own F (`problems` names
    every field out of range), and DeepSeek-V3's routing, which families set from their own fields (the defaults are
    the routing of the Mixtral / Qwen MoE models, unchanged).

    Attributes:
        router_score: "softmax" over the experts (Mixtral, Qwen), or "sigmoid": each expert scored on its own
            (DeepSeek-V3).
        score_correction: a per-expert bias [E] ("correction_bias", float32, never trained by gradient) added to the
            scores when choosing the experts, not when weighting them (DeepSeek-V3's e_score_correction_bias: the
            auxiliary-loss-free load balancing sets it, `balancing_signal`).
        expert_groups: G; the experts form G groups of E / G and a token chooses among the experts of its
            `groups_per_token` best groups, a group scored by the sum of its two best scores (DeepSeek-V3's n_group,
            topk_group). 1: no groups.
        routed_scaling: the routed experts' weights are multiplied by it (DeepSeek-V3's routed_scaling_factor).
        shared_expert_gate: the shared expert is scaled by sigmoid(x w) (Qwen2-MoE); False adds it as it is
            (DeepSeek-V3's shared experts).
    """

    router_score: str = "softmax"
    score_correction: bool = False
    expert_groups: int = 1
    groups_per_token: int = 1
    routed_scaling: float = 1.0
    shared_expert_gate: bool = True

    def problems(self) -> list[tuple[str, str, str]]:
        """(field, what is wrong, a valid value) for every out-of-range field; empty when the config is valid."""
        e = self.num_experts
        checks = (
            ("num_experts", e >= 1, "must be >= 1", "8"),
            (
                "experts_per_token",
                1 <= self.experts_per_token <= e,
                f"the router's top-k must be in [1, num_experts={e}]",
                str(min(2, max(e, 1))),
            ),
            ("expert_mlp_dim", self.expert_mlp_dim >= 1, "must be >= 1", "N"),
            ("shared_expert_mlp_dim", self.shared_expert_mlp_dim >= 0, "must be >= 0 (0: no shared expert)", "0"),
            ("moe_form", self.moe_form in MOE_FORMS, f"choose one of {MOE_FORMS}", "dropless"),
            (
                "capacity_factor",
                self.capacity_factor > 0,
                "must be > 0 (each expert takes ceil(capacity_factor * T * R / E) tokens of a sequence)",
                "1.25",
            ),
            ("router_z_loss_coef", self.router_z_loss_coef >= 0, "must be >= 0 (0 turns the z-loss off)", "0.001"),
            ("load_balance_coef", self.load_balance_coef >= 0, "must be >= 0 (0 turns the loss off)", "0.01"),
            ("router_score", self.router_score in ROUTER_SCORES, f"choose one of {ROUTER_SCORES}", "softmax"),
            (
                "expert_groups",
                self.expert_groups == 1
                or (self.expert_groups > 1 and e % self.expert_groups == 0 and e >= 2 * self.expert_groups),
                f"must divide num_experts={e} into groups of at least 2 experts (1: no groups)",
                "1",
            ),
            (
                "groups_per_token",
                1 <= self.groups_per_token <= self.expert_groups
                and (
                    self.expert_groups == 1
                    or self.groups_per_token * (e // self.expert_groups) >= self.experts_per_token
                ),
                f"must be in [1, expert_groups={self.expert_groups}], its groups holding at least experts_per_token="
                f"{self.experts_per_token} experts",
                str(self.expert_groups),
            ),
            ("routed_scaling", self.routed_scaling > 0, "must be > 0 (1: the weights as routed)", "1.0"),
            ("swiglu_limit", self.swiglu_limit >= 0, "must be >= 0 (0: the plain SwiGLU)", "0.0"),
            ("swiglu_alpha", self.swiglu_alpha > 0, "must be > 0 (gpt-oss: 1.702)", "1.702"),
        )
        return [(name, why, fix) for name, ok, why, fix in checks if not ok]

    def capacity(self, length: int) -> int:
        """C, the assignments each expert takes from one sequence of `length` tokens in the capacity form."""
        return math.ceil(self.capacity_factor * length * self.experts_per_token / self.num_experts)


def grouped_matmul(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, D] with rows sorted by group, kernel [E, D, F], group_sizes [E] summing to M -> [M, F]: each row times
    its group's kernel (`jax.lax.ragged_dot`; `kernels.cpu.grouped_matmul` on the CPU, where XLA computes ragged_dot
    as E masked dense products)."""
    if kernels.on_cpu():
        return cpu.grouped_matmul(x, kernel, group_sizes)
    return jax.lax.ragged_dot(x, kernel, group_sizes)


def expert_unit(gate: jax.Array, up: jax.Array, *, limit: float = 0.0, alpha: float = 1.702) -> jax.Array:
    """An expert's gated unit of its two projections: silu(gate) * up, or with `limit` > 0 gpt-oss's clamped SwiGLU,
    (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit) (`MoeFields.swiglu_limit`)."""
    if not limit:
        return jax.nn.silu(gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


class ExpertWeights(NamedTuple):
    """The E experts' stacked weights: wi_0 / wi_1 [E, D, F], wo [E, F, D], their biases bi_0 / bi_1 [E, F] and
    bo [E, D] (None: none), and the gated unit of the two input projections (`expert_unit`)."""

    wi_0: jax.Array
    wi_1: jax.Array
    wo: jax.Array
    bi_0: jax.Array | None = None
    bi_1: jax.Array | None = None
    bo: jax.Array | None = None
    unit: Callable[[jax.Array, jax.Array], jax.Array] = expert_unit


def gated_experts(x: jax.Array, weights: ExpertWeights, group_sizes: jax.Array, row_experts: jax.Array) -> jax.Array:
    """unit(x wi_0 + bi_0, x wi_1 + bi_1) wo + bo with each row's group's weights: x [M, D] sorted by expert,
    group_sizes [E], row_experts [M] (each row's expert, for the biases) -> [M, D]."""
    w = weights

    def biased(h, bias):
        return h if bias is None else h + jnp.take(bias, row_experts, axis=0)

    gate = biased(grouped_matmul(x, w.wi_0, group_sizes), w.bi_0)
    up = biased(grouped_matmul(x, w.wi_1, group_sizes), w.bi_1)
    return biased(grouped_matmul(w.unit(gate, up), w.wo, group_sizes), w.bo)


def dropless_experts(x: jax.Array, experts: jax.Array, weights: ExpertWeights) -> jax.Array:
    """Every assignment through its expert: x [B, T, D], experts [B, T, R] -> [B, T, R, D].

    The B*T*R assignments are sorted by expert, so each expert's rows are contiguous (`gated_experts`), and put back
    in token order."""
    b, t, d = x.shape
    flat = experts.reshape(-1)  # [B*T*R], a token's R assignments next to each other
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x.reshape(-1, d), order // experts.shape[-1], axis=0)  # [B*T*R, D] sorted by expert
    group_sizes = jnp.bincount(flat, length=weights.wi_0.shape[0]).astype(jnp.int32)
    out = gated_experts(rows, weights, group_sizes, jnp.take(flat, order))
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return jnp.take(out, unsort, axis=0).reshape(experts.shape + (d,))


def capacity_slots(experts: jax.Array, num_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Where each assignment goes in its expert's buffer of `capacity` places per sequence: experts [B, T, R] ->
    (slot [B, T, R] in [0, E*C): expert * C + its rank among the expert's assignments, kept [B, T, R] bool: rank < C).

    Ranks follow GShard's priority: the first choices of the whole sequence, then the second choices, each in token
    order, so overflow drops a token's later choices first."""
    b, t, r = experts.shape
    choice_major = jnp.swapaxes(experts, 1, 2).reshape(b, r * t)  # [B, R*T]
    one_hot = jax.nn.one_hot(choice_major, num_experts, dtype=jnp.int32)  # [B, R*T, E]
    rank = jnp.sum((jnp.cumsum(one_hot, axis=1) - 1) * one_hot, axis=-1)  # [B, R*T]
    rank = jnp.swapaxes(rank.reshape(b, r, t), 1, 2)  # [B, T, R]
    return experts * capacity + rank, rank < capacity


def capacity_experts(
    x: jax.Array, experts: jax.Array, weights: ExpertWeights, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """The assignments that fit their expert's capacity through it: x [B, T, D], experts [B, T, R] ->
    (outputs [B, T, R, D], zero where dropped; kept [B, T, R] bool).

    Each sequence's tokens are gathered into a buffer [B, E, C, D] (zeros in the places left empty). On a mesh, the
    buffer's batch axis leaves the expert mesh axis and its experts axis takes it, so XLA moves the tokens to their
    experts' devices with an all-to-all, and back the same way."""
    b, t, d = x.shape
    w = weights
    e = w.wi_0.shape[0]
    slot, kept = capacity_slots(experts, e, capacity)
    slot = jnp.where(kept, slot, e * capacity)  # dropped: past the buffer, out of bounds of the gathers below
    token = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], experts.shape)
    rows = jnp.arange(b)[:, None, None]
    source = jnp.full((b, e * capacity), t, jnp.int32).at[rows, slot].set(token, mode="drop")  # [B, E*C]; t: empty
    buffer = jnp.take_along_axis(x, source[..., None], axis=1, mode="fill", fill_value=0)
    buffer = sharding.constrain(buffer.reshape(b, e, capacity, d), ("act_batch_no_exp", "act_exp", None, "act_embed"))

    def biased(h, bias):  # an empty place gets the bias too; nothing reads it back
        return h if bias is None else h + bias[None, :, None, :]

    gate = biased(jnp.einsum("BECD,EDF->BECF", buffer, w.wi_0), w.bi_0)
    h = w.unit(gate, biased(jnp.einsum("BECD,EDF->BECF", buffer, w.wi_1), w.bi_1))
    h = sharding.constrain(h, ("act_batch_no_exp", "act_exp", None, "act_mlp"))
    out = biased(jnp.einsum("BECF,EFD->BECD", h, w.wo), w.bo)
    out = sharding.constrain(out, ("act_batch_no_exp", "act_exp", None, "act_embed"))
    out = sharding.constrain(out.reshape(b, e * capacity, d), ("act_batch", None, "act_embed"))
    out = jnp.take_along_axis(out, slot.reshape(b, -1, 1), axis=1, mode="fill", fill_value=0)
    return out.reshape(experts.shape + (d,)), kept


def balancing_signal(correction_bias: jax.Array, expert_load: jax.Array) -> jax.Array:
    """0 in value, with the gradient (expert_load [E] - its mean) with respect to correction_bias [E]: positive for
    an overloaded expert. Added to a layer's aux_loss, it carries each expert's imbalance through the loss's gradient
    to the optimizer, which moves the bias by a fixed step against its sign (`trainers.optim`'s
    `optim.expert_bias_rate`: DeepSeek-V3's auxiliary-loss-free balancing) and never by the gradient itself."""
    imbalance = jax.lax.stop_gradient(expert_load - jnp.mean(expert_load))
    signal = jnp.sum(imbalance * correction_bias)
    return signal - jax.lax.stop_gradient(signal)


class MoeBlock(nn.Module):
    """Mixture-of-experts feed-forward with `MlpBlock`'s call: [B, T, D] -> [B, T, D].

    A router (kernel [D, E], in float32) gives each token softmax probabilities over the E experts; the token goes
    to its top R, weighted by their probabilities (divided by their sum with `renormalize_expert_weights`, as
    Mixtral). An expert is a gated SiLU unit as Llama's MLP, silu(x wi_0) * (x wi_1) wo (gpt-oss's: biased, and
    its clamped SwiGLU, `expert_unit`; its router biased too: `MoeFields`); the experts' kernels are
    stacked on a leading experts axis, logical name "exp" (wi_0, wi_1 [E, D, F]; wo [E, F, D]), which the expert
    mesh axis shards. With `shared_expert_mlp_dim`, every token also goes through a shared expert (an `MlpBlock`,
    "shared") scaled by sigmoid(x w) ("shared_gate" [D]), as Qwen2-MoE. DeepSeek-V3's routing (`MoeConfig`'s
    router_score "sigmoid", score_correction, expert_groups, routed_scaling; shared experts without the gate) is
    `_route`'s.

    Forms (`MoeConfig.moe_form`), equal where nothing is dropped:
    - "dropless": the assignments of the whole batch sorted by expert and multiplied group by group
      (`dropless_experts`, `grouped_matmul`); every assignment is computed.
    - "capacity": each expert takes at most C = `MoeConfig.capacity(T)` assignments of each sequence, in GShard's
      priority; the rest are dropped (they add nothing; the residual carries the token) and counted
      (`capacity_experts`: tokens gathered into an [B, E, C, D] buffer, moved to the experts' devices by an
      all-to-all).

    Sown into the `MOE_COLLECTION` collection as "stats" when it is mutable (`objectives.tasks` makes it so for
    models with experts; under `nn.scan` each value gains a leading layers axis), over every token of the batch:
    aux_loss (load_balance_coef * load_balance + router_z_loss_coef * router_z, plus `balancing_signal` with a
    correction bias: what the objective adds to its loss), load_balance (E * sum_e f_e P_e, f_e the fraction of tokens routed to expert e, P_e its mean router
    probability: R at perfect balance, as HF's Mixtral computes it per layer), router_z (mean logsumexp(logits)^2),
    dropped (the fraction of assignments dropped; 0 in the dropless form) and expert_load [E] (the fraction of
    assignments each expert received, summing to 1).

    Attributes:
        config: MoeConfig.
    """

    config: MoeConfig
    kernel_init: Initializer = nn.initializers.normal(0.02)
    out_init: Initializer = nn.initializers.normal(0.02)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool) -> jax.Array:
        """x: [B, T, D] -> [B, T, D]. `deterministic` is taken for `MlpBlock`'s call: there is no dropout inside."""
        cfg = self.config
        problems = cfg.problems()
        if problems:
            raise ValueError("; ".join(f"MoeConfig.{name}={getattr(cfg, name)!r}: {why}" for name, why, _ in problems))
        b, t, d = x.shape
        e, f = cfg.num_experts, cfg.expert_mlp_dim
        # The router runs in float32: its softmax and top-k decide where each token goes.
        logits = Einsum(
            (d, e),
            ("embed", "exp"),
            use_bias=cfg.router_bias,
            kernel_init=self.kernel_init,
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            name="router",
        )("BTD,DE->BTE", x)
        logits = sharding.constrain(logits, ("act_batch", "act_len", None))
        probs, weights, experts, correction_bias = self._route(logits)

        def kernel(name, init, shape, axes):
            boxed_init = nn.with_logical_partitioning(init, axes)
            return self.param(name, boxed_init, shape, self.param_dtype).astype(self.dtype)

        wi_0 = kernel("wi_0", self.kernel_init, (e, d, f), ("exp", "embed", "mlp"))
        wi_1 = kernel("wi_1", self.kernel_init, (e, d, f), ("exp", "embed", "mlp"))
        wo = kernel("wo", self.out_init, (e, f, d), ("exp", "mlp", "embed"))
        biases = (None,) * 3
        if cfg.expert_bias:
            zeros = nn.initializers.zeros
            biases = (
                kernel("wi_0_bias", zeros, (e, f), ("exp", "mlp")),
                kernel("wi_1_bias", zeros, (e, f), ("exp", "mlp")),
                kernel("wo_bias", zeros, (e, d), ("exp", "embed")),
            )
        unit = functools.partial(expert_unit, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)
        stacked = ExpertWeights(wi_0, wi_1, wo, *biases, unit=unit)
        x = x.astype(self.dtype)
        if cfg.moe_form == "dropless":
            out, dropped = dropless_experts(x, experts, stacked), jnp.zeros((), jnp.float32)
        else:
            out, kept = capacity_experts(x, experts, stacked, cfg.capacity(t))
            dropped = 1.0 - jnp.mean(kept.astype(jnp.float32))
        y = jnp.einsum("BTRD,BTR->BTD", out, weights.astype(self.dtype))
        if cfg.shared_expert_mlp_dim:
            shared = MlpBlock(
                cfg.shared_expert_mlp_dim,
                activations=("silu", "linear"),
                use_bias=False,
                kernel_init=self.kernel_init,
                out_init=self.out_init,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="shared",
            )(x, deterministic=deterministic)
            if cfg.shared_expert_gate:
                gate = Einsum(
                    (d,),
                    ("embed",),
                    kernel_init=self.kernel_init,
                    dtype=self.dtype,
                    param_dtype=self.param_dtype,
                    name="shared_gate",
                )("BTD,D->BT", x)
                shared = jax.nn.sigmoid(gate)[..., None] * shared
            y = y + shared
        assigned = jnp.mean(jax.nn.one_hot(experts, e, dtype=jnp.float32), axis=(0, 1))  # [R, E]: f_e per choice
        load_balance = e * jnp.sum(jnp.sum(assigned, axis=0) * jnp.mean(probs, axis=(0, 1)))
        router_z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
        expert_load = jnp.mean(assigned, axis=0)  # [E]
        aux_loss = cfg.load_balance_coef * load_balance + cfg.router_z_loss_coef * router_z
        if correction_bias is not None:
            aux_loss = aux_loss + balancing_signal(correction_bias, expert_load)
        self.sow(
            MOE_COLLECTION,
            "stats",
            {
                "aux_loss": aux_loss,
                "load_balance": load_balance,
                "router_z": router_z,
                "dropped": dropped,
                "expert_load": expert_load,
            },
        )
        return sharding.constrain(y, ("act_batch", "act_len", "act_embed"))

    def _route(self, logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """Router logits [B, T, E] float32 -> (probabilities [B, T, E] for the load statistics, weights [B, T, R],
        experts [B, T, R], the correction bias [E] or None).

        Softmax scores are probabilities; sigmoid scores are normalised to sum to 1 for the statistics only. The
        experts are the top R of the scores, plus the correction bias when there is one, among the experts of the
        token's best groups; their weights are their scores (without the bias), renormalised and scaled as configured.
        """
        cfg = self.config
        scores = jax.nn.softmax(logits) if cfg.router_score == "softmax" else jax.nn.sigmoid(logits)
        bias = None
        if not cfg.score_correction and cfg.expert_groups == 1:
            weights, experts = jax.lax.top_k(scores, cfg.experts_per_token)  # [B, T, R]
        else:
            choice = scores
            if cfg.score_correction:
                bias = self.param(
                    CORRECTION_BIAS,
                    nn.with_logical_partitioning(nn.initializers.zeros, ("exp",)),
                    (cfg.num_experts,),
                    jnp.float32,  # small differences between scores decide the choice: kept in float32, as HF does
                )
                choice = choice + jax.lax.stop_gradient(bias)  # set by load balancing (`balancing_signal`)
            if cfg.expert_groups > 1:
                grouped = choice.reshape(*choice.shape[:-1], cfg.expert_groups, -1)  # [B, T, G, E / G]
                group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [B, T, G]
                best = jax.lax.top_k(group_scores, cfg.groups_per_token)[1]  # [B, T, groups_per_token]
                kept = jnp.any(best[..., None] == jnp.arange(cfg.expert_groups), axis=-2)  # [B, T, G]
                choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
            experts = jax.lax.top_k(choice, cfg.experts_per_token)[1]
            weights = jnp.take_along_axis(scores, experts, axis=-1)
        if cfg.renormalize_expert_weights:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        if cfg.routed_scaling != 1.0:
            weights = weights * cfg.routed_scaling
        probs = scores if cfg.router_score == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
        return probs, weights, experts, bias
