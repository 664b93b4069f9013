"""Llama with mixture-of-experts layers (`num_experts` > 0): its fields and their errors, a parameter tree that HF's
Mixtral and Qwen2-MoE tensors map onto one by one, the auxiliary losses in the causal-LM loss and metrics, scanned
and rematerialised layers, and KV-cache decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo import decoding, models, testing
from lmzoo.layers import mlp
from lmzoo.models import experts
from lmzoo.objectives import tasks

TINY = dict(vocab_size=61, max_len=32, emb_dim=24, num_heads=6, num_kv_heads=2, head_dim=8, num_layers=2, mlp_dim=40)
MOE = dict(TINY, num_experts=4, experts_per_token=2)


def tiny_moe(**overrides):
    model = models.build_model("llama", {**MOE, **overrides})
    boxed = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    return model, boxed, nn.unbox(boxed)


def lm_batch(shape=(2, 8)) -> dict:
    tokens = testing.random_tokens((shape[0], shape[1] + 1), vocab_size=61)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones(shape, np.float32)}


def task_loss(model, params, batch):
    task = tasks.causal_lm_task(model)
    return jax.value_and_grad(task.loss, has_aux=True)(params, {}, None, batch, jax.random.key(1), step=0, train=True)


def test_experts_parameters_are_stacked_with_logical_axes():
    """Per layer: router [D, E] (HF's gate weight [E, D] transposed), wi_0 / wi_1 [E, D, F] (Mixtral's w1 / w3,
    Qwen2-MoE's gate_proj / up_proj, each transposed), wo [E, F, D] (w2 / down_proj); Qwen2-MoE's shared expert is a
    SwiGLU MLP with its sigmoid gate's kernel [D] (shared_expert_gate [1, D])."""
    model, boxed, params = tiny_moe(shared_expert_mlp_dim=16)
    layer, boxed_layer = params["blocks"]["layer_1"]["mlp"], boxed["blocks"]["layer_1"]["mlp"]
    assert {k: np.shape(v) for k, v in layer.items() if k in ("wi_0", "wi_1", "wo")} == {
        "wi_0": (4, 24, 40),  # expert_mlp_dim 0: mlp_dim
        "wi_1": (4, 24, 40),
        "wo": (4, 40, 24),
    }
    assert layer["router"]["kernel"].shape == (24, 4) and layer["shared_gate"]["kernel"].shape == (24,)
    assert {k: v["kernel"].shape for k, v in layer["shared"].items()} == {
        "wi_0": (24, 16),
        "wi_1": (24, 16),
        "wo": (16, 24),
    }
    assert boxed_layer["wi_0"].names == ("exp", "embed", "mlp") and boxed_layer["wo"].names == ("exp", "mlp", "embed")
    assert boxed_layer["router"]["kernel"].names == ("embed", "exp")
    assert model.has_experts and not models.build_model("llama", TINY).has_experts
    _, _, narrow = tiny_moe(expert_mlp_dim=8)
    assert narrow["blocks"]["layer_0"]["mlp"]["wo"].shape == (4, 8, 24)


def test_dense_model_is_unchanged():
    """num_experts 0: the SwiGLU MlpBlock's tree, and no MoE metric in the loss."""
    model = models.build_model("llama", TINY)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    assert {k: v["kernel"].shape for k, v in params["blocks"]["layer_0"]["mlp"].items()} == {
        "wi_0": (24, 40),
        "wi_1": (24, 40),
        "wo": (40, 24),
    }
    (_, (metrics, _)), _ = task_loss(model, params, lm_batch())
    assert set(metrics) == {"loss", "accuracy"}


def test_loss_adds_the_mean_auxiliary_loss_and_reports_the_statistics():
    model, _, params = tiny_moe(load_balance_coef=0.5, router_z_loss_coef=0.1)
    batch = lm_batch()
    (value, (metrics, _)), grads = task_loss(model, params, batch)
    _, sown = model.apply({"params": params}, batch["inputs"], mutable=[mlp.MOE_COLLECTION])
    layers = [sown[mlp.MOE_COLLECTION]["blocks"][f"layer_{i}"]["mlp"]["stats"][0] for i in range(2)]
    aux = np.mean([0.5 * s["load_balance"] + 0.1 * s["router_z"] for s in layers])
    cross_entropy = metrics["loss"][0] / metrics["loss"][1]
    np.testing.assert_allclose(value, cross_entropy + aux, rtol=1e-6)
    summary = {k: float(s) / float(c) for k, (s, c) in metrics.items()}
    np.testing.assert_allclose(summary["moe/aux_loss"], aux, rtol=1e-6)
    np.testing.assert_allclose(summary["moe/load_balance"], np.mean([s["load_balance"] for s in layers]), rtol=1e-6)
    assert summary["moe/dropped"] == 0.0
    for i, stats in enumerate(layers):
        loads = [summary[f"expert_load/{i}_{e}"] for e in range(4)]
        np.testing.assert_allclose(loads, stats["expert_load"], rtol=1e-6)
        np.testing.assert_allclose(sum(loads), 1.0, rtol=1e-6)
    router_grad = grads["blocks"]["layer_0"]["mlp"]["router"]["kernel"]
    assert np.abs(np.asarray(router_grad)).max() > 0


@pytest.mark.parametrize("form", ["dropless", "capacity"])
def test_scanned_rematerialised_layers_equal_the_loop_with_their_losses(form):
    """nn.scan stacks the sown statistics on the layers axis, through remat; loss, metrics and gradients agree."""
    fields = {"moe_form": form, "capacity_factor": 0.75}  # the capacity form drops some assignments
    model, _, params = tiny_moe(**fields)
    scanned = models.build_model("llama", {**MOE, **fields, "scan_layers": True, "remat_policy": "full"})
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[params["blocks"][f"layer_{i}"] for i in range(2)])
    scan_params = {**params, "blocks": {"layers": stacked}}
    batch = lm_batch((2, 16))
    (value, (metrics, _)), grads = task_loss(model, params, batch)
    (scan_value, (scan_metrics, _)), scan_grads = task_loss(scanned, scan_params, batch)
    np.testing.assert_allclose(scan_value, value, rtol=1e-5)
    assert set(scan_metrics) == set(metrics)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), scan_metrics, metrics)
    loop_grads = jax.tree.map(lambda *xs: jnp.stack(xs), *[grads["blocks"][f"layer_{i}"] for i in range(2)])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), scan_grads["blocks"]["layers"], loop_grads)
    if form == "capacity":
        assert 0 < metrics["moe/dropped"][0] / metrics["moe/dropped"][1] < 1


