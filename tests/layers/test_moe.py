"""The mixture-of-experts feed-forward (`layers.mlp.MoeBlock`): its two forms equal each other and a per-token dense
reference, in values and gradients, on the CPU forms and the accelerator forms; capacity drops in GShard's order;
the CPU grouped matmul equals `jax.lax.ragged_dot`; the sown losses are what their formulas say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo import kernels, sharding
from lmzoo.kernels import cpu
from lmzoo.layers import mlp

D, E = 16, 4


def moe_block(**fields) -> mlp.MoeBlock:
    return mlp.MoeBlock(mlp.MoeConfig(**{"num_experts": E, "expert_mlp_dim": 12, **fields}))


def dense_reference(params, x, config: mlp.MoeConfig) -> jax.Array:
    """Every token through every expert, weighted by its renormalised top-k probabilities (zero elsewhere)."""
    logits = jnp.einsum("BTD,DE->BTE", x, params["router"]["kernel"])
    probs = jax.nn.softmax(logits + params["router"]["bias"] if config.router_bias else logits)
    top, _ = jax.lax.top_k(probs, config.experts_per_token)
    gates = jnp.where(probs >= top[..., -1:], probs, 0.0)
    if config.renormalize_expert_weights:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    gate, up = (jnp.einsum("BTD,EDF->BTEF", x, params[name]) for name in ("wi_0", "wi_1"))
    if config.expert_bias:
        gate, up = gate + params["wi_0_bias"], up + params["wi_1_bias"]
    if config.swiglu_limit:  # gpt-oss's clamped SwiGLU
        gate, up = jnp.minimum(gate, config.swiglu_limit), jnp.clip(up, -config.swiglu_limit, config.swiglu_limit)
        h = (up + 1) * gate * jax.nn.sigmoid(config.swiglu_alpha * gate)
    else:
        h = jax.nn.silu(gate) * up
    out = jnp.einsum("BTEF,EFD->BTED", h, params["wo"])
    y = jnp.einsum("BTED,BTE->BTD", out + params["wo_bias"] if config.expert_bias else out, gates)
    if config.shared_expert_mlp_dim:
        shared = params["shared"]
        h = jax.nn.silu(x @ shared["wi_0"]["kernel"]) * (x @ shared["wi_1"]["kernel"])
        y = y + jax.nn.sigmoid(x @ params["shared_gate"]["kernel"])[..., None] * (h @ shared["wo"]["kernel"])
    return y


def init(block: mlp.MoeBlock, x: jax.Array):
    return nn.unbox(block.init(jax.random.key(0), x, deterministic=True)["params"])


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"experts_per_token": 1},
        {"experts_per_token": 3, "renormalize_expert_weights": False},
        {"shared_expert_mlp_dim": 8},
        {"router_bias": True, "expert_bias": True, "swiglu_limit": 0.3},  # gpt-oss's, the clamp within reach
    ],
)
def test_dropless_and_capacity_equal_the_dense_reference_in_values_and_gradients(platform, fields):
    """With a capacity of every assignment (capacity_factor E / R: C = T), nothing drops and both forms compute the
    reference's sum; the accelerator forms (`jax.lax.ragged_dot`) are traced on the CPU here."""
    x = jax.random.normal(jax.random.key(1), (3, 10, D))
    dropless = moe_block(**fields)
    k = dropless.config.experts_per_token
    capacity = moe_block(moe_form="capacity", capacity_factor=E / k, **fields)
    params = init(dropless, x)
    biases = jax.random.split(jax.random.key(2), 4)
    for i, name in enumerate(["wi_0_bias", "wi_1_bias", "wo_bias"] if dropless.config.expert_bias else []):
        params[name] = 0.3 * jax.random.normal(biases[i], params[name].shape)
    if dropless.config.router_bias:
        params["router"]["bias"] = jax.random.normal(biases[3], (E,))

    def loss(apply, params, x):
        return jnp.sum(jnp.sin(apply(params, x)))

    with kernels.use_platform(platform):
        results = [
            jax.value_and_grad(loss, argnums=(1, 2))(apply, params, x)
            for apply in (
                lambda p, x: dropless.apply({"params": p}, x, deterministic=True),
                lambda p, x: capacity.apply({"params": p}, x, deterministic=True),
                lambda p, x: dense_reference(p, x, dropless.config),
            )
        ]
    for value, grads in results[:2]:
        np.testing.assert_allclose(value, results[2][0], rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), grads, results[2][1])


