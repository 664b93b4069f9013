import chex
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo.objectives import distill


class DistillationTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_soft_cross_entropy_is_kl_plus_teacher_entropy_times_t_squared(self):
        s, t = jax.random.normal(jax.random.key(0), (2, 3, 7)), jax.random.normal(jax.random.key(1), (2, 3, 7))
        w = jnp.array([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
        total, count = self.variant(distill.soft_cross_entropy, static_argnums=3)(s, t, w, 2.0)
        p = jax.nn.softmax(t / 2.0)
        kl = jnp.sum(p * (jnp.log(p) - jax.nn.log_softmax(s / 2.0)), -1)
        entropy = -jnp.sum(p * jnp.log(p), -1)
        np.testing.assert_allclose(total, jnp.sum((kl + entropy) * 4.0 * w), rtol=1e-5)
        assert count == 4.0

    @chex.variants(with_jit=True, without_jit=True)
    def test_cosine_loss(self):
        h = jax.random.normal(jax.random.key(0), (2, 4, 5))
        same, _ = self.variant(distill.cosine_loss)(h, 3.0 * h, jnp.ones((2, 4)))
        opposite, count = self.variant(distill.cosine_loss)(h, -h, jnp.ones((2, 4)))
        np.testing.assert_allclose(same, 0.0, atol=1e-5)
        np.testing.assert_allclose(opposite / count, 2.0, atol=1e-5)
