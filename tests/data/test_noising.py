import chex
import numpy as np
import pytest

from lmzoo.data import noising
from lmzoo.tokenizers import SentencePieceTokenizer

BOS, EOS, MASK, DOT = 0, 1, 2, 3
SPECIALS = (BOS, EOS)
FIRST = 10  # ordinary token ids start here
SENTINELS = [10_000 - 1 - i for i in range(1000)]  # <extra_id_i> descending from the vocab end, as in T5


def _document(n: int) -> np.ndarray:
    """[BOS] FIRST .. FIRST+n-1 [EOS]: distinct ordinary ids, so noised outputs can be aligned to it."""
    return np.concatenate([[BOS], np.arange(FIRST, FIRST + n), [EOS]]).astype(np.int32)


def _infill_spans(original: np.ndarray, noised: np.ndarray) -> list[int]:
    """Length of the span each mask of `noised` stands for (0 for inserted masks), aligning distinct ids.

    Asserts that the non-mask tokens are an in-order subsequence of `original`, that nothing is deleted
    without a mask, and that masks are never adjacent.
    """
    index = {int(t): i for i, t in enumerate(original)}
    spans, position, mask_at = [], 0, None
    for t in noised.tolist():
        if t == MASK:
            assert mask_at is None, "adjacent masks"
            mask_at = position
            continue
        i = index[t]
        if mask_at is None:
            assert i == position, "token deleted without a mask"
        else:
            spans.append(i - mask_at)
            mask_at = None
        position = i + 1
    if mask_at is not None:
        spans.append(len(original) - mask_at)
    return spans


def _sentence_order(tokens: np.ndarray, sentences: list[list[int]]) -> list[int]:
    """The order in which `tokens` concatenates `sentences` (which start with distinct ids); asserts it does."""
    by_first = {s[0]: k for k, s in enumerate(sentences)}
    order, position = [], 0
    while position < len(tokens):
        k = by_first[int(tokens[position])]
        np.testing.assert_array_equal(tokens[position : position + len(sentences[k])], sentences[k])
        order.append(k)
        position += len(sentences[k])
    assert sorted(order) == list(range(len(sentences)))
    return order


# ------------------------------------------------------------------------------------------ T5


@pytest.mark.parametrize("eos_id", [None, EOS])
def test_span_corruption_reconstructs_original(eos_id: int | None) -> None:
    rng = np.random.default_rng(0)
    for length in [0, 1, 2, 3, 4, 7, *rng.integers(5, 700, size=150)]:
        tokens = rng.integers(FIRST, 5000, size=int(length)).astype(np.int32)
        out = noising.span_corruption(tokens, rng=rng, sentinel_ids=SENTINELS, eos_id=eos_id)
        chex.assert_equal(out["inputs"].dtype, np.int32)
        restored = noising.reconstruct_from_span_corruption(out["inputs"], out["targets"], SENTINELS, eos_id)
        np.testing.assert_array_equal(restored, tokens)
        if eos_id is not None:
            assert out["inputs"][-1] == eos_id and out["targets"][-1] == eos_id
        # Sentinels appear in order <extra_id_0>, <extra_id_1>, ... on both sides; targets start with one.
        for side in ("inputs", "targets"):
            used = out[side][np.isin(out[side], SENTINELS)]
            np.testing.assert_array_equal(used, SENTINELS[: len(used)])
        if length >= 2:
            assert out["targets"][0] == SENTINELS[0]


def test_span_corruption_sentinels_from_tokenizer() -> None:
    text = "the quick brown fox jumps over the lazy dog. " * 20
    tok = SentencePieceTokenizer.train(text, vocab_size=40, byte_fallback=False, extra_ids=100, hard_vocab_limit=False)
    sentinel_ids = [tok.sentinel_id(i) for i in range(tok.extra_ids)]
    assert sentinel_ids == list(range(tok.vocab_size - 1, tok.vocab_size - 101, -1))
    tokens = np.array(tok.encode(text), dtype=np.int32)
    out = noising.span_corruption(tokens, rng=np.random.default_rng(0), sentinel_ids=sentinel_ids, eos_id=tok.eos_id)
    used = out["inputs"][out["inputs"] >= tok.vocab_size - tok.extra_ids]
    np.testing.assert_array_equal(used, tok.vocab_size - 1 - np.arange(len(used)))
    assert len(used) > 3
    assert tok.decode(out["targets"][:1].tolist()) == "<extra_id_0>"
    restored = noising.reconstruct_from_span_corruption(out["inputs"], out["targets"], sentinel_ids, tok.eos_id)
    assert tok.decode(restored.tolist()) == text


