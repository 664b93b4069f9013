"""LSTM LM: truncated BPTT carry, gradient against finite differences, stream batching, generation, and the
recurrent_lm objective through the real loop (train, resume, evaluate with its own carry)."""

import dataclasses
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lmzoo import sharding, testing
from lmzoo.data import loaders
from lmzoo.models import lstm
from lmzoo.objectives import recurrent_lm
from lmzoo.train import loop
from lmzoo.train import run as run_lib
from lmzoo.trainers import base as trainer_lib
from lmzoo.trainers import supervised

CONFIG = lstm.LSTMConfig(vocab_size=13, emb_dim=8, num_layers=2, init_scale=0.3)


def _windows(stream: np.ndarray, window: int) -> list[dict]:
    """Consecutive windows of every row's stream [B, N + 1]."""
    return [
        loaders.window(stream, np.ones((stream.shape[0], stream.shape[1] - 1), np.float32), i, window)
        for i in range((stream.shape[1] - 1) // window)
    ]


def _compiled(batch_size: int, window: int):
    task = recurrent_lm.recurrent_lm_task(lstm.LSTM(CONFIG), sum_over_time=True)
    schedule = recurrent_lm.epoch_decay_schedule(1.0, 0, 4, 0.5)
    shapes = {"inputs": jax.ShapeDtypeStruct((batch_size, window), np.int32)}
    trainer = supervised.SupervisedTrainer(task, optax.sgd(schedule), schedule, shapes)
    return trainer_lib.compile_trainer(trainer, mesh=sharding.make_mesh(), rules=sharding.axis_rules(), seed=0)


def test_carry_over_consecutive_windows_equals_one_pass():
    stream = np.random.default_rng(0).integers(0, 13, size=(4, 4 * 5 + 1)).astype(np.int32)
    compiled = _compiled(4, 5)
    with compiled.context():
        state = compiled.init(jax.random.key(0))
        carry, total = compiled.initial_carry(4), np.zeros(2)
        for batch in _windows(stream, 5):
            metrics, carry = compiled.eval_step(state, sharding.put_batch(batch, compiled.batch_sharding), carry)
            total += np.asarray(jax.device_get(metrics["loss"]))
    model = lstm.LSTM(CONFIG)
    params = jax.device_get(state.params)
    logits, whole_carry = model.apply({"params": params}, stream[:, :-1], model.initial_carry(4))
    log_probs = jax.nn.log_softmax(logits)
    nll = -np.sum(np.take_along_axis(np.asarray(log_probs), stream[:, 1:, None], axis=-1))
    np.testing.assert_allclose(total, [nll, stream[:, 1:].size], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), jax.device_get(carry), jax.device_get(whole_carry)
    )


def test_reset_zeroes_the_carry_at_an_epoch_start():
    task = recurrent_lm.recurrent_lm_task(lstm.LSTM(CONFIG), sum_over_time=False)
    tokens = np.random.default_rng(1).integers(0, 13, size=(2, 6)).astype(np.int32)
    batch = loaders.window(tokens, np.ones((2, 5), np.float32), 0, 5)
    params = nn.unbox(task.init(jax.random.key(0), batch)[0])
    stale = jax.tree.map(lambda x: x + 0.7, lstm.LSTM(CONFIG).initial_carry(2))
    fresh = jax.tree.map(jnp.asarray, lstm.LSTM(CONFIG).initial_carry(2))
    after_stale = task.loss(params, {}, stale, batch, jax.random.key(0), step=0, train=False)
    after_fresh = task.loss(params, {}, fresh, batch, jax.random.key(0), step=0, train=False)
    np.testing.assert_allclose(after_stale[0], after_fresh[0], rtol=1e-6)
    continued = task.loss(
        params, {}, stale, {**batch, "reset": np.zeros(2, np.float32)}, jax.random.key(0), step=0, train=False
    )
    assert abs(float(continued[0]) - float(after_fresh[0])) > 1e-4


def test_gradient_through_a_window_matches_finite_differences():
    with jax.enable_x64(True):
        model = lstm.LSTM(dataclasses.replace(CONFIG, dtype="float64"))
        rng = np.random.default_rng(2)
        tokens = rng.integers(0, 13, size=(2, 7))
        params = jax.tree.map(
            lambda x: x.astype(jnp.float64),
            nn.unbox(model.init(jax.random.key(1), tokens[:, :-1], model.initial_carry(2))["params"]),
        )
        carry = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.5), model.initial_carry(2))

        @jax.jit
        def nll(p):
            logits, _ = model.apply({"params": p}, tokens[:, :-1], carry)
            return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

        grads = jax.grad(nll)(params)
        eps = 1e-6
        for path in (("layer_0", "wh"), ("layer_1", "wi"), ("layer_0", "bias"), ("embedding",), ("out",)):
            leaf, grad = params, grads
            for key in path:
                leaf, grad = leaf[key], grad[key]
            for index in [tuple(rng.integers(0, s) for s in leaf.shape) for _ in range(3)]:

                def shifted(delta, path=path, index=index):
                    tree = jax.tree.map(lambda x: x, params)
                    node = tree
                    for key in path[:-1]:
                        node = node[key]
                    node[path[-1]] = node[path[-1]].at[index].add(delta)
                    return nll(tree)

                numeric = (shifted(eps) - shifted(-eps)) / (2 * eps)
                np.testing.assert_allclose(grad[index], numeric, rtol=1e-5, atol=1e-8)


