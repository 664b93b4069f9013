"""Tests for lmzoo.models.ngram: normalisation, a hand-computed Kneser-Ney model, backoff, sampling, save/restore."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from lmzoo.models import ngram

VOCAB = 32
EOS = 31


def random_stream(seed: int, length: int = 400) -> np.ndarray:
    """Zipf-ish ids in [0, VOCAB - 1) with sentence ends every few tokens, ending in eos."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.5, size=length), VOCAB - 1) - 1
    ids[rng.random(length) < 0.15] = EOS
    ids[-1] = EOS
    return ids


@pytest.mark.parametrize("smoothing", ["kneser_ney", "add_k"])
@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_distributions_sum_to_one(order: int, smoothing: str) -> None:
    train = random_stream(order)
    state = ngram.fit(train, order=order, vocab_size=VOCAB, eos_id=EOS, smoothing=smoothing, add_k=0.1)
    # Contexts both seen in training and random (mostly unseen), each scored against the whole vocabulary.
    seen = ngram.contexts_from_stream(train, order=order, eos_id=EOS)[:20]
    unseen = np.random.default_rng(0).integers(0, VOCAB, size=(20, order - 1))
    contexts = np.repeat(np.concatenate([seen, unseen]), VOCAB, axis=0)
    tokens = np.tile(np.arange(VOCAB), 40)
    probs = np.exp(ngram.log_prob(state, contexts, tokens)).reshape(40, VOCAB)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-12)
    assert (probs > 0).all()


def test_kneser_ney_matches_hand_computation() -> None:
    # Vocabulary a=0, b=1, <eos>=2; corpus "a b <eos> a a <eos>"; bigram model, so every history is the previous
    # token within the sentence, or <eos> at a sentence start.
    a, b, eos = 0, 1, 2
    discounts = np.array([[0.25, 0.5, 0.75], [0.5, 1.0, 1.5]])  # [order, (D1, D2, D3+)]
    state = ngram.fit(np.array([a, b, eos, a, a, eos]), order=2, vocab_size=3, eos_id=eos, discounts=discounts)
    # Bigram counts: (eos a)=2, (a b)=1, (b eos)=1, (a a)=1, (a eos)=1.
    # Unigram continuation counts N1+(. w): a <- {eos, a} = 2, b <- {a} = 1, eos <- {b, a} = 2; total 5.
    #   backoff to uniform: (D1 * 1 + D2 * 2) / 5 = (0.25 + 1.0) / 5 = 0.25
    #   p1(a) = (2 - 0.5) / 5 + 0.25 / 3 = 0.3 + 1/12;   p1(b) = (1 - 0.25) / 5 + 1/12 = 0.15 + 1/12;   p1(eos) = p1(a)
    p1 = {a: 0.3 + 1 / 12, b: 0.15 + 1 / 12, eos: 0.3 + 1 / 12}
    # History a: counts a:1, b:1, eos:1 (total 3), backoff 3 * D1 / 3 = 0.5: p = (1 - 0.5) / 3 + 0.5 * p1.
    # History eos: a:2 (total 2), backoff D2 / 2 = 0.5: p(a) = (2 - 1) / 2 + 0.5 * p1(a), others 0.5 * p1.
    # History b: eos:1 (total 1), backoff D1 / 1 = 0.5: p(eos) = (1 - 0.5) / 1 + 0.5 * p1(eos), others 0.5 * p1.
    expected = {
        (a, a): 0.5 / 3 + 0.5 * p1[a],
        (a, b): 0.5 / 3 + 0.5 * p1[b],
        (a, eos): 0.5 / 3 + 0.5 * p1[eos],
        (eos, a): 0.5 + 0.5 * p1[a],
        (eos, b): 0.5 * p1[b],
        (eos, eos): 0.5 * p1[eos],
        (b, a): 0.5 * p1[a],
        (b, b): 0.5 * p1[b],
        (b, eos): 0.5 + 0.5 * p1[eos],
    }
    pairs = np.array(list(expected))
    probs = np.exp(ngram.log_prob(state, pairs[:, :1], pairs[:, 1]))
    np.testing.assert_allclose(probs, list(expected.values()), rtol=1e-12)


def test_discounts_from_count_of_counts() -> None:
    # Unigram model (raw counts): ids 0..3 seen 1, 1, 2, 3 times, id 4 four times, id 5 (eos) once:
    # n1 = 3, n2 = 1, n3 = 1, n4 = 1; Y = 3 / (3 + 2) = 0.6
    # D1 = 1 - 2 * 0.6 * 1/3 = 0.6;  D2 = 2 - 3 * 0.6 * 1/1 = 0.2;  D3+ = 3 - 4 * 0.6 * 1/1 = 0.6
    stream = np.array([0, 1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5])
    state = ngram.fit(stream, order=1, vocab_size=6, eos_id=5)
    np.testing.assert_allclose(state["discounts"], [[0.6, 0.2, 0.6]], rtol=1e-12)


