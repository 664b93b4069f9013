import chex
import numpy as np

from lmzoo.layers import attention


class AttentionMaskTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_padding_queries_see_every_real_key_of_their_row(self):
        segments = np.array([[1, 1, 2, 2, 0, 0]])  # two packed examples, then padding
        mask = self.variant(lambda s: attention.attention_mask(s, s, causal=False))(segments)
        chex.assert_shape(mask, (1, 1, 6, 6))
        first, second, real = [1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]
        np.testing.assert_array_equal(mask[0, 0], np.array([first, first, second, second, real, real], bool))

    @chex.variants(with_jit=True, without_jit=True)
    def test_cross_attention_padding_queries_see_the_real_context(self):
        queries, keys = np.array([[1, 1, 0]]), np.array([[1, 1, 1, 0]])
        mask = self.variant(lambda q, k: attention.attention_mask(q, k, causal=False))(queries, keys)
        np.testing.assert_array_equal(mask[0, 0], np.array([[1, 1, 1, 0]] * 3, bool))
