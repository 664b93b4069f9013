"""Per-example log-likelihoods against a direct computation on the unpadded sequence."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import models, testing
from lmzoo.evaluation import scoring

TINY_T5 = dict(
    vocab_size=32,
    emb_dim=16,
    num_heads=2,
    head_dim=8,
    num_encoder_layers=2,
    num_decoder_layers=2,
    mlp_dim=32,
    dropout_rate=0.0,
    relative_buckets=8,
    relative_max_distance=16,
)


def direct_decoder_score(model, params, context, continuation):
    """Log-prob of `continuation` after `context` from one unpadded forward pass over the last max_len + 1 tokens."""
    tokens = (list(context) + list(continuation))[-(model.config.max_len + 1) :]
    log_probs = jax.nn.log_softmax(model.apply({"params": params}, jnp.asarray([tokens[:-1]]))[0])
    n = len(continuation)
    rows = np.arange(len(tokens) - 1 - n, len(tokens) - 1)
    return float(np.sum(np.asarray(log_probs)[rows, tokens[-n:]]))


def greedy_continuation(model, params, context, n):
    tokens = list(context)
    for _ in range(n):
        tokens.append(int(np.argmax(model.apply({"params": params}, jnp.asarray([tokens]))[0, -1])))
    return tokens[len(context) :]


def test_decoder_loglikelihood_matches_direct_and_flags_greedy():
    model, params = testing.tiny_gpt2()
    rng = np.random.default_rng(0)
    pairs = [
        (rng.integers(0, 32, size=c).tolist(), rng.integers(0, 32, size=n).tolist())
        for c, n in ((1, 1), (5, 3), (3, 7), (30, 4))
    ]
    greedy_context = [3, 1, 4]
    greedy = greedy_continuation(model, params, greedy_context, 4)
    pairs += [(greedy_context, greedy), (greedy_context, greedy[:3] + [(greedy[3] + 1) % 32])]
    totals, is_greedy = scoring.loglikelihoods(model, params, pairs, batch_size=4)
    expected = [direct_decoder_score(model, params, c, n) for c, n in pairs]
    np.testing.assert_allclose(totals, expected, rtol=1e-5, atol=1e-5)
    assert is_greedy.tolist()[-2:] == [True, False]


def test_decoder_loglikelihood_runs_inside_jit():
    model, params = testing.tiny_gpt2()
    batch = scoring.decoder_rows([([1, 2, 3], [4, 5]), ([7], [8, 9, 10])], max_len=16)

    @jax.jit
    def mean_score(params, batch):
        return jnp.mean(
            scoring.decoder_loglikelihood(model, params, batch["inputs"], batch["targets"], batch["weights"])[0]
        )

    expected = np.mean(
        [direct_decoder_score(model, params, [1, 2, 3], [4, 5]), direct_decoder_score(model, params, [7], [8, 9, 10])]
    )
    np.testing.assert_allclose(mean_score(params, batch), expected, rtol=1e-5)


def test_seq2seq_loglikelihood_matches_direct():
    model = models.build_model("seq2seq", TINY_T5)
    params = nn.unbox(
        model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))["params"]
    )
    pairs = [([5, 6, 7, 1], [9, 10]), ([4, 1], [11, 12, 13, 14, 1])]
    totals, _ = scoring.loglikelihoods(model, params, pairs, batch_size=2, length_multiple=8)
    for (inputs, targets), total in zip(pairs, totals, strict=True):
        decoder_inputs = [model.config.decoder_start_id] + targets[:-1]
        logits = model.apply({"params": params}, jnp.asarray([inputs]), jnp.asarray([decoder_inputs]))[0]
        log_probs = np.asarray(jax.nn.log_softmax(logits))
        np.testing.assert_allclose(total, log_probs[np.arange(len(targets)), targets].sum(), rtol=1e-5)


def test_rolling_windows_cover_every_token_once():
    ids = list(range(100, 140))
    for stride in (None, 5):
        windows = scoring.rolling_windows(ids, max_len=16, prefix_id=0, stride=stride)
        assert sum((continuation for _, continuation in windows), []) == ids
        assert all(len(c) + len(n) == 17 for c, n in windows[1:]) and windows[0][0] == [0]
    with pytest.raises(ValueError, match="stride"):
        scoring.rolling_windows(ids, max_len=16, prefix_id=0, stride=17)


def test_rolling_loglikelihood_sums_its_windows():
    model, params = testing.tiny_gpt2()
    ids = testing.random_tokens((1, 40), seed=3)[0].tolist()
    short = ids[:10]
    np.testing.assert_allclose(
        scoring.rolling_loglikelihood(model, params, short, prefix_id=0),
        direct_decoder_score(model, params, [0], short),
        rtol=1e-5,
    )
    # lm-eval's windows: tokens 0-15 after the prefix, 16-31 after token 15, 32-39 after tokens 23-31.
    expected = (
        direct_decoder_score(model, params, [0], ids[:16])
        + direct_decoder_score(model, params, ids[15:16], ids[16:32])
        + direct_decoder_score(model, params, ids[23:32], ids[32:])
    )
    np.testing.assert_allclose(scoring.rolling_loglikelihood(model, params, ids, prefix_id=0), expected, rtol=1e-5)


def test_bad_requests_raise_before_scoring():
    model, params = testing.tiny_gpt2()
    with pytest.raises(ValueError, match="context is empty"):
        scoring.loglikelihoods(model, params, [([], [1])])
    with pytest.raises(ValueError, match="max_len=16"):
        scoring.loglikelihoods(model, params, [([1], list(range(17)))])
    encoder = models.build_model(
        "bert", dict(vocab_size=32, emb_dim=16, num_heads=2, num_layers=1, mlp_dim=32, max_len=16)
    )
    with pytest.raises(ValueError, match="decoder"):
        scoring.loglikelihoods(encoder, {}, [([1], [2])])
