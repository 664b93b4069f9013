"""evaluate_loss (groups of batches in one compiled call) against a plain per-window computation and against the
compiled eval step called batch by batch."""

import jax
import numpy as np
import pytest

from lmzoo import metrics as metrics_lib
from lmzoo import sharding, testing
from lmzoo.evaluation import loss
from lmzoo.train import run as run_lib

TEXT = "the quick brown fox jumps over the lazy dog. " * 60
DATA = "a lazy dog sleeps. the brown fox jumps over it again and again. " * 20 + "the end."


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A 1-layer GPT-2 (seq_len 32, eval batches of 2) at its initialisation and a 1,288-character file to score
    (characters of its corpus only): 41 windows in 21 batches, so a full group of BATCHES_PER_CALL and a padded one,
    whose last batch has a padding row."""
    tmp = tmp_path_factory.mktemp("loss")
    corpus = tmp / "corpus.txt"
    corpus.write_text(TEXT)
    config = testing.tiny_config(sample_tokens=0)
    config.data.source, config.data.path = "local", str(corpus)
    config.data.tokenizer = {"kind": "char"}
    config.eval.batch_size = 2
    run = run_lib.build(config, str(tmp / "run"))
    with run.context():
        state = run.compiled.init(jax.random.key(1))
    data = tmp / "data.txt"
    data.write_text(DATA)
    run.add_split("data", str(data))
    yield run, state
    run.close()


def _plain(run, state) -> tuple[float, float, int]:
    """(loss, accuracy, tokens) of the file from the model's logits, window by window, in float64."""
    (split,) = run.raw("data").token_splits(run.tokenizer)
    assert split.num_documents == 1
    tokens, length = split.document(0), run.config.data.seq_len
    params = jax.device_get(state.params)
    nll, correct = 0.0, 0
    for start in range(0, len(tokens) - 1, length):
        inputs, targets = tokens[start : start + length], tokens[start + 1 : start + length + 1]
        logits = np.asarray(run.model.apply({"params": params}, inputs[None, : len(targets)])[0], np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.sum(np.exp(shifted), -1, keepdims=True))
        nll -= np.sum(log_probs[np.arange(len(targets)), targets])
        correct += int(np.sum(np.argmax(logits, -1) == targets))
    return nll / (len(tokens) - 1), correct / (len(tokens) - 1), len(tokens) - 1


def test_grouped_scoring_equals_the_plain_computation(scored):
    run, state = scored
    result = loss.evaluate_loss(run, state, "data")
    plain_loss, plain_accuracy, count = _plain(run, state)
    assert result["tokens"] == count
    windows = -(-count // run.config.data.seq_len)
    assert windows % 2 == 1 and result["evaluated_batches"] == (windows + 1) // 2 == loss.BATCHES_PER_CALL + 5
    np.testing.assert_allclose(result["loss"], plain_loss, rtol=1e-6)
    assert result["accuracy"] == pytest.approx(plain_accuracy, abs=1e-9)
    # The targets are the file's characters after the first, then its EOS (no characters).
    np.testing.assert_allclose(result["bits_per_char"], plain_loss * count / np.log(2) / (len(DATA) - 1), rtol=1e-6)


@pytest.mark.parametrize("max_batches", [None, 3, 17])
def test_grouped_scoring_equals_the_eval_step_batch_by_batch(scored, max_batches):
    run, state = scored
    compiled = run.compiled
    carry, total = compiled.initial_carry(run.config.eval.batch_size), None
    batches = list(run.eval_batches("data"))[:max_batches]
    for batch in batches:
        with run.context():
            metrics, carry = compiled.eval_step(state, sharding.put_batch(batch, compiled.batch_sharding), carry)
        total = metrics_lib.accumulate(total, metrics)
    expected = metrics_lib.summarize(total)
    result = loss.evaluate_loss(run, state, "data", max_batches=max_batches)
    assert result["evaluated_batches"] == len(batches)
    for name, value in expected.items():
        np.testing.assert_allclose(result[name], value, rtol=1e-6, err_msg=name)


def test_batch_groups_keep_order_size_and_one_shape():
    batches = [{"x": np.full((2, n), i)} for i, n in enumerate([3, 3, 3, 5, 5, 3])]
    groups = list(loss.batch_groups(batches, 2))
    assert [[int(b["x"][0, 0]) for b in g] for g in groups] == [[0, 1], [2], [3, 4], [5]]
