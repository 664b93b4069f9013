"""The fused head + cross-entropy equals the plain logits loss in value, accuracy and gradients (computed in its forward
pass), also when only the hidden states or only the embedding are differentiated."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from lmzoo import models, testing
from lmzoo.objectives import losses

TINY = dict(vocab_size=97, max_len=16, emb_dim=32, num_heads=2, num_layers=2, mlp_dim=64, dropout_rate=0.0)


def _batch(length=12):
    tokens = testing.random_tokens((3, length + 1), vocab_size=97, seed=0)
    weights = (np.random.default_rng(1).random((3, length)) > 0.3).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


@pytest.mark.parametrize(("tie_embeddings", "chunk_len"), [(True, None), (True, 1), (False, 4)])
def test_fused_head_loss_matches_plain_loss_and_gradients(tie_embeddings, chunk_len):
    model = models.build_model("gpt2", TINY | {"tie_embeddings": tie_embeddings})
    batch = _batch()
    params = nn.unbox(model.init(jax.random.key(0), batch["inputs"])["params"])

    def plain(p):
        return losses.token_loss(model.apply({"params": p}, batch["inputs"]), batch)

    def fused(p):
        _, hidden = model.apply({"params": p}, batch["inputs"], return_hidden=True)
        embedding = model.apply({"params": p}, method=model.output_embedding)
        return losses.fused_head_loss(hidden, embedding, batch, chunk_len=chunk_len)

    (plain_value, plain_metrics), plain_grads = jax.value_and_grad(plain, has_aux=True)(params)
    (fused_value, fused_metrics), fused_grads = jax.jit(jax.value_and_grad(fused, has_aux=True))(params)
    np.testing.assert_allclose(fused_value, plain_value, rtol=1e-6)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(jnp.stack(fused_metrics[name]), jnp.stack(plain_metrics[name]), rtol=1e-6)
    chex.assert_trees_all_close(fused_grads, plain_grads, atol=1e-6)


@pytest.mark.parametrize("differentiated", ["hidden", "embedding"])
def test_fused_head_loss_gradient_of_one_input(differentiated):
    """With the other input held constant (not perturbed), the one gradient still equals the plain loss's, and the
    other's is not computed."""
    rng = np.random.default_rng(2)
    hidden, embedding = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((3, 12, 32), (97, 32)))
    batch = _batch()

    def plain(h, e):
        return losses.token_loss(jnp.einsum("BTD,VD->BTV", h, e), batch)[0]

    def fused(h, e):
        return losses.fused_head_loss(h, e, batch, chunk_len=4)[0]

    argnum = {"hidden": 0, "embedding": 1}[differentiated]
    expected = jax.grad(plain, argnums=argnum)(hidden, embedding)
    chex.assert_trees_all_close(jax.jit(jax.grad(fused, argnums=argnum))(hidden, embedding), expected, atol=1e-6)
    # The other input's gradient is not computed: the logits' matmul and this input's, not the third.
    assert str(jax.make_jaxpr(jax.grad(fused, argnums=argnum))(hidden, embedding)).count("dot_general") == 2
    assert str(jax.make_jaxpr(jax.grad(fused, argnums=(0, 1)))(hidden, embedding)).count("dot_general") == 3


def test_chunk_len_must_divide_the_length():
    with pytest.raises(ValueError, match="must divide the sequence length 12"):
        losses.fused_head_loss(jnp.zeros((3, 12, 32)), jnp.zeros((97, 32)), _batch(), chunk_len=5)


def test_default_chunk_fits_the_budget():
    assert losses.head_loss_chunk_len(16, 256, 8192, budget_bytes=8 << 20) == 16
    assert losses.head_loss_chunk_len(1, 7, 10**9) == 1
