"""Count-based n-gram LM: interpolated modified Kneser-Ney (Chen & Goodman 1998) and an add-k baseline.

Conventions (Mikolov's word-level PTB setup):
    - The model reads one token stream of ids in which `<eos>` ends every sentence; `<eos>` is an ordinary
      predicted token and perplexity counts it (tokens + eos). `<unk>` is an ordinary vocabulary word.
    - Contexts never cross a sentence end: the history of a token is cut after the previous `<eos>` and
      left-padded with `<eos>`, which therefore doubles as the beginning-of-sentence symbol. The first word
      of a sentence is predicted from `<eos> ... <eos>` (order - 1 of them); the first sentence of a stream
      is treated the same way.
    - Kneser-Ney: the highest order uses raw counts, lower orders continuation counts N1+(. w) throughout;
      an n-gram starting with padding has exactly one left extension (more padding), so it counts 1. This
      reproduces Mikolov's SRILM KN5 on PTB (test 141.2); KenLM's rule of keeping raw counts for such n-grams
      gave 145.5 there. Discounts D1, D2, D3+ per order come from that order's count-of-counts n1..n4:
      Y = n1 / (n1 + 2 n2), Dc = c - (c + 1) Y n_{c+1} / n_c. Interpolation recurses down to uniform 1/V.
    - add-k: p(w | h) = (c(h w) + k) / (c(h) + k V) on the highest order only; unseen contexts give 1/V.

State: a pytree of plain numpy arrays (orbax-checkpointable). N-grams form a trie held in sorted key arrays:
the n-grams of order n are keyed `parent * V + word`, `parent` being the index of their first n - 1 tokens
among the sorted order-(n - 1) keys (order 1 keys are the ids themselves). Every model, Kneser-Ney or add-k,
scores with one recursion p_n(w | h) = discounted_n[h w] * context_norm_n[h] + context_backoff_n[h] *
p_{n-1}(w | h'), where h' drops the oldest token of h and a context absent from the trie has norm 0 and
backoff 1.
"""

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from lmzoo.models import kinds

SMOOTHINGS = ("kneser_ney", "add_k")


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """Fit settings; the field names are exactly the keys of `config.model` (pass them to `fit`)."""

    kind: ClassVar[str] = kinds.COUNTED

    order: int = 5
    vocab_size: int = 10000
    smoothing: str = "kneser_ney"
    add_k: float = 1.0

    def __post_init__(self):
        kinds.check_fields(self, sizes=("order", "vocab_size"), positive=("add_k",))


def contexts_from_stream(token_ids: np.ndarray, *, order: int, eos_id: int) -> np.ndarray:
    """[L] token stream -> [L, order - 1] history of every position, cut at sentence ends, padded with eos."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    positions = np.arange(len(tokens))
    last_eos = np.maximum.accumulate(np.where(tokens == eos_id, positions, -1))
    sentence_start = np.concatenate([[0], last_eos[:-1] + 1])
    contexts = np.full((len(tokens), order - 1), eos_id, dtype=np.int64)
    for back in range(1, order):
        source = positions - back
        inside = source >= sentence_start
        contexts[inside, order - 1 - back] = tokens[source[inside]]
    return contexts


def _find(level_keys: np.ndarray, parent: np.ndarray, word: np.ndarray, vocab_size: int) -> np.ndarray:
    """Index of n-gram (parent, word) in one order's sorted keys, -1 where absent or parent is -1. [P]."""
    packed = parent * vocab_size + word
    pos = np.minimum(np.searchsorted(level_keys, packed), len(level_keys) - 1)
    return np.where((parent >= 0) & (level_keys[pos] == packed), pos, -1)


def _lookup(keys: Sequence[np.ndarray], ngrams: np.ndarray) -> np.ndarray:
    """[P, m] n-grams -> [P] index among the order-m keys (-1 if unseen); m = 0 is the empty context, index 0."""
    if ngrams.shape[1] == 0:
        return np.zeros(len(ngrams), dtype=np.int64)
    vocab_size = len(keys[0])
    index = ngrams[:, 0]
    for m in range(1, ngrams.shape[1]):
        index = _find(keys[m], index, ngrams[:, m], vocab_size)
    return index


