"""The ngram_lm objective: counting in JAX equals lmzoo.models.ngram's counts, and train.py's fit scored by the
loop equals the direct fit (Kneser-Ney and add-k), with resume and clear errors for bad settings."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo.models import ngram
from lmzoo.objectives import ngram_lm
from lmzoo.tokenizers import WordTokenizer
from lmzoo.train import loop, restore


def _sentences(seed: int, count: int, vocab: int = 12, eos: int = 12) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate(
        [np.append(np.minimum(rng.zipf(1.6, size=rng.integers(1, 7)), vocab) - 1, eos) for _ in range(count)]
    )


def test_merging_batches_into_the_table_equals_counting_the_stream():
    order, eos, vocab = 3, 12, 13
    stream = _sentences(0, 48)  # three batches of 16: one compilation
    ids, weights = ngram_lm.sentence_rows(stream, eos, max_len=8)
    table = jnp.zeros((256, order), jnp.int32), jnp.zeros((256,), jnp.float32)
    merge = jax.jit(functools.partial(ngram_lm.merge_into_table, vocab_size=vocab))
    for first in range(0, len(ids), 16):
        batch = jnp.asarray(ids[first : first + 16])
        rows = ngram_lm.history_rows(batch, order=order, eos_id=eos).reshape(-1, order)
        *table, distinct = merge(*table, rows, jnp.asarray(weights[first : first + 16]).reshape(-1))
    expected = ngram.count_ngrams(stream, order=order, eos_id=eos)
    used = np.asarray(table[1]) > 0
    assert int(distinct) == used.sum() == len(expected["counts"])
    np.testing.assert_array_equal(np.asarray(table[0])[used], expected["ngrams"])
    np.testing.assert_array_equal(np.asarray(table[1])[used], expected["counts"])


def test_sentence_rows_reject_a_sentence_longer_than_seq_len():
    with pytest.raises(ValueError, match="has 4 tokens with its <eos>, more than config.data.seq_len=3; raise"):
        ngram_lm.sentence_rows(np.array([0, 1, 2, 9, 4, 9]), 9, max_len=3)


def _corpus(tmp_path: pathlib.Path, smoothing: str):
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(20)] + ["<unk>"]
    texts = {}
    for name, lines in (("train", 150), ("valid", 30)):
        texts[name] = "".join(" ".join(rng.choice(words, size=rng.integers(2, 9))) + "\n" for _ in range(lines))
        (tmp_path / f"ptb.{name}.txt").write_text(texts[name])
    from configs import ptb_ngram

    config = ptb_ngram.get_config("tiny")
    config.data.train_path, config.data.validation_path = (
        str(tmp_path / "ptb.train.txt"),
        str(tmp_path / "ptb.valid.txt"),
    )
    config.model.vocab_size, config.model.smoothing, config.model.add_k = 22, smoothing, 0.5
    config.train.steps = -(-150 // config.train.batch_size)
    config.train.checkpoint_every = config.train.log_every = 5
    config.train.eval_every = 10
    return config, texts


@pytest.mark.parametrize("smoothing", ["kneser_ney", "add_k"])
def test_train_py_fit_scores_like_the_direct_fit_and_resumes(tmp_path, smoothing):
    config, texts = _corpus(tmp_path, smoothing)
    final = loop.train_and_evaluate(config, str(tmp_path / "straight"))
    tokenizer = WordTokenizer.from_corpus([texts["train"], texts["valid"]])
    direct = ngram.fit(np.array(tokenizer.encode(texts["train"])), order=3, vocab_size=22, eos_id=tokenizer.eos_id,
                       smoothing=smoothing, add_k=0.5)  # fmt: skip
    assert final["perplexity"] == pytest.approx(
        ngram.perplexity(direct, np.array(tokenizer.encode(texts["valid"]))), rel=1e-5
    )
    steps = config.train.steps
    config.train.steps = 5
    loop.train_and_evaluate(config, str(tmp_path / "resumed"))
    config.train.steps = steps
    assert loop.train_and_evaluate(config, str(tmp_path / "resumed"))["loss"] == pytest.approx(final["loss"], rel=1e-6)
    _, state = restore.restore_step(restore.open_run(str(tmp_path / "resumed")))
    assert state.params["counts"].sum() == len(tokenizer.encode(texts["train"]))


def test_bad_settings_are_named_with_their_fix(tmp_path):
    config, _ = _corpus(tmp_path, "kneser_ney")
    config.train.steps = 11
    with pytest.raises(ValueError, match=r"make 10 batches of 16; set --config.train.steps=10"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
    config.train.steps, config.objective.max_ngrams = 10, 100
    with pytest.raises(ValueError, match=r"distinct 3-gram rows, more than config.objective.max_ngrams=100; set"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