def test_unseen_context_backs_off_to_lower_order() -> None:
    # Trigram KN on the hand corpus above. History (b, a) never occurs, so p(w | b a) = p2(w | a), the bigram
    # level of the trigram model. Its counts under history a are continuation counts N1+(. a w): (eos a b),
    # (eos a a), (a a eos) give 1 each, the same as the raw bigram counts of the hand test, so with the same
    # discounts p2(w | a) = (1 - 0.5) / 3 + 0.5 * p1(w) as there.
    a, b, eos = 0, 1, 2
    discounts = np.array([[0.25, 0.5, 0.75], [0.5, 1.0, 1.5], [0.1, 0.2, 0.3]])
    state = ngram.fit(np.array([a, b, eos, a, a, eos]), order=3, vocab_size=3, eos_id=eos, discounts=discounts)
    p1 = np.array([0.3 + 1 / 12, 0.15 + 1 / 12, 0.3 + 1 / 12])
    probs = np.exp(ngram.log_prob(state, np.array([[b, a]] * 3), np.array([a, b, eos])))
    np.testing.assert_allclose(probs, 0.5 / 3 + 0.5 * p1, rtol=1e-12)
    # Add-k gives the uniform distribution for an unseen history.
    train = random_stream(7)
    add_k = ngram.fit(train[train != 30], order=2, vocab_size=VOCAB, eos_id=EOS, smoothing="add_k")
    tokens = np.arange(VOCAB)
    np.testing.assert_allclose(np.exp(ngram.log_prob(add_k, np.full((VOCAB, 1), 30), tokens)), 1 / VOCAB)


def test_contexts_cut_at_sentence_ends() -> None:
    contexts = ngram.contexts_from_stream(np.array([4, 5, EOS, 6, 7]), order=3, eos_id=EOS)
    np.testing.assert_array_equal(contexts, [[EOS, EOS], [EOS, 4], [4, 5], [EOS, EOS], [EOS, 6]])
    state = ngram.fit(np.array([4, 5, EOS, 6, 7, EOS]), order=3, vocab_size=VOCAB, eos_id=EOS)
    with pytest.raises(ValueError, match=r"contexts must be \[positions, >= 2\] for an order-3 model"):
        ngram.log_prob(state, contexts[:, 1:], np.zeros(5, dtype=np.int64))


def test_kneser_ney_beats_add_k_and_perplexity_is_exp_nll() -> None:
    train, held_out = random_stream(1, 3000), random_stream(2, 300)
    kn = ngram.fit(train, order=3, vocab_size=VOCAB, eos_id=EOS)
    add_k = ngram.fit(train, order=3, vocab_size=VOCAB, eos_id=EOS, smoothing="add_k")
    contexts = ngram.contexts_from_stream(held_out, order=3, eos_id=EOS)
    nll = -ngram.log_prob(kn, contexts, held_out).mean()
    assert ngram.perplexity(kn, held_out) == pytest.approx(np.exp(nll), rel=1e-12)
    assert ngram.perplexity(kn, held_out) < ngram.perplexity(add_k, held_out)


def test_sample_gives_valid_ids_and_follows_the_model() -> None:
    # Deterministic corpus: after "1 2" comes 3, so a trigram model mostly continues the pattern.
    state = ngram.fit(np.tile([1, 2, 3, EOS], 50), order=3, vocab_size=VOCAB, eos_id=EOS)
    drawn = ngram.sample(state, np.random.default_rng(0), [1, 2], 40)
    assert drawn.shape == (40,) and drawn.min() >= 0 and drawn.max() < VOCAB
    successor = {1: 2, 2: 3, 3: EOS, EOS: 1}
    follows = [successor.get(x) == y for x, y in zip([2, *drawn[:-1]], drawn)]
    assert np.mean(follows) > 0.8
    assert ngram.sample(state, np.random.default_rng(0), [], 5).shape == (5,)


def test_state_round_trips_through_orbax(tmp_path) -> None:
    state = ngram.fit(random_stream(3), order=3, vocab_size=VOCAB, eos_id=EOS)
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(tmp_path / "ngram", state)
    restored = checkpointer.restore(tmp_path / "ngram")
    held_out = random_stream(4, 100)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    assert ngram.perplexity(restored, held_out) == ngram.perplexity(state, held_out)


def test_counts_of_pieces_merge_to_the_whole() -> None:
    stream = random_stream(5, 600)
    cut = int(np.flatnonzero(stream == EOS)[10]) + 1  # after a sentence end
    pieces = [ngram.count_ngrams(part, order=3, eos_id=EOS) for part in (stream[:cut], stream[cut:])]
    merged = ngram.merge_counts(*pieces)
    whole = ngram.count_ngrams(stream, order=3, eos_id=EOS)
    jax.tree.map(np.testing.assert_array_equal, merged, whole)
    assert merged["counts"].sum() == len(stream)
    jax.tree.map(
        np.testing.assert_array_equal,
        ngram.fit_counts(merged, vocab_size=VOCAB, eos_id=EOS),
        ngram.fit(stream, order=3, vocab_size=VOCAB, eos_id=EOS),
    )
