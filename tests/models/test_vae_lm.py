"""VAE-LM: closed-form KL, the importance-weighted bound against the ELBO, annealing and free bits, and the
vae_lm objective with its "latent" evaluator through the real loop."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import testing
from lmzoo.models import vae_lm
from lmzoo.objectives import vae_lm as vae_lm_objective
from lmzoo.train import loop
from lmzoo.train import run as run_lib

CONFIG = vae_lm.VAELMConfig(vocab_size=11, emb_dim=8, latent_dim=3, init_scale=0.8)


def test_kl_of_the_prior_to_itself_is_zero_and_matches_monte_carlo():
    zeros = jnp.zeros((4, 3))
    np.testing.assert_array_equal(vae_lm.gaussian_kl(zeros, zeros), 0.0)
    mu, logvar = jnp.array([0.5, -1.0, 2.0]), jnp.array([0.3, -1.2, 0.0])
    z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(jax.random.key(0), (400_000, 3))
    zero = jnp.zeros(3)
    monte_carlo = jnp.mean(vae_lm.gaussian_log_density(z, mu, logvar) - vae_lm.gaussian_log_density(z, zero, zero))
    np.testing.assert_allclose(jnp.sum(vae_lm.gaussian_kl(mu, logvar)), monte_carlo, rtol=1e-2)


def _batch():
    rng = np.random.default_rng(0)
    targets = rng.integers(0, 10, size=(4, 6)).astype(np.int32)
    weights = (np.arange(6) < np.array([[6], [4], [5], [2]])).astype(np.float32)
    targets[np.arange(4), weights.sum(1).astype(int) - 1] = 10  # each sentence ends in <eos> = 10
    return vae_lm_objective.with_inputs({"targets": targets, "weights": weights}, 10)


def test_importance_weighted_bound_is_above_the_elbo_and_tightens_with_k():
    model = vae_lm.VAELM(CONFIG)
    batch = _batch()
    params = model.init(jax.random.key(1), batch["targets"], batch["inputs"], batch["weights"], rng=jax.random.key(2))[
        "params"
    ]
    repeats = 16  # every sentence 16 times in one batch: independent samples, one call per K
    tiled = jax.tree.map(lambda x: np.tile(x, (repeats, 1)), batch)
    means = {}
    for k in (1, 5, 50):
        iw, bound, _, _ = vae_lm_objective.importance_weighted_bound(
            model, params, tiled, jax.random.key(k), num_samples=k
        )
        means[k] = np.asarray(iw).reshape(repeats, -1).mean(axis=0)  # [B]: E[IW_k] per sentence
        if k == 50:
            elbo_estimate = np.asarray(bound).reshape(repeats, -1).mean(axis=0)
    assert np.all(means[50] > elbo_estimate)
    assert means[50].sum() > means[5].sum() > means[1].sum()  # summed over sentences: the gaps exceed the noise
    np.testing.assert_allclose(means[1], elbo_estimate, atol=0.05 * np.abs(elbo_estimate).max())


def test_trailing_padding_changes_no_sentence_bound():
    """What lets the loaders cut each batch to its longest sentence: the bound of a sentence is the same at any width."""
    model = vae_lm.VAELM(CONFIG)
    batch = _batch()
    wide = vae_lm_objective.with_inputs({k: np.pad(batch[k], ((0, 0), (0, 10))) for k in ("targets", "weights")}, 10)
    params = model.init(jax.random.key(1), batch["targets"], batch["inputs"], batch["weights"], rng=jax.random.key(2))[
        "params"
    ]
    narrow_bound = vae_lm_objective.importance_weighted_bound(model, params, batch, jax.random.key(3), num_samples=4)
    wide_bound = vae_lm_objective.importance_weighted_bound(model, params, wide, jax.random.key(3), num_samples=4)
    for narrow, wide in zip(narrow_bound, wide_bound, strict=True):
        np.testing.assert_allclose(np.asarray(narrow), np.asarray(wide), rtol=1e-6, atol=1e-6)


def test_without_a_latent_the_bound_is_the_decoders_exact_likelihood():
    model = vae_lm.VAELM(dataclasses.replace(CONFIG, latent_dim=0))
    batch = _batch()
    params = model.init(jax.random.key(1), batch["targets"], batch["inputs"], batch["weights"], rng=jax.random.key(2))[
        "params"
    ]
    assert set(params) == {"embedding", "decoder", "out"}  # no encoder, no zero-size kernels
    iw, bound, mu, kl = vae_lm_objective.importance_weighted_bound(
        model, params, batch, jax.random.key(3), num_samples=3
    )
    zeros = jnp.zeros((4, CONFIG.emb_dim))
    logits, _ = model.apply({"params": params}, mu, batch["inputs"], (zeros, zeros), method=model.decode)
    np.testing.assert_allclose(np.asarray(iw), -np.asarray(vae_lm_objective.sentence_nll(logits, batch)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(bound), np.asarray(iw), rtol=1e-6)
    assert mu.shape == (4, 0) and np.all(np.asarray(kl) == 0)


def test_kl_annealing_and_free_bits():
    assert [float(vae_lm_objective.kl_weight(s, 4)) for s in (0, 2, 4, 9)] == [0.0, 0.5, 1.0, 1.0]
    assert float(vae_lm_objective.kl_weight(0, 0)) == 1.0
    kl = jnp.array([[0.1, 2.0], [0.3, 1.0]])  # per-dimension batch means 0.2 and 1.5
    assert float(vae_lm_objective.kl_term(kl, 0.0)) == pytest.approx(3.4)
    assert float(vae_lm_objective.kl_term(kl, 0.5)) == pytest.approx((0.5 + 1.5) * 2)


def test_word_dropout_replaces_only_real_decoder_inputs_after_the_first():
    batch = {k: np.tile(v, (200, 1)) for k, v in _batch().items() if k != "inputs"}  # 800 sentences, 3,400 real words
    dropped = vae_lm_objective.with_dropped_words(
        batch, np.random.default_rng(0), bos_id=10, word_dropout=0.3, unk_id=99
    )
    kept = vae_lm_objective.with_inputs(batch, 10)
    np.testing.assert_array_equal(dropped["targets"], batch["targets"])
    changed = dropped["inputs"] != kept["inputs"]
    assert np.all(dropped["inputs"][changed] == 99)
    assert not changed[:, 0].any() and not changed[batch["weights"] == 0].any()
    eligible = (batch["weights"] > 0)[:, 1:]
    assert changed[:, 1:][eligible].mean() == pytest.approx(0.3, abs=0.03)
    again = vae_lm_objective.with_dropped_words(batch, np.random.default_rng(0), bos_id=10, word_dropout=0.3, unk_id=99)
    np.testing.assert_array_equal(again["inputs"], dropped["inputs"])
    off = vae_lm_objective.with_dropped_words(batch, np.random.default_rng(0), bos_id=10, word_dropout=0.0, unk_id=None)
    np.testing.assert_array_equal(off["inputs"], kept["inputs"])


def test_word_dropout_in_the_training_loader_only(tmp_path):
    config, _ = testing.tiny_word_corpus_config(tmp_path, "ptb_vae")
    config.objective.word_dropout = 0.5
    run = run_lib.build(config, str(tmp_path / "run"))
    unk = run.tokenizer.unk_id
    loader = run.train_loader()
    first, again = loader.batch(3), loader.batch(3)
    np.testing.assert_array_equal(first["inputs"], again["inputs"])  # a function of the step: resumes exactly
    real = first["weights"][:, 1:] > 0
    assert 0.3 < np.mean(first["inputs"][:, 1:][real] == unk) < 0.7  # <unk> is ~1/15 of the corpus itself
    for batch in run.eval_batches("validation"):
        np.testing.assert_array_equal(
            batch["inputs"], vae_lm_objective.with_inputs(batch, run.tokenizer.eos_id)["inputs"]
        )
    run.close()


def test_vae_lm_trains_with_annealing_and_reports_latent_metrics(tmp_path):
    config, _ = testing.tiny_word_corpus_config(tmp_path, "ptb_vae")
    final = loop.train_and_evaluate(config, str(tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kl_weight"] for r in rows if r["split"] == "train"] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert final["kl"] > 0 and final["reconstruction"] < final["loss"]
    run = run_lib.open_run(str(tmp_path / "run"))
    _, state = run_lib.restore_step(run)
    metrics, examples = elbo_evaluator(run, state)
    assert 0 <= metrics["active_units"] <= 4 and metrics["iw_samples"] == 5
    assert metrics["iw_perplexity"] <= metrics["elbo_perplexity"] * 1.05
    assert (
        len([e for e in examples if "interpolation" in e]) == 5
        and len([e for e in examples if "prior_sample" in e]) == 3
    )


def elbo_evaluator(run, state):
    from lmzoo import evaluation

    return evaluation.EVALUATORS["latent"](run, state, "validation", max_batches=2)