def test_noise_mask_statistics() -> None:
    rng = np.random.default_rng(1)
    noise_tokens = tokens = spans = 0
    for length in rng.integers(100, 1000, size=300):
        mask = noising.random_spans_noise_mask(int(length), 0.15, 3.0, rng=rng)
        chex.assert_shape(mask, (length,))
        assert not mask[0] and mask[-1]
        noise_tokens, tokens = noise_tokens + mask.sum(), tokens + length
        spans += noising._num_runs(mask)
    assert abs(noise_tokens / tokens - 0.15) < 0.01
    assert abs(noise_tokens / spans - 3.0) < 0.15


def test_noise_mask_degenerate_lengths() -> None:
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(noising.random_spans_noise_mask(1, rng=rng), [False])
    np.testing.assert_array_equal(noising.random_spans_noise_mask(2, rng=rng), [False, True])
    assert not noising.random_spans_noise_mask(50, 0.0, rng=rng).any()


def test_span_corruption_lengths_known_values() -> None:
    assert noising.span_corruption_lengths(512, 0.15, 3.0) == (568, 114)  # T5's pretraining setting
    assert noising.span_corruption_lengths(114, 0.15, 3.0) == (126, 26)


@pytest.mark.parametrize("density, mean", [(0.15, 3.0), (0.3, 3.0), (0.15, 8.0), (0.25, 2.5), (0.5, 3.0)])
def test_span_corruption_lengths_fit_exactly(density: float, mean: float) -> None:
    rng = np.random.default_rng(2)
    for inputs_length in [*range(4, 200), 512, 568, 1024]:
        tokens_length, targets_length = noising.span_corruption_lengths(inputs_length, density, mean)
        tokens = rng.integers(FIRST, 5000, size=tokens_length)
        out = noising.span_corruption(
            tokens, rng=rng, sentinel_ids=SENTINELS, noise_density=density, mean_noise_span_length=mean, eos_id=EOS
        )
        assert len(out["targets"]) == targets_length
        if density == 0.5:  # T5 trades one input token for targets that fit inputs_length
            assert len(out["inputs"]) in (inputs_length - 1, inputs_length)
        else:
            assert len(out["inputs"]) == inputs_length


def test_span_corruption_too_few_sentinels() -> None:
    with pytest.raises(ValueError, match="only 3 sentinel ids"):
        noising.span_corruption(np.arange(100), rng=np.random.default_rng(0), sentinel_ids=SENTINELS[:3])


# ---------------------------------------------------------------------------------------- BART


def test_text_infilling_statistics() -> None:
    rng = np.random.default_rng(3)
    removed = total = 0
    spans: list[int] = []
    for n in rng.integers(50, 400, size=300):
        original = _document(int(n))
        noised = noising.text_infilling(original, rng=rng, mask_id=MASK, special_ids=SPECIALS)
        assert noised[0] == BOS and noised[-1] == EOS
        sample = _infill_spans(original, noised)
        assert len(sample) == (noised == MASK).sum()
        spans += sample
        removed, total = removed + sum(sample), total + n
    spans_array = np.array(spans)
    assert abs(removed / total - 0.3) < 0.03
    assert abs(spans_array.mean() - 3.0) < 0.3
    assert 0.02 < (spans_array == 0).mean() < 0.09  # Poisson(3) gives P(0) = e^-3 = 0.05: inserted masks
    assert abs(spans_array[spans_array > 0].mean() - 3 / (1 - np.exp(-3))) < 0.3


def test_text_infilling_keeps_specials_anywhere() -> None:
    sep = 4
    tokens = np.array([BOS, *range(10, 20), sep, *range(20, 30), EOS], dtype=np.int32)
    for seed in range(50):
        noised = noising.text_infilling(
            tokens, rng=np.random.default_rng(seed), mask_id=MASK, mask_ratio=0.6, special_ids=(*SPECIALS, sep)
        )
        np.testing.assert_array_equal(noised[np.isin(noised, (*SPECIALS, sep))], [BOS, sep, EOS])
        assert noised[0] == BOS and noised[-1] == EOS
        assert sum(_infill_spans(tokens, noised)) == 12
        chex.assert_equal(noised.dtype, np.int32)


