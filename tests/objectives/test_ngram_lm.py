"""The ngram_lm objective: counting in JAX equals lmzoo.models.ngram's counts, and train.py's fit scored by the
loop equals the direct fit (Kneser-Ney and add-k), with resume and clear errors for bad settings."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import testing
from lmzoo.data import loaders, pipeline
from lmzoo.models import ngram
from lmzoo.tokenizers import WordTokenizer
from lmzoo.train import loop
from lmzoo.train import run as run_lib
from lmzoo.trainers import counting


def _sentences(seed: int, count: int, vocab: int = 12, eos: int = 12) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate(
        [np.append(np.minimum(rng.zipf(1.6, size=rng.integers(1, 7)), vocab) - 1, eos) for _ in range(count)]
    )


def test_merging_batches_into_the_table_equals_counting_the_stream():
    order, eos, vocab = 3, 12, 13
    stream = _sentences(0, 48)  # three batches of 16: one compilation
    ids, weights = loaders.sentence_rows(stream, eos, max_len=8)
    table = jnp.zeros((256, order), jnp.int32), jnp.zeros((256,), jnp.float32)
    merge = jax.jit(functools.partial(counting.merge_into_table, vocab_size=vocab))
    for first in range(0, len(ids), 16):
        batch = jnp.asarray(ids[first : first + 16])
        rows = counting.history_rows(batch, order=order, eos_id=eos).reshape(-1, order)
        *table, distinct = merge(*table, rows, jnp.asarray(weights[first : first + 16]).reshape(-1))
    expected = ngram.count_ngrams(stream, order=order, eos_id=eos)
    used = np.asarray(table[1]) > 0
    assert int(distinct) == used.sum() == len(expected["counts"])
    np.testing.assert_array_equal(np.asarray(table[0])[used], expected["ngrams"])
    np.testing.assert_array_equal(np.asarray(table[1])[used], expected["counts"])


def _rows_of_lengths(lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Sentence rows with the given lengths; row i holds the id i + 1 throughout, to find it in a batch."""
    weights = (np.arange(max_len) < lengths[:, None]).astype(np.float32)
    return np.where(weights > 0, np.arange(len(lengths))[:, None] + 1, 0).astype(np.int32), weights


def test_length_bucketed_batches_read_each_sentence_once_an_epoch_and_cut_the_padding():
    count, size, max_len = 96, 8, 40
    lengths = np.random.default_rng(0).integers(1, max_len + 1, size=count)
    ids, weights = _rows_of_lengths(lengths, max_len)

    def shuffled(pool_batches, length_multiple=8, **shard):
        loader = loaders.SentenceLoader(ids, weights, size, **shard, length_multiple=length_multiple)
        return loaders.ShuffledSentences(loader, seed=3, pool_batches=pool_batches)

    sorted_pools, unsorted = shuffled(4), shuffled(1)
    for epoch in range(2):
        batches = [sorted_pools.batch(step) for step in range(epoch * count // size, (epoch + 1) * count // size)]
        seen = np.concatenate([b["targets"][:, 0] - 1 for b in batches])
        assert sorted(seen) == list(range(count))
        for b in batches:
            longest = int(lengths[b["targets"][:, 0] - 1].max())
            assert b["targets"].shape == b["weights"].shape == (size, min(max_len, -(-longest // 8) * 8))
            np.testing.assert_array_equal(b["weights"].sum(1), lengths[b["targets"][:, 0] - 1])
        # Sorted pools: a batch's lengths are close, so its padded area is well below that of unsorted batches.
        unsorted_area = sum(unsorted.batch(step)["weights"].size for step in range(count // size))
        assert sum(b["weights"].size for b in batches) < 0.8 * unsorted_area
    # Pools of one batch: the sentences of an epoch permutation, uncut without length_multiple.
    _, order = pipeline.epoch_permutation(np.arange(size, 2 * size), count, 3)
    assert sorted(shuffled(1, 0).batch(1)["targets"][:, 0] - 1) == sorted(order)
    assert shuffled(1, 0).batch(1)["targets"].shape == (size, max_len)
    # Two processes cut their halves of a global batch to the same width.
    halves = [shuffled(4, process_index=i, process_count=2).batch(5)["targets"] for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), sorted_pools.batch(5)["targets"])


def test_length_sorted_evaluation_batches_hold_every_sentence_once():
    lengths = np.random.default_rng(1).integers(1, 30, size=21)
    ids, weights = _rows_of_lengths(lengths, 32)
    batches = list(loaders.length_sorted_batches(loaders.SentenceLoader(ids, weights, 4, length_multiple=4)))
    assert len(batches) == 6
    seen = np.concatenate([b["targets"][:, 0] for b in batches])
    assert sorted(seen[seen > 0] - 1) == list(range(21))  # the last batch's 3 missing rows weigh 0
    assert sum(b["weights"].sum() for b in batches) == lengths.sum()
    assert sum(b["weights"].size for b in batches) < 0.7 * 24 * 32


def test_sentence_rows_reject_a_sentence_longer_than_seq_len():
    with pytest.raises(ValueError, match="has 4 tokens with its <eos>, more than config.data.seq_len=3; raise"):
        loaders.sentence_rows(np.array([0, 1, 2, 9, 4, 9]), 9, max_len=3)


def _corpus(tmp_path: pathlib.Path, smoothing: str):
    config, texts = testing.tiny_word_corpus_config(
        tmp_path, "ptb_ngram", num_words=20, lines=(150, 30), words_per_line=(2, 9)
    )
    config.model.smoothing, config.model.add_k = smoothing, 0.5
    config.train.steps = -(-150 // config.train.batch_size)
    config.train.checkpoint_every = config.train.log_every = 5
    config.train.eval_every = 10
    return config, texts


@pytest.mark.parametrize("smoothing", ["kneser_ney", "add_k"])
def test_train_py_fit_scores_like_the_direct_fit_and_resumes(tmp_path, smoothing):
    config, texts = _corpus(tmp_path, smoothing)
    final = loop.train_and_evaluate(config, str(tmp_path / "straight"))
    tokenizer = WordTokenizer.from_corpus([texts["train"], texts["valid"]])
    direct = ngram.fit(
        np.array(tokenizer.encode(texts["train"])),
        order=3,
        vocab_size=22,
        eos_id=tokenizer.eos_id,
        smoothing=smoothing,
        add_k=0.5,
    )
    assert final["perplexity"] == pytest.approx(
        ngram.perplexity(direct, np.array(tokenizer.encode(texts["valid"]))), rel=1e-5
    )
    steps = config.train.steps
    config.train.steps = 5
    loop.train_and_evaluate(config, str(tmp_path / "resumed"))
    config.train.steps = steps
    assert loop.train_and_evaluate(config, str(tmp_path / "resumed"))["loss"] == pytest.approx(final["loss"], rel=1e-6)
    _, state = run_lib.restore_step(run_lib.open_run(str(tmp_path / "resumed")))
    assert state.params["counts"].sum() == len(tokenizer.encode(texts["train"]))


def test_bad_settings_are_named_with_their_fix(tmp_path):
    config, _ = _corpus(tmp_path, "kneser_ney")
    config.train.steps = 11
    with pytest.raises(ValueError, match=r"make 10 batches of 16; set --config.train.steps=10"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
    config.train.steps, config.objective.max_ngrams = 10, 100
    with pytest.raises(ValueError, match=r"distinct 3-gram rows, more than config.objective.max_ngrams=100; set"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
