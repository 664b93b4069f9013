"""LoRA as a transform of the parameter tree (`lmzoo.lora`): the merged model equals the unmerged one computed
at the activations, scanned and per-layer stacks and experts get adapters of their own, only the adapters train, and
bad input is a clear error."""

import contextlib
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lmzoo import lora, sharding
from lmzoo.convert import mapping
from lmzoo.layers.linears import Einsum
from lmzoo.lora import peft
from lmzoo.models import build_model

TINY = dict(vocab_size=32, max_len=16, emb_dim=16, num_heads=2, num_kv_heads=1, num_layers=2, mlp_dim=24)
ALL = "query|key|value|out|wi_0|wi_1|wo"
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 8)), jnp.int32)


def boxed_params(**overrides):
    """(model, params boxed with their logical axes): random numpy values on the shapes of `model.init`, which is
    never compiled."""
    model = build_model("llama", {**TINY, **overrides})
    abstract = jax.eval_shape(model.init, jax.random.key(0), TOKENS)["params"]
    rng = np.random.default_rng(0)

    def fill(box):
        value = rng.normal(0.0, 0.2, box.value.shape).astype(np.float32)
        return box.replace_boxed(value + 1.0 if box.names[-1] == "norm" else value)

    return model, jax.tree.map(fill, abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def forward(model):
    """params -> logits on TOKENS, jitted (compiled once per model and param dtypes)."""
    return jax.jit(lambda params: model.apply({"params": params}, TOKENS))


def nonzero(adapters, seed=1):
    """The adapters with B random too (B starts at zero, which would hide a wrong B layout)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.normal(0.0, 0.3, x.shape).astype(np.float32), nn.unbox(adapters))


def unmerged_apply(model, params, adapters, config, tokens):
    """The model with every adapted Einsum computing x W + scale (x A) B at its activations (flax interception): an
    independent account of which kernel axes are inputs."""

    def apply(params, adapters):
        pairs = lora.adapter_pairs(adapters)

        def interceptor(next_fn, args, kwargs, context):
            module = context.module
            if not isinstance(module, Einsum) or context.method_name != "__call__" or module.path not in pairs:
                return next_fn(*args, **kwargs)
            eqn, x = args
            a, b = pairs[module.path]
            (x_spec, kernel_spec), y_spec = eqn.split("->")[0].split(","), eqn.split("->")[1]
            ins, outs = kernel_spec[: a.ndim - 1], kernel_spec[a.ndim - 1 :]
            low_spec = "".join(letter for letter in x_spec if letter not in ins) + "r"
            low = jnp.einsum(f"{x_spec},{ins}r->{low_spec}", x, a)
            return next_fn(*args, **kwargs) + config.scale * jnp.einsum(f"{low_spec},r{outs}->{y_spec}", low, b)

        with nn.intercept_methods(interceptor):
            return model.apply({"params": params}, tokens)

    return jax.jit(apply)(params, adapters)


def test_merge_equals_the_unmerged_forward():
    model, boxed = boxed_params()
    config = lora.LoraConfig(ALL, rank=3, alpha=6.0)
    params, adapters = nn.unbox(boxed), nonzero(lora.init_adapters(jax.random.key(1), boxed, config))
    logits = forward(model)
    merged = logits(lora.merge(params, adapters, config))
    unmerged = unmerged_apply(model, params, adapters, config, TOKENS)
    base = logits(params)
    np.testing.assert_allclose(merged, unmerged, atol=1e-5)
    assert float(jnp.max(jnp.abs(merged - base))) > 1e-2  # the adapters do change the model


def test_adapter_shapes_follow_the_kernel_axes_and_start_as_the_base():
    model, boxed = boxed_params()
    config = lora.LoraConfig(ALL + "|lm_head", rank=4, alpha=8.0)
    adapters = lora.init_adapters(jax.random.key(1), boxed, config)
    layer = nn.unbox(adapters)["blocks"]["layer_0"]
    shapes = {
        name: (pair["lora_a"].shape, pair["lora_b"].shape) for name, pair in {**layer["attn"], **layer["mlp"]}.items()
    }
    assert shapes == {
        "query": ((16, 4), (4, 2, 8)),
        "key": ((16, 4), (4, 1, 8)),
        "value": ((16, 4), (4, 1, 8)),
        "out": ((2, 8, 4), (4, 16)),  # the attention output's inputs are (heads, head_dim)
        "wi_0": ((16, 4), (4, 24)),
        "wi_1": ((16, 4), (4, 24)),
        "wo": ((24, 4), (4, 16)),
    }
    a = layer["attn"]["query"]["lora_a"]
    assert float(jnp.max(jnp.abs(a))) <= 16**-0.5 and float(jnp.std(a)) > 0.1  # PEFT's kaiming-uniform bound
    assert lora.count(adapters) == sum(a.size + b.size for a, b in lora.adapter_pairs(adapters).values())
    params, logits = nn.unbox(boxed), forward(model)
    np.testing.assert_array_equal(logits(lora.merge(params, adapters, config)), logits(params))


def test_adapters_carry_their_kernels_logical_axes():
    _, boxed = boxed_params()
    adapters = lora.init_adapters(jax.random.key(1), boxed, lora.LoraConfig("query|out|wo", rank=2, alpha=2.0))
    attn = adapters["blocks"]["layer_0"]["attn"]
    assert attn["query"]["lora_a"].names == ("embed", None)
    assert attn["query"]["lora_b"].names == (None, "heads", "kv")
    assert attn["out"]["lora_a"].names == ("heads", "kv", None)
    mesh = sharding.make_mesh((1, 1, 1, 1))
    specs = sharding.logical_to_sharding(adapters, mesh, sharding.LOGICAL_AXIS_RULES)
    assert specs["blocks"]["layer_0"]["attn"]["query"]["lora_a"].spec == jax.sharding.PartitionSpec("fsdp", None)
    assert specs["blocks"]["layer_0"]["mlp"]["wo"]["lora_b"].spec == jax.sharding.PartitionSpec(None, "fsdp")


def test_scanned_layers_and_experts_get_adapters_of_their_own():
    config = lora.LoraConfig(ALL, rank=2, alpha=4.0)
    per_layer_model, per_layer = boxed_params()
    scanned_model, scanned = boxed_params(scan_layers=True)
    adapters = nonzero(lora.init_adapters(jax.random.key(1), scanned, config))
    assert adapters["blocks"]["layers"]["attn"]["out"]["lora_a"].shape == (2, 2, 8, 2)  # [L, N, H, r]
    params = jax.device_get(nn.unbox(per_layer))
    stacked = mapping.materialize(mapping.to_layout(params, nn.unbox(scanned)))
    ours = forward(scanned_model)(lora.merge(stacked, adapters, config))
    theirs = forward(per_layer_model)(lora.merge(params, mapping.unstack_layers(jax.device_get(adapters)), config))
    np.testing.assert_allclose(ours, theirs, atol=1e-5)

    _, moe = boxed_params(num_experts=2, experts_per_token=1)
    experts = lora.init_adapters(jax.random.key(2), moe, lora.LoraConfig("mlp/(wi_0|wo)", rank=2, alpha=2.0))
    mlp = experts["blocks"]["layer_1"]["mlp"]
    assert mlp["wi_0"]["lora_a"].names == ("exp", "embed", None) and mlp["wi_0"]["lora_b"].value.shape == (2, 2, 24)
    assert mlp["wo"]["lora_a"].value.shape == (2, 24, 2)
    experts = nonzero(experts)
    merged = lora.merge(nn.unbox(moe), experts, lora.LoraConfig("mlp/(wi_0|wo)", rank=2, alpha=2.0))
    a, b = (experts["blocks"]["layer_1"]["mlp"]["wo"][k] for k in ("lora_a", "lora_b"))
    expected = nn.unbox(moe)["blocks"]["layer_1"]["mlp"]["wo"][1] + a[1] @ b[1]
    np.testing.assert_allclose(merged["blocks"]["layer_1"]["mlp"]["wo"][1], expected, atol=1e-6)


def test_only_the_adapters_train_and_the_base_stays_frozen():
    model, boxed = boxed_params()
    config = lora.LoraConfig("query|value|wo", rank=2, alpha=4.0, base_dtype="bfloat16")
    base = lora.freeze(nn.unbox(boxed), config)
    assert base["blocks"]["layer_0"]["attn"]["query"]["kernel"].dtype == jnp.bfloat16
    assert base["blocks"]["layer_0"]["ln_attn"]["scale"].dtype == jnp.float32  # vectors keep their dtype
    adapters = nn.unbox(lora.init_adapters(jax.random.key(1), boxed, config))

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss = lora.lora_loss(loss_fn, config)
    tx = optax.adam(1e-2)
    opt_state = tx.init(adapters)
    assert sum(x.size for x in jax.tree.leaves(opt_state)) == 2 * lora.count(adapters) + 1  # mu, nu, count

    @jax.jit
    def step(adapters, opt_state, base):
        value, grads = jax.value_and_grad(loss)(adapters, base, TOKENS)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value, grads

    frozen = jax.tree.map(np.array, base)
    first, opt_state, loss0, grads = step(adapters, opt_state, base)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    query = lambda tree: tree["blocks"]["layer_0"]["attn"]["query"]  # noqa: E731
    # B starts at zero, so the first step moves B only; A follows once B is nonzero.
    assert float(jnp.max(jnp.abs(query(grads)["lora_a"]))) == 0.0
    assert float(jnp.max(jnp.abs(query(grads)["lora_b"]))) > 0.0
    second, _, loss1, grads = step(first, opt_state, base)
    assert float(jnp.max(jnp.abs(query(grads)["lora_a"]))) > 0.0
    assert float(loss1) < float(loss0)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, base), frozen)


def test_bad_input_is_a_clear_error():
    model, boxed = boxed_params()
    with pytest.raises(
        ValueError, match=r"match no kernel.*names here: key, out, query, value, wi_0, wi_1, wo, lm_head"
    ):
        lora.init_adapters(jax.random.key(0), boxed, lora.LoraConfig("q|k|v|o", rank=2, alpha=2.0))
    with pytest.raises(ValueError, match="rank=0 must be an integer >= 1"):
        lora.LoraConfig(ALL, rank=0, alpha=2.0)
    with pytest.raises(ValueError, match=r"rank=9 exceeds min\(inputs, outputs\) of .*attn/key \(16 -> 8\)"):
        lora.init_adapters(jax.random.key(0), boxed, lora.LoraConfig(ALL, rank=9, alpha=2.0))
    with pytest.raises(ValueError, match="not a regular expression"):
        lora.LoraConfig("(query", rank=2, alpha=2.0)
    with pytest.raises(ValueError, match=r"dropout=1.0 must be in \[0, 1\)"):
        lora.LoraConfig(ALL, rank=2, alpha=2.0, dropout=1.0)
    with pytest.raises(ValueError, match="carries no logical axes"):
        lora.init_adapters(jax.random.key(0), nn.unbox(boxed), lora.LoraConfig("query", rank=2, alpha=2.0))

    config = lora.LoraConfig("query|wo", rank=2, alpha=2.0)
    _, wider = boxed_params(emb_dim=24, num_layers=3)
    other = lora.init_adapters(jax.random.key(0), wider, config)
    with pytest.raises(ValueError, match="another base") as error:
        lora.merge(nn.unbox(boxed), other, config)
    message = str(error.value)
    assert "blocks/layer_0/attn/query: kernel (16, 2, 8), adapters lora_a (24, 2) and lora_b (2, 2, 12)" in message
    assert "blocks/layer_2/mlp/wo: no such kernel" in message


def test_modules_trained_in_full_ride_beside_the_adapters_and_replace_the_base_in_merge():
    """PEFT's modules_to_save: `train_in_full` modules are copied whole into the trained tree (no adapters inside
    them, even where targets match), and `merge` puts the trained values in place of the base's."""
    model, boxed = boxed_params()
    config = lora.LoraConfig("query|lm_head", rank=2, alpha=2.0, train_in_full="lm_head")
    trained = lora.init_adapters(jax.random.key(0), boxed, config)
    assert set(trained) == {"blocks", "lm_head"} and set(trained["lm_head"]) == {"kernel"}
    assert isinstance(trained["lm_head"]["kernel"], nn.Partitioned)  # shards as the base's kernel
    np.testing.assert_array_equal(nn.unbox(trained)["lm_head"]["kernel"], nn.unbox(boxed)["lm_head"]["kernel"])
    assert set(lora.trained_in_full(trained)) == {("lm_head", "kernel")} and lora.count(trained) == (
        16 * 32 + 2 * (16 * 2 + 2 * 2 * 8)
    )
    head = np.full((16, 32), 0.5, np.float32)
    updated = {**nonzero(trained), "lm_head": {"kernel": head}}
    merged = lora.merge(nn.unbox(boxed), updated, config)
    np.testing.assert_array_equal(merged["lm_head"]["kernel"], head)
    query = "blocks", "layer_0", "attn", "query", "kernel"
    assert not np.array_equal(_at(merged, query), _at(nn.unbox(boxed), query))
    logits = forward(model)(merged)
    assert logits.shape == (2, 8, 32) and np.all(np.isfinite(logits))

    with pytest.raises(ValueError, match=r"modules trained in full \(lm_head/kernel\).*export the merged model"):
        peft.save_peft("/nonexistent", trained, config, "llama", TINY)
    with pytest.raises(ValueError, match="train_in_full='score' matches no module"):
        lora.init_adapters(jax.random.key(0), boxed, lora.LoraConfig("query", rank=2, alpha=2.0, train_in_full="score"))
    with pytest.raises(ValueError, match=r"lm_head/kernel: \(16, 32\) in the params, \(16, 8\) trained"):
        lora.merge(nn.unbox(boxed), {**trained, "lm_head": {"kernel": np.zeros((16, 8), np.float32)}}, config)


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return np.asarray(tree)


