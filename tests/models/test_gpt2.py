import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo import kernels, models, testing
from lmzoo.layers import blocks


def test_shapes_and_hidden():
    model, params = testing.tiny_gpt2()
    tokens = testing.random_tokens()
    logits, hidden = model.apply({"params": params}, tokens, return_hidden=True)
    chex.assert_shape(logits, (2, 8, 32))
    chex.assert_shape(hidden, (2, 8, 16))


@pytest.mark.parametrize("pre_norm", [True, False])
def test_causal_future_tokens_never_change_past_logits(pre_norm):
    model, params = testing.tiny_gpt2(pre_norm=pre_norm)
    tokens = testing.random_tokens()
    changed = tokens.copy()
    changed[:, 5:] = (changed[:, 5:] + 7) % 32
    a = model.apply({"params": params}, tokens)
    b = model.apply({"params": params}, changed)
    np.testing.assert_allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert np.abs(np.asarray(a[:, 5:] - b[:, 5:])).max() > 1e-3


def test_packed_documents_do_not_attend_across_boundaries():
    model, params = testing.tiny_gpt2()
    doc_a, doc_b = testing.random_tokens((1, 3), seed=1), testing.random_tokens((1, 5), seed=2)
    packed = np.concatenate([doc_a, doc_b], axis=1)
    segments = np.array([[1, 1, 1, 2, 2, 2, 2, 2]])
    positions = np.array([[0, 1, 2, 0, 1, 2, 3, 4]])
    logits = model.apply({"params": params}, packed, positions=positions, segment_ids=segments)
    alone_a = model.apply({"params": params}, doc_a)
    alone_b = model.apply({"params": params}, doc_b)
    np.testing.assert_allclose(logits[:, :3], alone_a, atol=1e-5)
    np.testing.assert_allclose(logits[:, 3:], alone_b, atol=1e-5)


def test_kv_cache_decoding_equals_full_forward():
    model, params = testing.tiny_gpt2()
    tokens = testing.random_tokens((2, 10))
    full = model.apply({"params": params}, tokens)
    cache = model.init(jax.random.key(0), jnp.zeros((2, 10), jnp.int32), decode=True)["cache"]
    # Prefill 4 tokens in one chunk, then one token at a time.
    out, vars_ = model.apply({"params": params, "cache": cache}, tokens[:, :4], decode=True, mutable=["cache"])
    pieces = [out]
    for t in range(4, 10):
        out, vars_ = model.apply(
            {"params": params, "cache": vars_["cache"]},
            tokens[:, t : t + 1],
            positions=np.full((2, 1), t),
            decode=True,
            mutable=["cache"],
        )
        pieces.append(out)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5)


def test_scan_and_remat_match_python_loop():
    model, params = testing.tiny_gpt2()
    scanned = models.build_model("gpt2", {**testing.TINY_GPT2, "scan_layers": True, "remat_policy": "full"})
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[params["blocks"][f"layer_{i}"] for i in range(2)])
    scan_params = {**{k: v for k, v in params.items() if k != "blocks"}, "blocks": {"layers": stacked}}
    tokens = testing.random_tokens()
    np.testing.assert_allclose(
        scanned.apply({"params": scan_params}, tokens), model.apply({"params": params}, tokens), atol=1e-5
    )


def _remat_policies(jaxpr) -> list:
    """The policy of every rematerialisation in `jaxpr` and the jaxprs inside it (a scan's body, a remat's own)."""
    found = []
    for eqn in jaxpr.eqns:
        if "policy" in eqn.params:
            found.append(eqn.params["policy"])
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += _remat_policies(inner)
    return found


def test_auto_remat_keeps_every_activation_on_the_cpu_and_the_projections_on_accelerators():
    """remat_policy "auto" (the base-size configs') is decided by the platform the step is traced for
    (`kernels.remat_policy`), with the same gradients."""
    policies, grads = {}, {}
    for platform in ("cpu", "gpu"):
        # A model of its own for each platform: a module traced again reuses its first scan body, policy included.
        model = models.build_model("gpt2", {**testing.TINY_GPT2, "scan_layers": True, "remat_policy": "auto"})
        params = nn.unbox(model.init(jax.random.key(0), testing.random_tokens())["params"])
        grad = jax.grad(lambda p, model=model: model.apply({"params": p}, testing.random_tokens()).sum())
        with kernels.use_platform(platform):
            policies[platform] = _remat_policies(jax.make_jaxpr(grad)(params).jaxpr)
            grads[platform] = grad(params)
    assert policies["cpu"] == [] and policies["gpu"]
    assert all(policy == blocks.REMAT_POLICIES["dots_no_batch"] for policy in policies["gpu"])
    chex.assert_trees_all_close(grads["gpu"], grads["cpu"], atol=1e-5)
    assert kernels.remat_policy("full") == "full"  # a named policy is every platform's


def test_out_of_range_token_ids_poison_the_output():
    model, params = testing.tiny_gpt2()
    tokens = testing.random_tokens()
    tokens[0, 3] = 32
    with pytest.raises(ValueError, match=r"token ids span \[\d+, 32\] but the embedding table has 32 rows"):
        model.apply({"params": params}, tokens)
    logits = jax.jit(model.apply)({"params": params}, tokens)
    assert np.isnan(np.asarray(logits[0])).any()
    assert np.isfinite(np.asarray(logits[1])).all()


def test_gpt2_small_parameter_count():
    model = models.build_model(
        "gpt2", dict(vocab_size=50257, max_len=1024, emb_dim=768, num_heads=12, num_layers=12, mlp_dim=3072)
    )
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(shapes)))
    assert count == 124_439_808  # HF GPT2LMHeadModel('gpt2'), tied head


def test_residual_projections_use_scaled_init():
    model, params = testing.tiny_gpt2(num_layers=8, emb_dim=64, mlp_dim=256)
    wo = np.asarray(nn.unbox(params)["blocks"]["layer_0"]["mlp"]["wo"]["kernel"])
    wi = np.asarray(nn.unbox(params)["blocks"]["layer_0"]["mlp"]["wi"]["kernel"])
    assert abs(wi.std() - 0.02) < 0.002
    assert abs(wo.std() - 0.02 / 4.0) < 0.001


def test_config_errors_name_valid_keys():
    with pytest.raises(ValueError, match="valid keys"):
        models.build_model("gpt2", {"emb_dimm": 3})
    with pytest.raises(ValueError, match="registered models"):
        models.build_model("gpt5", {})
    with pytest.raises(ValueError, match="divisible"):
        models.build_model("gpt2", {"emb_dim": 10, "num_heads": 3})


@pytest.mark.parametrize("jit", [False, True])
def test_inputs_longer_than_the_position_table_raise(jit):
    model, params = testing.tiny_gpt2()  # max_len 16
    apply = jax.jit(model.apply) if jit else model.apply
    chex.assert_shape(apply({"params": params}, testing.random_tokens((2, 16))), (2, 16, 32))
    with pytest.raises(
        ValueError, match=r"GPT-2 input length 17 does not fit the learned position table \(max_len=16\)"
    ):
        apply({"params": params}, testing.random_tokens((2, 17)))