def test_kv_cache_decoding_equals_full_forward():
    """Dropless routing is per token, so a prompt then one token at a time equals the whole sequence at once."""
    model, _, params = tiny_moe(shared_expert_mlp_dim=16)
    prompts = np.array([[0, 0, 5, 7, 9], [3, 4, 5, 6, 7]], np.int32)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int32)
    kwargs = dict(max_new_tokens=6, temperature=0.0)
    cached = decoding.sample(model, params, prompts, mask, jax.random.key(0), **kwargs)
    plain = decoding.sample(model, params, prompts, mask, jax.random.key(0), use_cache=False, **kwargs)
    np.testing.assert_array_equal(cached.tokens, plain.tokens)
    np.testing.assert_allclose(cached.log_probs, plain.log_probs, atol=1e-5)


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"experts_per_token": 0},
            "config.model.experts_per_token=0: the router's top-k must be in [1, num_experts=4]",
        ),
        (
            {"experts_per_token": 5},
            "config.model.experts_per_token=5: the router's top-k must be in [1, num_experts=4]; ",
        ),
        ({"capacity_factor": 0.0}, "config.model.capacity_factor=0.0: must be > 0"),
        ({"capacity_factor": -1.0}, "set --config.model.capacity_factor=1.25"),
        ({"moe_form": "sparse"}, "config.model.moe_form='sparse': choose one of ('dropless', 'capacity')"),
        ({"num_experts": -1}, "config.model.num_experts=-1: must be >= 0"),
        ({"load_balance_coef": -0.1}, "config.model.load_balance_coef=-0.1: must be >= 0"),
    ],
)
def test_bad_moe_fields_name_the_field_and_the_fix(fields, message):
    with pytest.raises(ValueError) as raised:
        models.make_config("llama", {**MOE, **fields})
    assert message in str(raised.value)


def test_dense_model_ignores_the_moe_fields():
    assert models.make_config("llama", {**TINY, "experts_per_token": 0}).moe is None


def test_moe_aux_loss_orders_layers_numerically():
    """Eleven unscanned layers: "layer_10" is the last, not the third."""
    sown = {
        "blocks": {
            f"layer_{i}": {"mlp": {"stats": ({"aux_loss": jnp.float32(i), "expert_load": jnp.array([i, -i])},)}}
            for i in range(11)
        }
    }
    value, metrics = experts.moe_aux_loss({mlp.MOE_COLLECTION: sown})
    np.testing.assert_allclose(value, 5.0)
    assert [float(metrics[f"expert_load/{i}_0"][0]) for i in range(11)] == list(range(11))