def test_stream_rows_and_batches_cover_every_target_once():
    tokens = np.arange(50, dtype=np.int32)
    loader = loaders.StreamLoader(tokens, batch_size=3, seq_len=4)
    # 49 targets over 3 rows: 16 each (tail dropped); epoch = (17 - 1) // 4 = 4 windows.
    assert loader.windows_per_epoch == 4
    first, second, wrapped = loader.batch(0), loader.batch(1), loader.batch(4)
    np.testing.assert_array_equal(first["inputs"][1], [16, 17, 18, 19])
    np.testing.assert_array_equal(second["inputs"][1], [20, 21, 22, 23])  # row 1 continues where it stopped
    np.testing.assert_array_equal(first["targets"][2], [33, 34, 35, 36])
    np.testing.assert_array_equal(first["reset"], 1.0)
    np.testing.assert_array_equal(second["reset"], 0.0)
    np.testing.assert_array_equal(wrapped["inputs"], first["inputs"])
    for seq_len in (4, 5):  # 17 targets a row: a partial last window either way
        batches = list(loaders.stream_eval_batches(tokens, 3, seq_len, loaders.Shard()))
        assert all(b[k].shape == (3, seq_len) for b in batches for k in ("inputs", "targets", "weights"))
        scored = np.concatenate([b["targets"][b["weights"] > 0] for b in batches])
        np.testing.assert_array_equal(np.sort(scored), np.arange(1, 50))


def test_generate_draws_the_argmax_at_temperature_zero():
    model = lstm.LSTM(CONFIG)
    prompt = np.array([[1, 2], [3, 4]], np.int32)
    params = model.init(jax.random.key(0), prompt, model.initial_carry(2))["params"]
    drawn = np.asarray(lstm.generate(model, params, prompt, jax.random.key(0), max_new_tokens=3, temperature=0.0))
    sequence = prompt
    for _ in range(3):
        logits, _ = model.apply({"params": params}, sequence, model.initial_carry(2))
        sequence = np.concatenate([sequence, np.argmax(logits[:, -1], axis=-1)[:, None]], axis=1)
    np.testing.assert_array_equal(drawn, sequence[:, 2:])


def _tiny_ptb(tmp_path: pathlib.Path):
    config, _ = testing.tiny_word_corpus_config(
        tmp_path, "ptb_lstm", num_words=30, lines=(120, 20), words_per_line=(3, 9), ptb_spacing=True
    )
    config.data.seq_len, config.train.batch_size, config.eval.batch_size = 5, 4, 4
    return config


def test_recurrent_lm_trains_resumes_and_evaluates_through_the_loop(tmp_path):
    config = _tiny_ptb(tmp_path)
    wrong = _tiny_ptb(tmp_path)
    wrong.objective.epoch_steps = 1
    with pytest.raises(ValueError, match="epoch_steps=1, but an epoch of this data is [0-9]+ steps"):
        loop.train_and_evaluate(wrong, str(tmp_path / "wrong_epoch"))
    straight = loop.train_and_evaluate(config, str(tmp_path / "straight"))
    config.train.steps = 2
    loop.train_and_evaluate(config, str(tmp_path / "resumed"))
    config.train.steps = 4
    resumed = loop.train_and_evaluate(config, str(tmp_path / "resumed"))
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-5)
    assert straight["perplexity"] < 32  # better than uniform over the vocabulary after 4 SGD steps
    _, state = run_lib.restore_step(run_lib.open_run(str(tmp_path / "resumed")))
    assert state.carry["h"].shape == (4, 2, 16) and np.abs(state.carry["h"]).sum() > 0


def test_learning_rate_halves_each_epoch_after_the_fourth():
    schedule = recurrent_lm.epoch_decay_schedule(1.0, 10, 4, 0.5)
    rates = [float(schedule(epoch * 10 + 9)) for epoch in range(7)]
    assert rates == [1.0, 1.0, 1.0, 1.0, 0.5, 0.25, 0.125]


def test_negative_id_gives_nan_not_another_words_embedding():
    """LSTM LM, VAE-LM and biLM look tokens up with layers.embed_lookup: -1 must not read the last row (traced)."""
    from lmzoo.models import elmo, vae_lm

    tokens = jnp.array([[1, 2, -1, 3]])
    weights = jnp.ones(tokens.shape, jnp.float32)
    model = lstm.LSTM(lstm.LSTMConfig(vocab_size=8, emb_dim=4, num_layers=1))
    carry = model.initial_carry(1)
    valid = jnp.abs(tokens)  # init with in-range ids: concrete out-of-range ids are an error
    params = model.init(jax.random.key(0), valid, carry)
    logits, _ = jax.jit(model.apply)(params, tokens, carry)
    assert np.isfinite(logits[0, :2]).all() and np.isnan(logits[0, 2:]).all()
    vae = vae_lm.VAELM(vae_lm.VAELMConfig(vocab_size=8, emb_dim=4, latent_dim=2))
    variables = vae.init(jax.random.key(0), valid, valid, weights, rng=jax.random.key(1))
    applied = jax.jit(vae.apply)(variables, tokens, tokens, weights, rng=jax.random.key(1))
    assert np.isnan(jax.tree.leaves(applied)[0]).any()
    bilm = elmo.BiLM(elmo.ELMoConfig(vocab_size=8, emb_dim=4, num_layers=1))
    forward_logits = jax.jit(bilm.apply)(bilm.init(jax.random.key(0), valid, weights), tokens, weights)[0]
    assert np.isfinite(forward_logits[0, :2]).all() and np.isnan(forward_logits[0, 2:]).all()