def _lora_grads(model, config, base, adapters, combine, context=None):
    """(loss, adapter gradients) of a next-token loss on TOKENS with the model run on combine(base, adapters), inside
    `context()` when given."""

    def loss(adapters):
        with context() if context else contextlib.nullcontext():
            logits = model.apply({"params": combine(jax.lax.stop_gradient(base), adapters, config)}, TOKENS[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

    return jax.jit(jax.value_and_grad(loss))(adapters)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_the_training_form_applies_projection_adapters_at_their_inputs_with_the_merged_values_and_gradients(
    scan_layers,
):
    """In `training_form`, `attach` leaves every projection kernel of the layers unmerged with its adapters beside it
    (the module adds x A B), the experts' kernels merged (in the scan, or up front) and the head merged, and the loss
    and adapter gradients equal `merge`'s: attention, a shared expert's MLP, the experts and the head."""
    config = lora.LoraConfig(ALL + "|lm_head", rank=2, alpha=4.0, base_dtype="bfloat16")
    model, boxed = boxed_params(
        scan_layers=scan_layers, remat_policy="full", num_experts=3, experts_per_token=2, shared_expert_mlp_dim=8
    )
    base = lora.freeze(nn.unbox(boxed), config)
    adapters = nonzero(lora.init_adapters(jax.random.key(1), boxed, config))
    with lora.training_form(config, train=False):
        attached = lora.attach(base, adapters, config)
        model.apply({"params": attached}, TOKENS)
    layer = attached["blocks"]["layers" if scan_layers else "layer_1"]
    assert set(layer["attn"]["query"]) == {"kernel", "kernel_lora_a", "kernel_lora_b"}
    assert set(layer["mlp"]["shared"]["wo"]) == {"kernel", "kernel_lora_a", "kernel_lora_b"}
    assert set(attached["lm_head"]) == {"kernel"}  # outside the layers (a loss may read it as a matrix): merged
    experts_kernels = {"wi_0", "wi_0_lora_a", "wi_0_lora_b"} & set(layer["mlp"])
    assert experts_kernels == ({"wi_0", "wi_0_lora_a", "wi_0_lora_b"} if scan_layers else {"wi_0"})

    def context():
        return lora.training_form(config, train=False)

    loss, grads = _lora_grads(model, config, base, adapters, lora.attach, context)
    merged_loss, merged_grads = _lora_grads(model, config, base, adapters, lora.merge)
    np.testing.assert_allclose(loss, merged_loss, rtol=1e-6)
    # x W + (x A) B and x (W + A B) sum in other orders: float32 rounding, measured against each leaf's largest value
    jax.tree.map(
        lambda g, m: np.testing.assert_allclose(g, m, rtol=1e-5, atol=1e-5 * float(np.abs(m).max())),
        grads,
        merged_grads,
    )


def test_the_training_form_merges_a_scanned_stack_layer_by_layer_with_the_merged_values_and_gradients():
    """`attach` (adapters beside a scanned stack's kernels, each layer merging its own inside the scan) gives the loss
    and adapter gradients of `merge`, for attention, a shared expert's MLP, the experts' kernels and a head outside
    the stack."""
    config = lora.LoraConfig(ALL + "|lm_head", rank=2, alpha=4.0, base_dtype="bfloat16")
    model, boxed = boxed_params(
        scan_layers=True, remat_policy="full", num_experts=3, experts_per_token=2, shared_expert_mlp_dim=8
    )
    base = lora.freeze(nn.unbox(boxed), config)
    adapters = nonzero(lora.init_adapters(jax.random.key(1), boxed, config))
    attached = lora.attach(base, adapters, config)
    layer = attached["blocks"]["layers"]
    assert set(layer["attn"]["query"]) == {"kernel", "kernel_lora_a", "kernel_lora_b"}  # merged in the scan
    assert {"wi_0", "wi_0_lora_a", "wi_0_lora_b"} <= set(layer["mlp"])  # the experts' [L, E, D, F] kernels
    assert set(layer["mlp"]["shared"]["wo"]) == {"kernel", "kernel_lora_a", "kernel_lora_b"}
    assert set(attached["lm_head"]) == {"kernel"}  # outside the stack: merged up front
    loss, grads = _lora_grads(model, config, base, adapters, lora.attach)
    merged_loss, merged_grads = _lora_grads(model, config, base, adapters, lora.merge)
    np.testing.assert_allclose(loss, merged_loss, rtol=1e-6)
    jax.tree.map(lambda g, m: np.testing.assert_allclose(g, m, rtol=1e-5, atol=1e-7), grads, merged_grads)


def test_the_training_form_holds_one_layers_merged_kernels_at_a_time():
    """XLA's temporaries for the adapters' gradient through a scanned, rematerialised float32 stack: 8 layers need
    less than 2 more than 2 layers do in `attach`'s form (each layer merges its kernels inside the scan body), while
    `merge`'s form holds every layer's merged kernels and their gradients (8 bytes a kernel parameter) at once."""
    config = lora.LoraConfig(ALL, rank=4, alpha=8.0)
    wide = dict(emb_dim=128, num_heads=4, num_kv_heads=2, mlp_dim=384, remat_policy="full", scan_layers=True)

    def temporaries(num_layers, combine):
        model, boxed = boxed_params(num_layers=num_layers, **wide)
        base = jax.eval_shape(lambda: nn.unbox(boxed))
        adapters = jax.eval_shape(lambda: nn.unbox(lora.init_adapters(jax.random.key(1), boxed, config)))

        def loss(adapters, base):
            logits = model.apply({"params": combine(jax.lax.stop_gradient(base), adapters, config)}, TOKENS)
            return jnp.mean(logits)

        compiled = jax.jit(jax.grad(loss)).lower(adapters, base).compile()
        per_layer = sum(math.prod(k.shape[1:]) for k in lora.find_kernels(boxed, config).values())  # [L, ...]
        return compiled.memory_analysis().temp_size_in_bytes, per_layer

    attached_growth = temporaries(8, lora.attach)[0] - temporaries(2, lora.attach)[0]
    merged_8, kernel_params = temporaries(8, lora.merge)
    merged_growth = merged_8 - temporaries(2, lora.merge)[0]
    layer_bytes = 8 * kernel_params  # one layer's merged kernels and their gradients, float32
    assert merged_growth >= 6 * layer_bytes, (merged_growth, layer_bytes)
    assert attached_growth < 2 * layer_bytes, (attached_growth, layer_bytes)


def test_adapter_dropout_drops_the_adapters_inputs_only_and_only_in_training():
    """A layer's Einsum with A = B = I (rank = width) in `training_form`: x W + dropout(x), each input kept with
    probability 1 - p and scaled by 1 / (1 - p), a new draw per rng; with train=False, x W + x."""
    width, p = 8, 0.25
    config = lora.LoraConfig("proj", rank=width, alpha=float(width), dropout=p)  # scale 1
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32, width)), jnp.float32)
    kernel = jnp.asarray(np.random.default_rng(1).normal(size=(width, width)), jnp.float32)
    params = {"layer_0": {"proj": {"kernel": kernel}}}
    identity = {"layer_0": {"proj": {lora.LORA_A: jnp.eye(width), lora.LORA_B: jnp.eye(width)}}}

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Einsum(shape=(width, width), axes=("embed", "mlp"), name="proj")("BTD,DF->BTF", x)

    class Model(nn.Module):  # a block stack's looped layer: where projections take their adapters at their inputs
        @nn.compact
        def __call__(self, x):
            return Layer(name="layer_0")(x)

    def run(train, seed):
        with lora.training_form(config, train=train):
            attached = lora.attach(params, identity, config)
            return Model().apply({"params": attached}, x, rngs={"dropout": jax.random.key(seed)})

    base = x @ kernel
    np.testing.assert_allclose(run(False, 0) - base, x, rtol=1e-5, atol=1e-5)
    branch = np.asarray(run(True, 0) - base)
    dropped = np.abs(branch) < 1e-5
    np.testing.assert_allclose(branch[~dropped], x[~dropped] / (1 - p), rtol=1e-4, atol=1e-5)
    assert abs(dropped.mean() - p) < 0.02, dropped.mean()
    assert not np.array_equal(dropped, np.abs(np.asarray(run(True, 1) - base)) < 1e-5)


def test_adapters_a_module_does_not_apply_are_an_error_not_dropped():
    """A targeted kernel whose module is neither an Einsum nor an nn.Dense cannot take its adapters at its inputs:
    leaving `training_form` names it rather than training a model that ignores them."""

    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x @ (2.0 * self.param("kernel", nn.initializers.normal(0.1), (4, 4)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Scaled(name="layer_0")(x)

    x = jnp.ones((2, 4))
    params = Model().init(jax.random.key(0), x)["params"]
    config = lora.LoraConfig("layer_0", rank=2, alpha=2.0)
    adapters = lora.init_adapters(jax.random.key(1), params, config)
    with pytest.raises(ValueError, match="attached to the kernels of layer_0, whose modules did not apply them"):
        with lora.training_form(config, train=False):
            Model().apply({"params": lora.attach(params, adapters, config)}, x)