def _discounts(counts: np.ndarray) -> np.ndarray:
    """[3] D1, D2, D3+ from count-of-counts; each clipped to [0, c], falling back to Y where n_c is zero."""
    n = np.array([np.sum(counts == c) for c in range(1, 5)], dtype=np.float64)
    y = n[0] / (n[0] + 2 * n[1]) if n[0] > 0 else 0.5
    c = np.arange(1, 4, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = c - (c + 1) * y * n[1:] / n[:3]
    return np.clip(np.where(np.isfinite(d), d, y), 0.0, c)


def count_ngrams(token_ids: np.ndarray, *, order: int, eos_id: int) -> dict:
    """Counts of the (history, token) rows of an [L] stream that starts at a sentence start.

    Pieces of a stream cut after `<eos>` (e.g. batches of whole sentences, pads removed) can be counted apart
    and combined with `merge_counts`: fitting the merge equals fitting their concatenation.
    Returns:
        {"ngrams": [U, order] distinct rows (order - 1 history ids, oldest first, then the token),
         "counts": [U] int64 occurrences}.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    rows = np.concatenate([contexts_from_stream(tokens, order=order, eos_id=eos_id), tokens[:, None]], axis=1)
    return _distinct(rows, np.ones(len(rows), dtype=np.int64))


def merge_counts(*counts: dict) -> dict:
    """Sum of several `count_ngrams` results of the same order."""
    return _distinct(np.concatenate([c["ngrams"] for c in counts]), np.concatenate([c["counts"] for c in counts]))


def _distinct(rows: np.ndarray, counts: np.ndarray) -> dict:
    ngrams, inverse = np.unique(rows, axis=0, return_inverse=True)
    totals = np.bincount(inverse.ravel(), weights=counts, minlength=len(ngrams))
    return {"ngrams": ngrams, "counts": totals.astype(np.int64)}


def fit(
    token_ids: np.ndarray,
    *,
    order: int,
    vocab_size: int,
    eos_id: int,
    smoothing: str = "kneser_ney",
    add_k: float = 1.0,
    discounts: np.ndarray | None = None,
) -> dict:
    """Model state for a whole [L] token stream: `fit_counts(count_ngrams(token_ids))`."""
    counts = count_ngrams(token_ids, order=order, eos_id=eos_id)
    return fit_counts(
        counts, vocab_size=vocab_size, eos_id=eos_id, smoothing=smoothing, add_k=add_k, discounts=discounts
    )


def fit_counts(
    counts: dict,
    *,
    vocab_size: int,
    eos_id: int,
    smoothing: str = "kneser_ney",
    add_k: float = 1.0,
    discounts: np.ndarray | None = None,
) -> dict:
    """Model state from (history, token) counts; the order is the width of counts["ngrams"].

    Args:
        counts: `count_ngrams` / `merge_counts` output over a stream of ids in [0, vocab_size) whose sentences
            end with `eos_id`.
        smoothing: "kneser_ney" (interpolated modified KN) or "add_k".
        add_k: the k of add-k (ignored by Kneser-Ney).
        discounts: optional [order, 3] Kneser-Ney D1, D2, D3+ per order (index 0 = unigrams), overriding
            the count-of-counts estimate.
    Returns:
        {"keys", "discounted", "context_norm", "context_backoff"}: lists indexed by order - 1 of [entries]
        (keys int64, others float64; context arrays are indexed by the order - 1 entries, a single entry for
        unigrams), "discounts" [order, 3] and "eos_id" [].
    """
    if smoothing not in SMOOTHINGS:
        raise ValueError(f"unknown smoothing {smoothing!r}; expected one of {SMOOTHINGS}")
    rows, row_counts = counts["ngrams"], counts["counts"]
    if rows.size and (rows.min() < 0 or rows.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    order = rows.shape[1]
    # window_index[m - 1][i, j] indexes rows[i, j:j + m] among the order-m keys.
    num_rows = len(rows)
    keys = [np.arange(vocab_size, dtype=np.int64)]
    window_index = [rows]
    for m in range(2, order + 1):
        packed = window_index[-1][:, : order - m + 1] * vocab_size + rows[:, m - 1 :]
        level_keys, inverse = np.unique(packed.ravel(), return_inverse=True)
        keys.append(level_keys)
        window_index.append(inverse.reshape(num_rows, order - m + 1))
    # Raw counts: how often each n-gram ends a row, i.e. is a predicted token with its history.
    raw = [
        np.bincount(w[:, -1], weights=row_counts, minlength=len(k)).astype(np.int64)
        for w, k in zip(window_index, keys, strict=True)
    ]
    parents = [np.zeros(vocab_size, dtype=np.int64)] + [k // vocab_size for k in keys[1:]]
    num_contexts = [1] + [len(k) for k in keys[:-1]]

    if smoothing == "add_k":
        discounts = np.zeros((order, 3))
        discounted = [np.zeros(len(k)) for k in keys[:-1]] + [raw[-1].astype(np.float64)]
        totals = np.bincount(parents[-1], weights=raw[-1], minlength=num_contexts[-1])
        denominator = totals + add_k * vocab_size
        context_norm = [np.zeros(n) for n in num_contexts[:-1]] + [1.0 / denominator]
        context_backoff = [np.ones(n) for n in num_contexts[:-1]] + [add_k * vocab_size / denominator]
        return _state(keys, discounted, context_norm, context_backoff, discounts, eos_id)

    adjusted = [None] * order
    adjusted[-1] = raw[-1]
    for m in range(order - 1, 0, -1):
        # Suffix (drop the first token) of every order-(m + 1) n-gram, scattered from any of its windows.
        suffix = np.empty(len(keys[m]), dtype=np.int64)
        suffix[window_index[m]] = window_index[m - 1][:, 1:]
        adjusted[m - 1] = np.bincount(suffix[raw[m] > 0], minlength=len(keys[m - 1]))
    if discounts is None:
        discounts = np.stack([_discounts(a) for a in adjusted])
    discounts = np.asarray(discounts, dtype=np.float64)

    discounted, context_norm, context_backoff = [], [], []
    for m in range(order):
        counts = adjusted[m]
        removed = np.where(counts > 0, discounts[m][np.clip(counts, 1, 3) - 1], 0.0)
        totals = np.bincount(parents[m], weights=counts, minlength=num_contexts[m])
        removed_totals = np.bincount(parents[m], weights=removed, minlength=num_contexts[m])
        seen = totals > 0
        safe_totals = np.where(seen, totals, 1.0)
        discounted.append(counts - removed)
        context_norm.append(np.where(seen, 1.0 / safe_totals, 0.0))
        context_backoff.append(np.where(seen, removed_totals / safe_totals, 1.0))
    return _state(keys, discounted, context_norm, context_backoff, discounts, eos_id)


def _state(keys, discounted, context_norm, context_backoff, discounts, eos_id) -> dict:
    return {
        "keys": keys,
        "discounted": discounted,
        "context_norm": context_norm,
        "context_backoff": context_backoff,
        "discounts": np.asarray(discounts, dtype=np.float64),
        "eos_id": np.asarray(eos_id, dtype=np.int64),
    }


def log_prob(state: dict, contexts: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Natural log p(token | context) for many positions at once.

    Args:
        contexts: [P, C] histories, oldest first, already cut and padded (see `contexts_from_stream`); only
            the last order - 1 columns are read, so C >= order - 1.
        tokens: [P] predicted ids.
    Returns:
        [P] float64 log-probabilities.
    """
    keys = state["keys"]
    order, vocab_size = len(keys), len(keys[0])
    contexts = np.asarray(contexts, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if contexts.ndim != 2 or contexts.shape[1] < order - 1:
        raise ValueError(
            f"contexts must be [positions, >= {order - 1}] for an order-{order} model, got {contexts.shape}"
        )
    prob = np.full(len(tokens), 1.0 / vocab_size)
    for m in range(1, order + 1):
        context = _lookup(keys, contexts[:, contexts.shape[1] - m + 1 :])
        ngram = tokens if m == 1 else _find(keys[m - 1], context, tokens, vocab_size)
        known = context >= 0
        safe_context = np.where(known, context, 0)
        norm = np.where(known, state["context_norm"][m - 1][safe_context], 0.0)
        backoff = np.where(known, state["context_backoff"][m - 1][safe_context], 1.0)
        count = np.where(ngram >= 0, state["discounted"][m - 1][np.maximum(ngram, 0)], 0.0)
        prob = count * norm + backoff * prob
    return np.log(prob)


def perplexity(state: dict, token_ids: np.ndarray) -> float:
    """exp of the mean negative log-likelihood over every token of an [L] stream, `<eos>` included."""
    order, eos_id = len(state["keys"]), int(state["eos_id"])
    contexts = contexts_from_stream(token_ids, order=order, eos_id=eos_id)
    return float(np.exp(-np.mean(log_prob(state, contexts, token_ids))))


def sample(state: dict, rng: np.random.Generator, prefix: Sequence[int], n: int) -> np.ndarray:
    """[n] ids drawn one by one after `prefix` (ids; may be empty, i.e. the start of a sentence)."""
    order, eos_id = len(state["keys"]), int(state["eos_id"])
    vocab = np.arange(len(state["keys"][0]))
    stream = list(prefix)
    for _ in range(n):
        # The history of a placeholder next token is the context for the next draw.
        history = contexts_from_stream(np.array(stream + [eos_id]), order=order, eos_id=eos_id)[-1]
        probs = np.exp(log_prob(state, np.broadcast_to(history, (len(vocab), order - 1)), vocab))
        stream.append(int(rng.choice(vocab, p=probs / probs.sum())))
    return np.array(stream[len(prefix) :], dtype=np.int64)
