from pathlib import Path

import chex
import numpy as np
import pytest

from lmzoo import tokenizers
from lmzoo.data import pipeline, transforms
from lmzoo.objectives import mlm

PAD, CLS, SEP, MASK = 0, 1, 2, 3
SPECIALS = (PAD, CLS, SEP, MASK)
VOCAB = 1000
DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def _batch(seed: int = 0, b: int = 256, t: int = 128) -> np.ndarray:
    """[CLS] A [SEP] B [SEP] rows of random non-special ids, right-padded to random lengths."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(len(SPECIALS), VOCAB, size=(b, t)).astype(np.int32)
    lengths = rng.integers(8, t + 1, size=b)
    tokens[:, 0] = CLS
    tokens[np.arange(b), lengths // 2] = SEP
    tokens[np.arange(b), lengths - 1] = SEP
    tokens[np.arange(t)[None, :] >= lengths[:, None]] = PAD
    return tokens


def _mask(tokens: np.ndarray, seed: int = 1, **kwargs) -> dict[str, np.ndarray]:
    return transforms.mask_tokens(
        tokens, rng=np.random.default_rng(seed), mask_id=MASK, vocab_size=VOCAB, special_ids=SPECIALS, **kwargs
    )


def _words(row_starts: np.ndarray, row_candidates: np.ndarray) -> list[list[int]]:
    """Positions of each word: a candidate start plus the following non-start candidates."""
    words: list[list[int]] = []
    for pos, (start, candidate) in enumerate(zip(row_starts, row_candidates)):
        if not candidate:
            continue
        if start or not words or words[-1][-1] != pos - 1:
            words.append([pos])
        else:
            words[-1].append(pos)
    return words


def test_mask_rates_and_specials_untouched():
    tokens = _batch()
    out = _mask(tokens)
    for v in out.values():
        chex.assert_shape(v, tokens.shape)
    candidate = ~np.isin(tokens, SPECIALS)
    selected = out["weights"] > 0
    np.testing.assert_array_equal(out["targets"], tokens)
    assert set(np.unique(out["weights"])) <= {0.0, 1.0}
    assert not (selected & ~candidate).any()
    np.testing.assert_array_equal(out["inputs"][~selected], tokens[~selected])

    count = candidate.sum(1)
    np.testing.assert_array_equal(selected.sum(1), np.maximum(np.round(0.15 * count), 1))
    assert abs(selected.sum() / candidate.sum() - 0.15) < 0.01
    inputs, original = out["inputs"][selected], tokens[selected]
    masked, unchanged = inputs == MASK, inputs == original
    random = ~masked & ~unchanged
    assert abs(masked.mean() - 0.8) < 0.02
    assert abs(random.mean() - 0.1) < 0.02
    assert abs(unchanged.mean() - 0.1) < 0.02
    assert not np.isin(inputs[random], SPECIALS).any()


def test_row_without_candidates_and_tiny_row():
    tokens = np.array([[CLS, SEP, PAD, PAD], [CLS, 7, SEP, PAD]], dtype=np.int32)
    out = _mask(tokens)
    np.testing.assert_array_equal(out["weights"], [[0, 0, 0, 0], [0, 1, 0, 0]])


def test_whole_word_masking_selects_complete_words():
    tokens = _batch(b=64)
    word_starts = np.random.default_rng(2).random(tokens.shape) < 0.6
    out = _mask(tokens, word_starts=word_starts)
    candidate = ~np.isin(tokens, SPECIALS)
    selected = out["weights"] > 0
    assert not (selected & ~candidate).any()
    for row in range(len(tokens)):
        words = _words(word_starts[row], candidate[row])
        picked = [selected[row, w].all() for w in words]
        for w, all_picked in zip(words, picked):
            assert all_picked or not selected[row, w].any(), f"row {row}: word {w} partially selected"
        budget = max(round(0.15 * candidate[row].sum()), 1)
        longest = max(len(w) for w in words)
        assert budget <= selected[row].sum() < budget + longest
    assert abs(selected.sum() / candidate.sum() - 0.15) < 0.02


def test_same_rng_same_mask_and_static_vs_dynamic():
    tokens = _batch(b=8)
    for k, v in _mask(tokens, seed=5).items():
        np.testing.assert_array_equal(v, _mask(tokens, seed=5)[k])

    def mask(index: int, epoch: int | None) -> np.ndarray:
        rng = transforms.masking_rng(7, index, epoch=epoch)
        kwargs = dict(mask_id=MASK, vocab_size=VOCAB, special_ids=SPECIALS)
        return transforms.mask_tokens(tokens[index : index + 1], rng=rng, **kwargs)["inputs"]

    static = [mask(3, None) for _ in range(3)]
    np.testing.assert_array_equal(static[0], static[1])
    np.testing.assert_array_equal(static[0], static[2])
    dynamic = [mask(3, epoch) for epoch in range(3)]
    np.testing.assert_array_equal(dynamic[1], mask(3, 1))
    assert not np.array_equal(dynamic[0], dynamic[1]) and not np.array_equal(dynamic[1], dynamic[2])
    assert not np.array_equal(static[0], dynamic[0])
    batch_draws = [transforms.masking_rng(7, np.arange(4), epoch=None).random(4) for _ in range(2)]
    np.testing.assert_array_equal(*batch_draws)


def test_wordpiece_word_starts():
    continuation = transforms.continuation_mask_from_vocab(["[PAD]", "play", "##ing", "##s", "run"])
    np.testing.assert_array_equal(continuation, [False, False, True, True, False])
    starts = transforms.wordpiece_word_starts(np.array([[1, 2, 4, 3]]), continuation)
    np.testing.assert_array_equal(starts, [[True, False, True, False]])


def test_pair_example_layout_and_truncation():
    ex = transforms.pair_example([10, 11, 12], [20, 21], cls_id=CLS, sep_id=SEP, max_len=10, pad_id=PAD)
    np.testing.assert_array_equal(ex["tokens"], [CLS, 10, 11, 12, SEP, 20, 21, SEP, PAD, PAD])
    np.testing.assert_array_equal(ex["token_type_ids"], [0, 0, 0, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(ex["segment_ids"], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0])

    def lengths(a: int, b: int, max_len: int) -> tuple[int, int]:
        ex = transforms.pair_example(
            list(range(10, 10 + a)), list(range(100, 100 + b)), cls_id=CLS, sep_id=SEP, max_len=max_len, pad_id=PAD
        )
        chex.assert_shape(ex["tokens"], (max_len,))
        types = ex["token_type_ids"][ex["segment_ids"] > 0]
        return int((types == 0).sum()) - 2, int((types == 1).sum()) - 1

    assert lengths(10, 3, 10) == (4, 3)  # only the longer side shrinks
    assert lengths(6, 6, 9) == (3, 3)
    assert lengths(4, 4, 10) == (4, 3)  # ties truncate B
    truncated = transforms.pair_example([10, 11, 12, 13], [20], cls_id=CLS, sep_id=SEP, max_len=5, pad_id=PAD)
    np.testing.assert_array_equal(truncated["tokens"], [CLS, 10, SEP, 20, SEP])


def _docs() -> tuple[list[list[list[int]]], dict[tuple[int, ...], tuple[int, int]]]:
    """Documents whose sentences encode (doc, index), with varied lengths and one single-sentence doc."""
    sizes = [5, 1, 8, 3, 12, 2]
    docs = [[[1000 * d + i] * (1 + i % 3) for i in range(n)] for d, n in enumerate(sizes)]
    where = {tuple(s): (d, i) for d, doc in enumerate(docs) for i, s in enumerate(doc)}
    return docs, where


def test_nsp_pairs_balanced_and_correct():
    docs, where = _docs()
    pairs = transforms.SentencePairs(transforms.SentenceLists(docs), kind="nsp", seed=0, size=2000)
    assert len(pairs) == 2000
    drawn = [pairs[k] for k in range(2000)]
    assert abs(np.mean([label for _, _, label in drawn]) - 0.5) < 0.05
    for a, b, label in drawn:
        (doc_a, i_a), (doc_b, i_b) = where[tuple(a)], where[tuple(b)]
        if label == 0:  # HF convention: 0 = B continues A
            assert (doc_b, i_b) == (doc_a, i_a + 1)
        else:
            assert doc_b != doc_a


def test_sop_pairs_balanced_and_correct():
    docs, where = _docs()
    pairs = transforms.SentencePairs(transforms.SentenceLists(docs), kind="sop", seed=0, size=2000)
    drawn = [pairs[k] for k in range(2000)]
    assert abs(np.mean([label for _, _, label in drawn]) - 0.5) < 0.05
    for a, b, label in drawn:
        (doc_a, i_a), (doc_b, i_b) = where[tuple(a)], where[tuple(b)]
        assert doc_a == doc_b
        assert i_b == (i_a + 1 if label == 0 else i_a - 1)  # HF convention: 1 = swapped


@pytest.mark.parametrize("kind", ["nsp", "sop"])
def test_sentence_pairs_are_drawn_when_read_from_seed_and_id_alone(kind):
    """Pair k is the same however the pairs are read (any order, a fresh object); unsized, an epoch takes every
    sentence with a successor once, in order; sized, the first sentences spread evenly over the split."""
    docs, where = _docs()
    sentences = transforms.SentenceLists(docs)
    everything = transforms.SentencePairs(sentences, kind=kind, seed=5)
    assert len(everything) == sum(len(d) - 1 for d in docs if d)
    forward = [everything[k] for k in range(len(everything))]
    again = transforms.SentencePairs(sentences, kind=kind, seed=5)
    assert [again[k] for k in reversed(range(len(everything)))] == forward[::-1]
    firsts = [where[tuple(a if label == 0 or kind == "nsp" else b)] for a, b, label in forward]
    assert firsts == [(d, i) for d, doc in enumerate(docs) for i in range(len(doc) - 1)]
    other_seed = transforms.SentencePairs(sentences, kind=kind, seed=6)
    assert [p[2] for p in forward] != [other_seed[k][2] for k in range(len(everything))]
    spread = transforms.SentencePairs(sentences, kind=kind, seed=5, size=3)
    spread_firsts = [
        where[tuple(a if label == 0 or kind == "nsp" else b)] for a, b, label in map(spread.__getitem__, range(3))
    ]
    assert spread_firsts == [firsts[0], firsts[len(firsts) // 3], firsts[2 * len(firsts) // 3]]
    with pytest.raises(IndexError):
        spread[3]


def test_a_batch_of_pairs_reads_only_its_own_sentences():
    """The loader builds a batch's pairs when it asks for them: at most two sentence reads a row, whatever the size
    of the split (a pool drawn up front would read them all)."""
    docs, _ = _docs()
    reads = []

    class CountingSentences(transforms.SentenceLists):
        def sentence(self, document, index):
            reads.append((document, index))
            return super().sentence(document, index)

    pairs = transforms.SentencePairs(CountingSentences(docs), kind="nsp", seed=0, size=10_000)
    tokenizer = type("Ids", (), {"cls_id": CLS, "sep_id": SEP, "pad_id": PAD})()
    loader = pipeline.ExampleLoader(
        mlm.PairRows(pairs, tokenizer, max_len=16), 4, seed=0, transform=lambda rows, ids, epochs: rows
    )
    assert loader.num_examples == 10_000 and not reads
    batch = loader.batch(1234)
    assert batch["tokens"].shape == (4, 16) and batch["sentence_labels"].shape == (4,)
    assert 4 <= len(reads) <= 8
    assert loader.batch(1234)["tokens"].tolist() == batch["tokens"].tolist()  # a function of (seed, step)


def test_split_sentences():
    text = 'He said "Go." Then Robert E. Lee left (e.g. at dawn)! Where art thou? and he said.\nno period here'
    assert transforms.split_sentences(text) == [
        'He said "Go."',
        "Then Robert E. Lee left (e.g. at dawn)!",
        "Where art thou? and he said.",
        "no period here",
    ]
    wrapped = "Genesis 1\n\n  1 In the beginning. And the\nevening was. 2 And God\nsaid, Let there be light.\n"
    assert transforms.split_sentences(wrapped, wrapped=True) == [
        "Genesis 1",
        "1 In the beginning.",
        "And the evening was.",
        "2 And God said, Let there be light.",
    ]


@pytest.mark.skipif(not DATA.is_dir(), reason="shared data folder is absent")
def test_real_wordpiece_glosses():
    vocab_txt = DATA / "tokenizers" / "bert_uncased" / "vocab.txt"
    tok = tokenizers.HFTokenizer.wordpiece(str(vocab_txt))
    with open(DATA / "wordnet" / "wordnet30_glosses.txt") as f:
        glosses = [next(f) for _ in range(40)]
    sentences = [tok.encode(s) for g in glosses for s in transforms.split_sentences(g)]
    examples = [
        transforms.pair_example(a, b, cls_id=tok.cls_id, sep_id=tok.sep_id, max_len=48, pad_id=tok.pad_id)
        for a, b in zip(sentences[:-1], sentences[1:])
    ]
    tokens = np.stack([ex["tokens"] for ex in examples])
    continuation = transforms.continuation_mask_from_vocab(vocab_txt.read_text(encoding="utf-8").splitlines())
    assert continuation[tok.encode("unaffable")[1:]].all()
    word_starts = transforms.wordpiece_word_starts(tokens, continuation)
    specials = [tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id, tok.unk_id]
    for starts in (None, word_starts):
        out = transforms.mask_tokens(
            tokens,
            rng=np.random.default_rng(0),
            mask_id=tok.mask_id,
            vocab_size=tok.vocab_size,
            special_ids=specials,
            word_starts=starts,
        )
        keep = np.isin(tokens, [tok.cls_id, tok.sep_id, tok.pad_id])
        np.testing.assert_array_equal(out["inputs"][keep], tokens[keep])
        assert not out["weights"][keep].any()
        assert (out["weights"].sum(1) >= 1).all()
    candidate = ~np.isin(tokens, specials)
    for row, selected in enumerate(out["weights"] > 0):
        for w in _words(word_starts[row], candidate[row]):
            assert selected[w].all() or not selected[w].any()
