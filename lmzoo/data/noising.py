"""Denoising transforms for encoder-decoder pretraining: T5 span corruption and BART noising.

All functions take one example, a 1-D int array [N], and draw randomness only from an explicit
`rng: np.random.Generator`, so a (seed, example) pair always gives the same noise.

T5 (Raffel et al. 2019; t5.data.preprocessors.span_corruption): `span_corruption` turns tokens [N] into
    inputs  [N - noise + spans (+1 EOS)]  non-noise tokens, each noise span replaced by one sentinel
    targets [noise + spans (+1 EOS)]      each sentinel followed by the noise span it replaced
with sentinels <extra_id_0>, <extra_id_1>, ... in order (`SentencePieceTokenizer.sentinel_id(i)`).
`span_corruption_lengths` gives the raw token count that corrupts to exactly a configured input length.

BART (Lewis et al. 2019; fairseq DenoisingDataset): `text_infilling`, `sentence_permutation`,
`token_masking`, `token_deletion` and `document_rotation` each return a noised copy of the tokens, with a
length that may differ from the input; `apply_noising` chains them. BART's decoder target is the original,
uncorrupted token array (the tokens passed in, not the noised ones), so these functions return only the
encoder input.
"""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def _previous(mask: np.ndarray) -> np.ndarray:
    """mask bool [N] shifted right by one: [N], False at 0."""
    return np.concatenate([[False], mask])[:-1]


def _num_runs(mask: np.ndarray) -> int:
    """Number of maximal runs of True in bool [N]."""
    return int((mask & ~_previous(mask)).sum())


