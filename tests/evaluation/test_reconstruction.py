"""Reconstruction metrics of denoising encoder-decoders: the text plumbing against ground truth (eval.py
--reconstruct on trained tiny T5 / BART runs is in test_tasks.py, next to their training)."""

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from lmzoo.data import noising
from lmzoo.evaluation import reconstruction
from lmzoo.tokenizers import SentencePieceTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT = (
    "The Time Traveller was expounding a recondite matter to us. His grey eyes shone and twinkled, and his usually "
    "pale face was flushed and animated. The fire burned brightly, and the soft radiance of the incandescent lights "
    "caught the bubbles that flashed and passed in our glasses."
)


@pytest.fixture(scope="module")
def tokenizer():
    return SentencePieceTokenizer.train(
        TEXT, vocab_size=120, model_type="unigram", byte_fallback=False, extra_ids=20, hard_vocab_limit=False
    )


def _windows(tokenizer):
    """Three T5 examples of two documents each (EOS between them), as the pipeline builds them."""
    docs = [tokenizer.encode(s) for s in TEXT.split(". ")]
    sentinels = [tokenizer.sentinel_id(i) for i in range(tokenizer.extra_ids)]
    rng = np.random.default_rng(0)
    out = []
    for a, b in [(0, 1), (1, 2), (2, 0)]:
        tokens = np.array(docs[a] + [tokenizer.eos_id] + docs[b], np.int32)
        example = noising.span_corruption(tokens, rng=rng, sentinel_ids=sentinels, eos_id=tokenizer.eos_id)
        out.append((tokens, example["inputs"], example["targets"]))
    return out, sentinels


def _texts(tokenizer, windows, sentinels, predict):
    """(reconstructions, true texts) for predictions predict(targets)."""
    hypotheses, references = [], []
    for tokens, inputs, targets in windows:
        restored = reconstruction.reconstruct_tokens(
            "span_corruption", inputs, predict(targets), sentinel_ids=sentinels, eos_id=tokenizer.eos_id
        )
        hypotheses.append(reconstruction.detokenize(tokenizer, restored))
        references.append(reconstruction.detokenize(tokenizer, tokens))
    return hypotheses, references


def test_perfect_span_prediction_scores_100_and_corrupted_ones_lower(tokenizer):
    windows, sentinels = _windows(tokenizer)
    hypotheses, references = _texts(tokenizer, windows, sentinels, lambda targets: targets)
    # The reconstruction of the true targets is the original text, documents on their own lines.
    sentences = TEXT.split(". ")
    assert references[0] == sentences[0] + "\n" + sentences[1] and hypotheses == references
    perfect = reconstruction.text_metrics(hypotheses, references)
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["exact_match"] == 1.0
    assert perfect["rouge1"] == perfect["rouge2"] == perfect["rougeL"] == pytest.approx(1.0)

    def lose_last_span(targets):  # the last sentinel predicts nothing
        last = np.flatnonzero(np.isin(targets, sentinels))[-1]
        return np.append(targets[: last + 1], tokenizer.eos_id)

    worse = reconstruction.text_metrics(*_texts(tokenizer, windows, sentinels, lose_last_span))
    assert worse["exact_match"] == 0.0 and 0.0 < worse["bleu"] < 100.0 and worse["rouge1"] < 1.0
    # Malformed predictions still give text: no leading sentinel, unknown sentinels, nothing at all.
    junk = [lambda t: t[1:], lambda t: np.array(sentinels[::-1] + [7, 8, 9]), lambda t: np.array([], np.int32)]
    for predict in junk:
        hypotheses, _ = _texts(tokenizer, windows, sentinels, predict)
        assert all(isinstance(h, str) for h in hypotheses)
    assert reconstruction.text_metrics(["unrelated words entirely"], [references[0]])["bleu"] < 5.0


def test_bart_reconstruction_is_the_decoder_output(tokenizer):
    tokens = np.array(tokenizer.encode(TEXT) + [tokenizer.eos_id], np.int32)
    restored = reconstruction.reconstruct_tokens(
        "denoising", tokens[:5], tokens, sentinel_ids=[], eos_id=tokenizer.eos_id
    )
    assert reconstruction.detokenize(tokenizer, restored) == TEXT


def test_reconstruct_refuses_other_objectives(tmp_path):
    spec = importlib.util.spec_from_file_location("default_config", ROOT / "configs" / "default.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "config.json").write_text(module.get_config("tiny").to_json_best_effort())
    result = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), f"--workdir={tmp_path}", "--reconstruct=3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode != 0 and "'reconstruction' does not apply to objective 'causal_lm'" in result.stderr