def test_text_infilling_short_and_deterministic() -> None:
    original = _document(40)
    first = noising.text_infilling(original, rng=np.random.default_rng(7), mask_id=MASK, special_ids=SPECIALS)
    again = noising.text_infilling(original, rng=np.random.default_rng(7), mask_id=MASK, special_ids=SPECIALS)
    other = noising.text_infilling(original, rng=np.random.default_rng(8), mask_id=MASK, special_ids=SPECIALS)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    for n in range(0, 6):  # more spans than kept tokens can separate: they merge, still one mask per span
        for seed in range(20):
            tokens = _document(n)
            noised = noising.text_infilling(
                tokens, rng=np.random.default_rng(seed), mask_id=MASK, mask_ratio=0.9, special_ids=SPECIALS
            )
            assert sum(_infill_spans(tokens, noised)) == round(0.9 * n)


def test_sentence_permutation() -> None:
    rng = np.random.default_rng(4)
    sentences = [[11, 12, DOT], [13, DOT, DOT], [14, 15, 16, DOT], [17, DOT], [18, 19]]  # the last has no DOT
    tokens = np.array([BOS, *sum(sentences, []), EOS], dtype=np.int32)
    orders = set()
    for _ in range(100):
        out = noising.sentence_permutation(tokens, rng=rng, sentence_end_ids=[DOT])
        assert out[0] == BOS and out[-1] == EOS
        orders.add(tuple(_sentence_order(out[1:-1], sentences)))
    assert len(orders) > 50  # of 5! = 120
    free = noising.sentence_permutation(
        tokens[1:-1], rng=rng, sentence_end_ids=[DOT], keep_first=False, keep_last=False
    )
    _sentence_order(free, sentences)


def test_document_rotation() -> None:
    rng = np.random.default_rng(5)
    tokens = _document(20)
    starts = set()
    for _ in range(200):
        out = noising.document_rotation(tokens, rng=rng)
        assert out[0] == BOS and out[-1] == EOS
        start = int(out[1]) - FIRST
        np.testing.assert_array_equal(out[1:-1], np.roll(tokens[1:-1], -start))
        starts.add(start)
    assert starts == set(range(20))
    free = noising.document_rotation(tokens, rng=rng, keep_first=False, keep_last=False)
    k = int(np.flatnonzero(tokens == free[0])[0])
    np.testing.assert_array_equal(free, np.roll(tokens, -k))


@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_token_deletion_and_masking(ratio: float) -> None:
    rng = np.random.default_rng(6)
    for n in [0, 1, 10, 57, 300]:
        tokens = _document(n)
        deleted = noising.token_deletion(tokens, rng=rng, ratio=ratio, special_ids=SPECIALS)
        assert len(deleted) == len(tokens) - round(ratio * n)
        assert deleted[0] == BOS and deleted[-1] == EOS
        assert np.all(np.diff(deleted[1:-1]) > 0)  # an in-order subsequence
        masked = noising.token_masking(tokens, rng=rng, mask_id=MASK, ratio=ratio, special_ids=SPECIALS)
        chex.assert_equal_shape([masked, tokens])
        assert (masked == MASK).sum() == round(ratio * n)
        np.testing.assert_array_equal(masked[masked != MASK], tokens[masked != MASK])
        assert masked[0] == BOS and masked[-1] == EOS


def test_apply_noising_composes_in_order() -> None:
    tokens = np.array([BOS, 11, 12, DOT, 13, 14, 15, DOT, 16, DOT, *range(20, 60), DOT, EOS], dtype=np.int32)
    steps = [
        ("sentence_permutation", {"sentence_end_ids": [DOT]}),
        ("text_infilling", {"mask_id": MASK, "special_ids": SPECIALS}),
        ("document_rotation", {}),
    ]
    out = noising.apply_noising(tokens, steps, rng=np.random.default_rng(9))
    rng = np.random.default_rng(9)
    expected = noising.sentence_permutation(tokens, rng=rng, sentence_end_ids=[DOT])
    expected = noising.text_infilling(expected, rng=rng, mask_id=MASK, special_ids=SPECIALS)
    expected = noising.document_rotation(expected, rng=rng)
    np.testing.assert_array_equal(out, expected)
    assert (out == MASK).any() and out[0] == BOS and out[-1] == EOS
    with pytest.raises(ValueError, match="unknown noising step.*'shuffle'.*document_rotation"):
        noising.apply_noising(tokens, [("shuffle", {})], rng=np.random.default_rng(0))