def test_capacity_drops_later_choices_first_and_counts_them():
    """GShard's priority: every first choice of the sequence, then the second choices, each in token order."""
    experts = jnp.array([[[0, 1], [0, 2], [0, 1], [1, 0]]])  # [1, T=4, R=2]
    slot, kept = mlp.capacity_slots(experts, 3, capacity=2)
    # expert 0 takes tokens 0 and 1 (first choices); token 2's first choice and token 3's second one overflow.
    # expert 1 takes token 3 (first choice), then token 0's second choice; token 2's second choice overflows.
    np.testing.assert_array_equal(kept[0], [[True, True], [True, True], [False, False], [True, False]])
    np.testing.assert_array_equal(slot[0][kept[0]], [0, 3, 1, 4, 2])

    x = jax.random.normal(jax.random.key(1), (2, 16, D))
    block = moe_block(moe_form="capacity", capacity_factor=0.5)  # C = ceil(0.5 * 16 * 2 / 4) = 4 of 8 on average
    params = init(block, x)
    y, sown = block.apply({"params": params}, x, deterministic=True, mutable=[mlp.MOE_COLLECTION])
    stats = sown[mlp.MOE_COLLECTION]["stats"][0]
    probs = jax.nn.softmax(x @ params["router"]["kernel"])
    weights, chosen = jax.lax.top_k(probs, 2)
    _, kept = mlp.capacity_slots(chosen, E, block.config.capacity(16))
    assert block.config.capacity(16) == 4 and 0 < float(stats["dropped"]) < 1
    np.testing.assert_allclose(stats["dropped"], 1 - np.mean(kept))
    # The kept assignments alone, through the dense reference with the dropped ones' weights zeroed.
    reference = dense_reference(params, x, block.config)
    full = jax.nn.one_hot(chosen, E) * (weights / weights.sum(-1, keepdims=True))[..., None]
    lost = jnp.einsum("BTRE,BTR->BTE", full, (~kept).astype(jnp.float32))
    h = jax.nn.silu(jnp.einsum("BTD,EDF->BTEF", x, params["wi_0"])) * jnp.einsum("BTD,EDF->BTEF", x, params["wi_1"])
    np.testing.assert_allclose(y, reference - jnp.einsum("BTEF,EFD,BTE->BTD", h, params["wo"], lost), atol=1e-5)


@pytest.mark.parametrize("sizes", [[0, 130, 1, 125], [256, 0, 0, 0], [3, 5, 0, 0], [1, 0, 1, 0], [0, 2, 1, 1]])
def test_cpu_grouped_matmul_equals_ragged_dot(sizes):
    """Empty groups, a group longer than a block, groups that end mid-block; no more rows than groups (decoding)."""
    m = sum(sizes)
    x = jax.random.normal(jax.random.key(0), (m, 8))
    kernel = jax.random.normal(jax.random.key(1), (len(sizes), 8, 6))
    group_sizes = jnp.array(sizes, jnp.int32)

    def loss(fn, x, kernel):
        return jnp.sum(jnp.sin(fn(x, kernel, group_sizes)))

    expected = jax.value_and_grad(loss, argnums=(1, 2))(jax.lax.ragged_dot, x, kernel)
    actual = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)), static_argnums=0)(cpu.grouped_matmul, x, kernel)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), actual, expected)