# ----------------------------------------------------------------------------------------------- T5


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Uniformly random partition of `num_items` items into `num_segments` non-empty runs -> lengths [num_segments]."""
    if not 1 <= num_segments <= num_items:
        raise ValueError(
            f"cannot split {num_items} tokens into {num_segments} non-empty spans: noise_density is too high or "
            "mean_noise_span_length too small"
        )
    cuts = np.sort(rng.choice(num_items - 1, size=num_segments - 1, replace=False)) + 1
    return np.diff(np.concatenate([[0], cuts, [num_items]]))


def _noise_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """T5's (noise tokens, noise spans) for `length` >= 2 tokens, in float32 as T5's TensorFlow code.

    Noise tokens: round(length * noise_density) clipped to [1, length - 1]; spans: round(noise / mean), at
    least 1 (rounding half to even).
    """
    num_noise = int(np.round(np.float32(length) * np.float32(noise_density)))
    num_noise = min(max(num_noise, 1), length - 1)
    return num_noise, max(int(np.round(np.float32(num_noise) / np.float32(mean_noise_span_length))), 1)


def random_spans_noise_mask(
    length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0, *, rng: np.random.Generator
) -> np.ndarray:
    """T5's noise mask: bool [length], True on about length * noise_density tokens in random spans.

    As in T5: `_noise_counts` gives the number of noise tokens and spans (lengths below 2 are computed as 2
    and truncated), the noise and the non-noise tokens are each split into that many non-empty spans by
    uniformly random segmentation, and the spans alternate starting with non-noise (so the first token is
    never noise and the last always is). A density of 0 gives no noise.
    """
    if noise_density == 0.0:
        return np.zeros(length, dtype=bool)
    padded = max(length, 2)
    num_noise, num_spans = _noise_counts(padded, noise_density, mean_noise_span_length)
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)
    nonnoise_lengths = _random_segmentation(padded - num_noise, num_spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
    return np.repeat(np.arange(2 * num_spans) % 2 == 1, interleaved)[:length]


def _spans_to_sentinels(tokens: np.ndarray, spans: np.ndarray, sentinel_ids: np.ndarray) -> np.ndarray:
    """tokens [N], spans bool [N] -> tokens with the i-th run of True replaced by the single id sentinel_ids[i]."""
    previous = _previous(spans)
    first = spans & ~previous
    span_index = np.cumsum(first) - 1
    out = np.where(first, sentinel_ids[np.maximum(span_index, 0)], tokens)
    return out[~(spans & previous)]


def span_corruption(
    tokens: np.ndarray,
    *,
    rng: np.random.Generator,
    sentinel_ids: Sequence[int],
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    eos_id: int | None = None,
) -> dict[str, np.ndarray]:
    """T5 span corruption of tokens [N] -> {"inputs", "targets"}: see the module docstring for the layout.

    The noise mask comes from `random_spans_noise_mask`; sentinel_ids[i] is the id of <extra_id_i>. Noise
    span i becomes sentinel i in the inputs; in the targets the non-noise span before it becomes sentinel i
    (T5's noise_span_to_unique_sentinel and nonnoise_span_to_unique_sentinel). EOS is appended to both when
    `eos_id` is given.
    """
    tokens = np.asarray(tokens)
    noise = random_spans_noise_mask(len(tokens), noise_density, mean_noise_span_length, rng=rng)
    num_noise_spans = _num_runs(noise)
    needed = max(num_noise_spans, _num_runs(~noise))
    if needed > len(sentinel_ids):
        raise ValueError(
            f"span corruption of {len(tokens)} tokens made {num_noise_spans} noise spans and needs {needed} "
            f"sentinels, but only {len(sentinel_ids)} sentinel ids were given; use a tokenizer with more "
            "extra_ids or shorter examples"
        )
    sentinels = np.asarray(sentinel_ids, dtype=tokens.dtype)
    eos = [] if eos_id is None else [eos_id]
    inputs = _spans_to_sentinels(tokens, noise, sentinels)
    targets = _spans_to_sentinels(tokens, ~noise, sentinels)
    return {
        "inputs": np.concatenate([inputs, eos]).astype(tokens.dtype),
        "targets": np.concatenate([targets, eos]).astype(tokens.dtype),
    }


def span_corruption_lengths(
    inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """T5's random_spans_helper -> (tokens_length, targets_length), both counting one EOS in the outputs.

    tokens_length is the largest raw token count whose corrupted input (non-noise tokens + one sentinel per
    span + EOS) fits inputs_length; targets_length is the length of the targets it produces (noise tokens +
    one sentinel per span + EOS). Corrupting tokens_length tokens with `span_corruption(..., eos_id=...)`
    gives exactly these lengths. At noise_density 0.5, as in T5, tokens_length is lowered by one when the
    targets would be longer than inputs_length (the inputs may then be one short).

    Unlike T5's helper, the counts come from the mask's own `_noise_counts` (float32, clipped) and the
    density-0.5 adjustment recomputes the targets length instead of subtracting one, so the lengths are exact:
    T5's helper rounds in float64 without clipping and, for a few lengths (e.g. 172 at density 0.15, and
    lengths below 10), predicts outputs shorter than its mask produces. Elsewhere the two agree (512 -> 568, 114 at T5's
    defaults).
    """

    def corrupted_lengths(tokens_length: int) -> tuple[int, int]:
        num_noise, num_spans = _noise_counts(tokens_length, noise_density, mean_noise_span_length)
        return tokens_length - num_noise + num_spans + 1, num_noise + num_spans + 1

    tokens_length = inputs_length - 1
    while corrupted_lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    _, targets_length = corrupted_lengths(tokens_length)
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        _, targets_length = corrupted_lengths(tokens_length)
    return tokens_length, targets_length


def reconstruct_from_span_corruption(
    inputs: np.ndarray, targets: np.ndarray, sentinel_ids: Sequence[int], eos_id: int | None = None
) -> np.ndarray:
    """Inverse of `span_corruption`: inputs, targets -> the original tokens [N].

    Each sentinel in the inputs is replaced by the tokens that follow the same sentinel in the targets. A
    trailing `eos_id` is dropped from both first. Predicted targets work too, however malformed: a sentinel
    missing from them expands to nothing, tokens before their first sentinel belong to no span and are
    dropped, and of a repeated sentinel the last span counts.
    """
    inputs, targets = np.asarray(inputs), np.asarray(targets)
    if eos_id is not None:
        inputs = inputs[:-1] if len(inputs) and inputs[-1] == eos_id else inputs
        targets = targets[:-1] if len(targets) and targets[-1] == eos_id else targets
    parts = np.split(targets, np.flatnonzero(np.isin(targets, sentinel_ids)))
    spans = {int(part[0]): part[1:] for part in parts[1:]}
    sentinels = set(int(s) for s in sentinel_ids)
    pieces = [spans.get(t, targets[:0]) if t in sentinels else [t] for t in inputs.tolist()]
    return np.concatenate([np.asarray(p, dtype=inputs.dtype) for p in pieces]) if pieces else inputs[:0]


# --------------------------------------------------------------------------------------------- BART


def _candidates(tokens: np.ndarray, special_ids: Sequence[int]) -> np.ndarray:
    """Positions [M] of the tokens that are not special."""
    return np.flatnonzero(~np.isin(tokens, list(special_ids)))


def _poisson_span_lengths(rng: np.random.Generator, budget: int, poisson_lambda: float) -> np.ndarray:
    """Poisson(λ) span lengths drawn until they cover `budget` tokens, the last one cut to hit it exactly."""
    lengths = rng.poisson(poisson_lambda, size=budget)
    while lengths.sum() < budget:
        lengths = np.concatenate([lengths, rng.poisson(poisson_lambda, size=budget)])
    covered = np.cumsum(lengths)
    last = int(np.searchsorted(covered, budget))  # first span that reaches the budget
    lengths = lengths[: last + 1]
    lengths[last] -= covered[last] - budget
    return lengths


def text_infilling(
    tokens: np.ndarray,
    *,
    rng: np.random.Generator,
    mask_id: int,
    mask_ratio: float = 0.3,
    poisson_lambda: float = 3.0,
    special_ids: Sequence[int] = (),
) -> np.ndarray:
    """BART text infilling: tokens [N] -> [N'], spans replaced by a single `mask_id` each.

    Of the M tokens not in `special_ids`, exactly round(mask_ratio * M) are removed: span lengths are drawn
    from Poisson(poisson_lambda) until they cover that budget (the last one cut to fit, as in fairseq), and
    each span becomes one mask token; a zero-length span inserts a mask. Unlike fairseq, whose span starts
    are independent and may overlap, the spans are placed in a uniformly random non-overlapping order with at
    least one kept token between any two of them, so every mask stands for exactly one span (when there are
    more spans than kept tokens to separate them, the surplus spans merge into one). Special tokens are never
    removed or masked; a span that straddles one leaves it in place, with a mask on each side.
    """
    if poisson_lambda <= 0:
        raise ValueError(f"poisson_lambda must be positive; got {poisson_lambda}")
    positions = _candidates(tokens, special_ids)
    budget = int(round(mask_ratio * len(positions)))
    if budget == 0:
        return tokens.copy()
    lengths = _poisson_span_lengths(rng, budget, poisson_lambda)
    kept = len(positions) - budget
    if len(lengths) > kept + 1:
        lengths = np.append(lengths[:kept], lengths[kept:].sum())
    lengths = rng.permutation(lengths)
    slots = np.sort(rng.choice(kept + 1, size=len(lengths), replace=False))  # kept candidates before each span
    starts = slots + np.cumsum(lengths) - lengths  # candidate index where each span starts

    removed = np.zeros(len(tokens), dtype=bool)
    removed[positions[np.repeat(slots, lengths) + np.arange(budget)]] = True
    run_start = removed & ~_previous(removed)
    keep = ~removed | run_start
    out = np.where(run_start, mask_id, tokens)[keep]
    insert_at = np.append(positions, positions[-1] + 1)[starts[lengths == 0]]  # original index to insert before
    kept_before = np.concatenate([[0], np.cumsum(keep)])
    return np.insert(out, kept_before[insert_at], mask_id).astype(tokens.dtype)


def _split_ends(tokens: np.ndarray, keep_first: bool, keep_last: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens [N] -> (head, body, tail): the first/last token held aside when kept and present."""
    first = int(keep_first and len(tokens) > 0)
    last = len(tokens) - int(keep_last and len(tokens) > first)
    return tokens[:first], tokens[first:last], tokens[last:]


def sentence_permutation(
    tokens: np.ndarray,
    *,
    rng: np.random.Generator,
    sentence_end_ids: Sequence[int],
    keep_first: bool = True,
    keep_last: bool = True,
) -> np.ndarray:
    """BART sentence permutation: tokens [N] -> [N], sentences in a uniformly random order.

    A sentence ends after a run of `sentence_end_ids` tokens (e.g. the ids of ".", "!", "?"); trailing tokens
    without one form the last sentence. The first and last tokens (BOS/EOS) stay in place when `keep_first`
    and `keep_last`.
    """
    head, body, tail = _split_ends(tokens, keep_first, keep_last)
    is_end = np.isin(body, list(sentence_end_ids))
    ends = np.flatnonzero(is_end & ~np.concatenate([is_end[1:], [False]])) + 1
    sentences = np.split(body, ends[ends < len(body)])
    order = rng.permutation(len(sentences))
    return np.concatenate([head, *(sentences[i] for i in order), tail]).astype(tokens.dtype)


def token_masking(
    tokens: np.ndarray, *, rng: np.random.Generator, mask_id: int, ratio: float, special_ids: Sequence[int] = ()
) -> np.ndarray:
    """BART token masking: tokens [N] -> [N] with round(ratio * M) of the M non-special tokens, chosen
    uniformly, replaced by `mask_id`."""
    positions = _candidates(tokens, special_ids)
    chosen = rng.choice(positions, size=int(round(ratio * len(positions))), replace=False)
    out = tokens.copy()
    out[chosen] = mask_id
    return out


def token_deletion(
    tokens: np.ndarray, *, rng: np.random.Generator, ratio: float, special_ids: Sequence[int] = ()
) -> np.ndarray:
    """BART token deletion: tokens [N] -> [N - round(ratio * M)], deleting uniformly chosen non-special tokens
    (M of them); unlike masking, the model must find where tokens are missing."""
    positions = _candidates(tokens, special_ids)
    chosen = rng.choice(positions, size=int(round(ratio * len(positions))), replace=False)
    return np.delete(tokens, chosen)


def document_rotation(
    tokens: np.ndarray, *, rng: np.random.Generator, keep_first: bool = True, keep_last: bool = True
) -> np.ndarray:
    """BART document rotation: tokens [N] -> [N], rotated to start at a uniformly chosen token (possibly the
    current first, i.e. unrotated). The first and last tokens (BOS/EOS) stay in place when kept."""
    head, body, tail = _split_ends(tokens, keep_first, keep_last)
    start = int(rng.integers(len(body))) if len(body) else 0
    return np.concatenate([head, np.roll(body, -start), tail]).astype(tokens.dtype)


NOISING: dict[str, Callable[..., np.ndarray]] = {
    "text_infilling": text_infilling,
    "sentence_permutation": sentence_permutation,
    "token_masking": token_masking,
    "token_deletion": token_deletion,
    "document_rotation": document_rotation,
}


def apply_noising(
    tokens: np.ndarray, steps: Sequence[tuple[str, dict[str, Any]]], *, rng: np.random.Generator
) -> np.ndarray:
    """Chain BART noising functions: tokens [N] -> noised encoder input [N'].

    `steps` is a list of (name in NOISING, keyword arguments), applied in order with the shared `rng`, e.g.
    BART's best setting [("sentence_permutation", {"sentence_end_ids": [dot]}),
    ("text_infilling", {"mask_id": mask, "special_ids": [bos, eos]})]. The decoder target is the original
    `tokens`.
    """
    unknown = [name for name, _ in steps if name not in NOISING]
    if unknown:
        raise ValueError(f"unknown noising step(s) {unknown}; valid names are {sorted(NOISING)}")
    for name, kwargs in steps:
        tokens = NOISING[name](tokens, rng=rng, **kwargs)
    return tokens