def test_sown_losses_follow_their_formulas():
    """A zero router gives every expert probability 1/E: load balance E * sum_e f_e / E = R whatever the top-k's
    ties pick, and z-loss log(E)^2; a random router's values are recomputed from its probabilities."""
    x = jax.random.normal(jax.random.key(1), (2, 6, D))
    block = moe_block(router_z_loss_coef=0.1, load_balance_coef=0.5)
    params = init(block, x)
    zero = {**params, "router": {"kernel": jnp.zeros_like(params["router"]["kernel"])}}
    _, sown = block.apply({"params": zero}, x, deterministic=True, mutable=[mlp.MOE_COLLECTION])
    stats = sown[mlp.MOE_COLLECTION]["stats"][0]
    np.testing.assert_allclose(stats["load_balance"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(stats["router_z"], np.log(E) ** 2, rtol=1e-6)

    _, sown = block.apply({"params": params}, x, deterministic=True, mutable=[mlp.MOE_COLLECTION])
    stats = sown[mlp.MOE_COLLECTION]["stats"][0]
    logits = x @ params["router"]["kernel"]
    probs = jax.nn.softmax(logits).reshape(-1, E)
    chosen = jax.lax.top_k(probs, 2)[1]
    routed = np.array([np.sum(chosen == e) for e in range(E)]) / probs.shape[0]  # f_e, summing to R
    np.testing.assert_allclose(stats["load_balance"], E * np.sum(routed * probs.mean(0)), rtol=1e-5)
    np.testing.assert_allclose(stats["router_z"], np.mean(jax.nn.logsumexp(logits, -1) ** 2), rtol=1e-5)
    np.testing.assert_allclose(stats["expert_load"], routed / 2, rtol=1e-6)
    np.testing.assert_allclose(stats["aux_loss"], 0.5 * stats["load_balance"] + 0.1 * stats["router_z"], rtol=1e-6)
    assert float(stats["dropped"]) == 0.0


def test_bad_fields_are_named():
    x = jnp.zeros((1, 4, D))
    for fields, message in (
        ({"experts_per_token": 0}, "MoeConfig.experts_per_token=0: the router's top-k must be in [1, num_experts=4]"),
        ({"experts_per_token": 5}, "MoeConfig.experts_per_token=5"),
        ({"capacity_factor": 0.0}, "MoeConfig.capacity_factor=0.0: must be > 0"),
        ({"moe_form": "sparse"}, "MoeConfig.moe_form='sparse': choose one of ('dropless', 'capacity')"),
    ):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            moe_block(**fields).init(jax.random.key(0), x, deterministic=True)


@pytest.mark.parity
def test_dropless_equals_hf_mixtral_sparse_moe_block():
    """HF's MixtralSparseMoeBlock on the same weights: router weight [E, D] is the kernel transposed, the stacked
    gate_up_proj [E, 2F, D] holds wi_0 and wi_1 transposed, down_proj [E, D, F] holds wo transposed."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral

    config = transformers.MixtralConfig(
        hidden_size=D, intermediate_size=12, num_local_experts=E, num_experts_per_tok=2, router_jitter_noise=0.0
    )
    hf = modeling_mixtral.MixtralSparseMoeBlock(config).eval()
    x = jax.random.normal(jax.random.key(1), (2, 7, D))
    block = moe_block()
    params = jax.tree.map(np.asarray, init(block, x))
    with torch.no_grad():
        hf.gate.weight.copy_(torch.from_numpy(np.ascontiguousarray(params["router"]["kernel"].T)))
        gate_up = np.concatenate([params["wi_0"], params["wi_1"]], axis=-1).transpose(0, 2, 1)
        hf.experts.gate_up_proj.copy_(torch.from_numpy(np.ascontiguousarray(gate_up)))
        hf.experts.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(params["wo"].transpose(0, 2, 1))))
        expected = hf(torch.from_numpy(np.array(x)))
    expected = (expected[0] if isinstance(expected, tuple) else expected).numpy()
    np.testing.assert_allclose(block.apply({"params": params}, x, deterministic=True), expected, atol=1e-5)


def test_a_mesh_shape_of_three_sizes_has_expert_one():
    """Configs and runs saved before the expert axis name (data, fsdp, tensor)."""
    assert sharding.mesh_shape((2, 1, 4)) == (2, 1, 1, 4) and sharding.mesh_shape((1, 2, 2, 2)) == (1, 2, 2, 2)
    mesh = sharding.make_mesh((-1, 1, 1))
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor") and mesh.shape["expert"] == 1
    assert sharding.logical_axis_size("exp") == 1  # outside a mesh
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.axis_rules()):
        assert sharding.logical_axis_size("exp") == sharding.logical_axis_size("act_batch") == 1
    with pytest.raises(ValueError, match="must have one size per axis"):
        sharding.mesh_shape((1, 1))


def deepseek_routed_block() -> mlp.MoeBlock:
    return moe_block(
        router_score="sigmoid",
        score_correction=True,
        expert_groups=2,
        groups_per_token=1,
        load_balance_coef=0.0,  # DeepSeek-V3 balances without an auxiliary loss
        router_z_loss_coef=0.0,
    )


def test_the_correction_bias_gets_each_experts_imbalance_as_its_gradient_and_nothing_in_value():
    """The sown aux_loss is unchanged in value by the balancing signal, and its gradient with respect to the
    correction bias is expert_load - mean(expert_load), whatever the bias is."""
    x = jax.random.normal(jax.random.key(2), (2, 8, D))
    block = deepseek_routed_block()
    params = init(block, x)
    params = {**params, mlp.CORRECTION_BIAS: jnp.array([0.3, -0.1, 0.0, 0.2])}

    def aux(p):
        _, sown = block.apply({"params": p}, x, deterministic=True, mutable=[mlp.MOE_COLLECTION])
        return sown[mlp.MOE_COLLECTION]["stats"][0]["aux_loss"], sown[mlp.MOE_COLLECTION]["stats"][0]

    (value, stats), grads = jax.value_and_grad(aux, has_aux=True)(params)
    assert float(value) == 0.0
    load = np.asarray(stats["expert_load"])
    assert np.ptp(load) > 0  # the check below needs an uneven load
    np.testing.assert_allclose(grads[mlp.CORRECTION_BIAS], load - load.mean(), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(grads["router"]["kernel"], 0.0)  # the signal reaches the bias alone


def test_expert_bias_rate_balances_a_skewed_router_without_touching_the_other_updates():
    """With optim.expert_bias_rate, each step moves every correction bias by -rate * sign(its imbalance); AdamW's
    updates of the other params and its state are what they are without any correction bias; a router that sends
    most tokens to one group is brought near balance by the bias alone."""
    from ml_collections import ConfigDict

    from lmzoo import config as config_lib
    from lmzoo.trainers import optim

    x = jax.random.normal(jax.random.key(3), (4, 32, D)) + 1.0
    block = deepseek_routed_block()
    params = init(block, x)
    skew = jnp.zeros((D, E)).at[:, 0].set(0.5)  # expert 0 (and so its group) wins everywhere
    params = {**params, "router": {"kernel": params["router"]["kernel"] + skew}}

    def loss(p):
        y, sown = block.apply({"params": p}, x, deterministic=True, mutable=[mlp.MOE_COLLECTION])
        stats = sown[mlp.MOE_COLLECTION]["stats"][0]
        return jnp.mean(jnp.square(y)) + stats["aux_loss"], stats["expert_load"]

    settings = ConfigDict(config_lib.base_config().optim.to_dict())
    settings.expert_bias_rate = 0.01
    tx, _ = optim.make_optimizer(settings)
    plain, _ = optim.make_optimizer(config_lib.base_config().optim)
    (_, load), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, state = tx.update(grads, tx.init(params), params)
    imbalance = load - jnp.mean(load)
    np.testing.assert_array_equal(updates[mlp.CORRECTION_BIAS], -0.01 * jnp.sign(imbalance))
    others = {k: v for k, v in params.items() if k != mlp.CORRECTION_BIAS}
    expected, _ = plain.update({k: v for k, v in grads.items() if k != mlp.CORRECTION_BIAS}, plain.init(others), others)
    for name in others:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates[name], expected[name])
    assert jax.tree.structure(state) == jax.tree.structure(plain.init(params))

    first = float(jnp.max(load))
    step = jax.jit(lambda p, s: tx.update(jax.grad(lambda q: loss(q)[0])(p), s, p))
    for _ in range(80):  # the bias alone moves: the router stays skewed
        updates, state = step(params, state)
        params = {**params, mlp.CORRECTION_BIAS: params[mlp.CORRECTION_BIAS] + updates[mlp.CORRECTION_BIAS]}
    last = float(jnp.max(loss(params)[1]))
    assert first > 0.45 and last < 0.35, (first, last)  # balanced: 1 / E = 0.25
