"""Stateless data transforms: pure functions of numpy arrays (and an explicit rng when random).

Language-model batches are windows over a token stream in which documents are concatenated,
each followed by EOS. A window of T+1 tokens becomes a packed example:
    inputs      [B, T]  tokens 0..T-1 of the window
    targets     [B, T]  tokens 1..T (next-token targets)
    weights     [B, T]  1 where input and target belong to the same document
    segment_ids [B, T]  1, 2, ... per document piece inside the row (attention never crosses them)
    positions   [B, T]  position inside the document piece, restarting at 0

Masked-LM transforms (BERT/RoBERTa/ALBERT) build sentence pairs ([CLS] A [SEP] B [SEP]) with NSP or SOP
labels and corrupt them with `mask_tokens`; their randomness comes from `masking_rng`.
"""

import re
from collections.abc import Sequence

import numpy as np


def check_token_ids(tokens: np.ndarray, vocab_size: int, *, where: str) -> None:
    """Raises if any id is outside [0, vocab_size): JAX would silently clamp the gather."""
    if tokens.size == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0:
        raise ValueError(
            f"{where}: token id {low} is negative; no vocabulary has it, so the tokenizer (config.data.tokenizer) or "
            "the data's ids are wrong, not config.model.vocab_size"
        )
    if high >= vocab_size:
        raise ValueError(
            f"{where}: token id {high} is outside the model's vocabulary "
            f"[0, {vocab_size}); set config.model.vocab_size to at least the tokenizer's vocab size ({high + 1} needed)"
        )


def segment_positions(doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """doc_ids [B, T] -> (segment_ids [B, T] counting from 1 per row, positions [B, T]).

    Works on the flat array's segment starts (few), so its cost is a handful of passes over [B, T]."""
    b, t = doc_ids.shape
    boundary = np.ones((b, t), dtype=bool)
    np.not_equal(doc_ids[:, 1:], doc_ids[:, :-1], out=boundary[:, 1:])
    starts = np.flatnonzero(boundary)
    lengths = np.diff(np.append(starts, b * t))
    row_first = np.searchsorted(starts, np.arange(b) * t)
    number_in_row = np.arange(len(starts)) - row_first[starts // t] + 1
    segment_ids = np.repeat(number_in_row.astype(np.int32), lengths).reshape(b, t)
    positions = (np.arange(b * t) - np.repeat(starts, lengths)).astype(np.int32).reshape(b, t)
    return segment_ids, positions


def lm_windows(window: np.ndarray, documents: np.ndarray) -> dict[str, np.ndarray]:
    """Packed next-token examples from windows [B, T+1] of a stream and the document of each token [B, T+1] (-1 past
    the stream's end, as `TokenSplit.windows` gives them); see module doc. Positions past the end get weight 0 and
    segment id 0."""
    valid = documents >= 0
    segment_ids, positions = segment_positions(documents[:, :-1])
    in_doc = (documents[:, :-1] == documents[:, 1:]) & valid[:, 1:]
    return {
        "inputs": window[:, :-1],
        "targets": window[:, 1:],
        "weights": in_doc.astype(np.float32),
        "segment_ids": np.where(valid[:, :-1], segment_ids, 0).astype(np.int32),
        "positions": positions,
    }


def random_window_starts(rng: np.random.Generator, num_tokens: int, length: int, count: int) -> np.ndarray:
    """Uniform window starts (nanoGPT's sampler): [count] ints in [0, num_tokens - length - 1)."""
    return rng.integers(0, num_tokens - length - 1, size=count)


def masking_rng(seed: int, example_index: np.ndarray | int, *, epoch: int | None) -> np.random.Generator:
    """Generator for `mask_tokens`: static masking when `epoch` is None, dynamic (new mask each epoch) otherwise.

    The same (seed, example_index, epoch) always gives the same generator, so masks survive restarts. An array
    `example_index` [B] seeds one generator for the whole batch: its masks are static only while the batch keeps
    the same examples in the same order; for per-example static masks, mask each example with its own index.
    """
    entropy = [seed, *(int(i) for i in np.ravel(example_index))]
    return np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=() if epoch is None else (epoch,)))


def mask_tokens(
    tokens: np.ndarray,
    *,
    rng: np.random.Generator,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int],
    rate: float = 0.15,
    mask_fraction: float = 0.8,
    random_fraction: float = 0.1,
    word_starts: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """BERT masking: tokens [B, T] -> "inputs", "targets" (= tokens), "weights" (1.0 where selected) [B, T].

    Candidates are positions whose token is not in `special_ids` (pass pad, cls, sep, mask, ...). Each row
    selects exactly round(rate * candidates) of them (half to even, as Python's round in Google's
    create_pretraining_data), at least 1 when it has any, by taking a uniformly random permutation of the
    candidates and keeping its head. Of the selected tokens, `mask_fraction` become `mask_id`,
    `random_fraction` a uniform id from [0, vocab_size) minus `special_ids`, and the rest stay unchanged
    (a per-token draw, so the fractions hold in expectation).

    Whole-word masking when `word_starts` [B, T] bool is given: a word is a start position plus the following
    non-start candidates (a candidate after a special token always starts a word). Words are taken in random
    order until the row's budget of tokens is reached, so the last word may overshoot it by less than its own
    length (Google/HF instead skip words that would overshoot); every piece of a taken word is selected.

    Static vs dynamic masking is the caller's choice of `rng` (see `masking_rng`): dynamic (RoBERTa) draws a
    fresh mask each time an example is seen, from an rng derived from (seed, step) or (seed, epoch, index);
    static (BERT) fixes the rng once from (seed, example index) (BERT's `dupe_factor` duplicates each example
    with different masks: use epoch % dupe_factor as the dynamic epoch).
    """
    b, t = tokens.shape
    candidate = ~np.isin(tokens, special_ids)
    count = candidate.sum(axis=1)
    budget = np.where(count > 0, np.maximum(np.round(rate * count), 1), 0)

    if word_starts is None:
        starts = candidate  # every candidate is a word of its own
    else:
        after_candidate = np.zeros_like(candidate)
        after_candidate[:, 1:] = candidate[:, :-1]
        starts = candidate & (word_starts | ~after_candidate)
    # Word index of each candidate within its row; positions before a row's first word map to 0, unused.
    word = np.maximum(np.cumsum(starts, axis=1) - 1, 0)
    rows = np.arange(b)[:, None]
    lengths = np.bincount((rows * t + word)[candidate], minlength=b * t).reshape(b, t)  # [B, words]
    # Words in random order (missing words have length 0 and are never taken); take while under budget.
    order = np.argsort(rng.random((b, t)), axis=1)
    sorted_lengths = np.take_along_axis(lengths, order, axis=1)
    taken_before = np.cumsum(sorted_lengths, axis=1) - sorted_lengths
    chosen = np.zeros((b, t), dtype=bool)
    np.put_along_axis(chosen, order, (sorted_lengths > 0) & (taken_before < budget[:, None]), axis=1)
    selected = candidate & np.take_along_axis(chosen, word, axis=1)

    action = rng.random((b, t))
    allowed = np.setdiff1d(np.arange(vocab_size), special_ids)
    random_tokens = allowed[rng.integers(0, len(allowed), size=(b, t))].astype(tokens.dtype)
    inputs = np.where(action < mask_fraction + random_fraction, random_tokens, tokens)
    inputs = np.where(action < mask_fraction, mask_id, inputs)
    return {
        "inputs": np.where(selected, inputs, tokens).astype(tokens.dtype),
        "targets": tokens.copy(),
        "weights": selected.astype(np.float32),
    }


def continuation_mask_from_vocab(vocab: list[str]) -> np.ndarray:
    """WordPiece vocabulary (vocab.txt lines, in id order) -> [vocab] bool, True for "##" continuation pieces."""
    return np.array([piece.startswith("##") for piece in vocab], dtype=bool)


def wordpiece_word_starts(tokens: np.ndarray, continuation_mask: np.ndarray) -> np.ndarray:
    """tokens [B, T] -> word_starts [B, T] bool: True where the token is not a "##" continuation piece."""
    return ~continuation_mask[tokens]


def truncated_lengths(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths of a text pair cut to fit `budget` tokens: the longer side loses its last token until the
    pair fits (B on ties), as in BERT's truncate_seq_pair."""
    excess = max(len_a + len_b - budget, 0)
    cut_a, cut_b = min(max(len_a - len_b, 0), excess), min(max(len_b - len_a, 0), excess)
    rest = excess - cut_a - cut_b  # then both sides are equal and lose tokens in turn, B first
    return len_a - cut_a - rest // 2, len_b - cut_b - (rest - rest // 2)


def pair_example(
    first: list[int], second: list[int] | None, *, cls_id: int, sep_id: int, max_len: int, pad_id: int
) -> dict[str, np.ndarray]:
    """[CLS] A [SEP] B [SEP] (or [CLS] A [SEP] when second is None), padded to max_len:
    "tokens", "token_type_ids", "segment_ids" [max_len] int32.

    token_type_ids are 0 for [CLS] A [SEP] (and padding), 1 for B [SEP]; segment_ids are the attention mask,
    1 for real tokens and 0 for padding. When too long, the longer side loses its last token until the pair
    fits (B on ties), as in BERT's truncate_seq_pair.
    """
    specials = 2 if second is None else 3
    if max_len < specials:
        raise ValueError(f"pair_example needs max_len >= {specials} for [CLS] and [SEP]s; got {max_len}")
    second_part = second or []
    len_a, len_b = truncated_lengths(len(first), len(second_part), max_len - specials)
    tail = [] if second is None else [*second_part[:len_b], sep_id]
    real = [cls_id, *first[:len_a], sep_id, *tail]
    pad = max_len - len(real)
    return {
        "tokens": np.array(real + [pad_id] * pad, dtype=np.int32),
        "token_type_ids": np.array([0] * (len_a + 2) + [1] * len(tail) + [0] * pad, dtype=np.int32),
        "segment_ids": np.array([1] * len(real) + [0] * pad, dtype=np.int32),
    }


class SentenceLists:
    """Documents held as lists of sentences (each a token list): what `SentencePairs` reads, as a store's
    sentence index (`lmzoo.data.store.TokenSplit`) offers it. counts [D]: sentences of each document."""

    def __init__(self, sentences_by_doc: Sequence[Sequence[Sequence[int]]]):
        self.sentences_by_doc = sentences_by_doc
        self.counts = np.array([len(doc) for doc in sentences_by_doc], np.int64)

    def sentence(self, document: int, index: int) -> Sequence[int]:
        return self.sentences_by_doc[document][index]


def _consecutive_positions(counts: np.ndarray) -> np.ndarray:
    """[D + 1] cumulative counts of the (document, sentence) positions that have a next sentence in their document,
    in document then sentence order: position k is in document searchsorted(result, k, "right") - 1."""
    positions = np.concatenate([[0], np.cumsum(np.maximum(np.asarray(counts, np.int64) - 1, 0))])
    if not positions[-1]:
        raise ValueError("sentence pairs need at least one document with two or more sentences")
    return positions


def _position(positions: np.ndarray, k: int) -> tuple[int, int]:
    document = int(np.searchsorted(positions, k, side="right")) - 1
    return document, int(k - positions[document])


class SentencePairs:
    """`size` sentence pairs (a, b, label) of `sentences`, each drawn when read: pair k is a function of (seed, k)
    alone, so any pair of any split, however large, is read without the others.

    `sentences` is `SentenceLists` or a store split's sentence index (`counts` [D] and `sentence(d, i)`). Pair k's
    first sentence is the (k * P // size)-th of the P sentences that have a successor in their document, in document
    then sentence order (size None: P, each once). `kind`:
      "nsp" (BERT; HF BertForPreTraining's `next_sentence_label`): label 0, b is a's successor (is next); label 1,
        b is a random sentence of a different document (probability 1/2 each).
      "sop" (ALBERT; HF AlbertForPreTraining's `sentence_order_label`): a and its successor; label 0 in their
        order, label 1 swapped (probability 1/2 each).
    """

    def __init__(self, sentences, *, kind: str, seed: int, size: int | None = None):
        if kind not in ("nsp", "sop"):
            raise ValueError(f"unknown sentence-pair kind {kind!r}; choose 'nsp' or 'sop'")
        self.sentences, self.kind, self.seed = sentences, kind, seed
        self.counts = np.asarray(sentences.counts)
        self.positions = _consecutive_positions(self.counts)
        self.size = int(self.positions[-1]) if size is None else size
        self.nonempty = np.flatnonzero(self.counts)
        if kind == "nsp" and len(self.nonempty) < 2:
            raise ValueError("NSP needs at least two non-empty documents to draw random next sentences from")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> tuple[Sequence[int], Sequence[int], int]:
        k = int(k)
        if not 0 <= k < self.size:
            raise IndexError(f"sentence pair {k} of {self.size}")
        rng = np.random.default_rng([self.seed, k])
        d, i = _position(self.positions, k * int(self.positions[-1]) // self.size)
        first = self.sentences.sentence(d, i)
        if self.kind == "sop":
            successor = self.sentences.sentence(d, i + 1)
            return (successor, first, 1) if rng.random() < 0.5 else (first, successor, 0)
        if rng.random() >= 0.5:
            return first, self.sentences.sentence(d, i + 1), 0
        other = int(rng.integers(len(self.nonempty) - 1))
        rank = int(np.searchsorted(self.nonempty, d))
        doc = int(self.nonempty[other + (other >= rank)])
        return first, self.sentences.sentence(doc, int(rng.integers(self.counts[doc]))), 1


# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket), then whitespace, then an
# upper-case letter, digit or opening quote/bracket. A period after a single letter (initials, "e.g.", "U.S.")
# or after Mr/Mrs/Ms/Dr/St/Mt/Jr/Sr/vs does not end a sentence.
_SENTENCE_END = re.compile(
    r"""(?:(?<=[.!?])|(?<=[.!?]["')\]]))(?<!\b[A-Za-z]\.)(?<!\b(?:Mr|Ms|Dr|St|Mt|Jr|Sr|vs)\.)(?<!\bMrs\.)"""
    r"""\s+(?=["'(\[]?[A-Z0-9])"""
)


def split_sentences(text: str, *, wrapped: bool = False) -> list[str]:
    """Non-empty sentences of English prose, whitespace collapsed; see _SENTENCE_END for the rule.

    Line breaks are boundaries too: every line break by default (one gloss per line, as in
    wordnet30_glosses.txt), only blank lines when `wrapped` (hard-wrapped paragraphs, as in kjv.txt, where
    single line breaks fall mid-sentence). Other abbreviations ("etc.", "Gen.") end sentences; verse
    numbers and other markup stay in the text.
    """
    blocks = re.split(r"\n\s*\n", text) if wrapped else text.splitlines()
    return [s for block in blocks for s in _SENTENCE_END.split(" ".join(block.split())) if s]


def mask_rows(
    tokens: np.ndarray,
    example_ids: np.ndarray,
    epochs: np.ndarray,
    *,
    seed: int,
    static: bool,
    continuation_mask: np.ndarray | None = None,
    **mask_kwargs,
) -> dict[str, np.ndarray]:
    """`mask_tokens` row by row, row i with `masking_rng(seed, example_ids[i])`: the same mask every
    epoch if `static` (BERT), a fresh one per epoch otherwise (RoBERTa). tokens [B, T] -> inputs/targets/weights.
    continuation_mask [vocab] (WordPiece "##" pieces) turns on whole-word masking."""
    rows = [
        mask_tokens(
            tokens[i : i + 1],
            rng=masking_rng(seed, int(example_ids[i]), epoch=None if static else int(epochs[i])),
            word_starts=None
            if continuation_mask is None
            else wordpiece_word_starts(tokens[i : i + 1], continuation_mask),
            **mask_kwargs,
        )
        for i in range(tokens.shape[0])
    ]
    return {k: np.concatenate([r[k] for r in rows]) for k in ("inputs", "targets", "weights")}


def mlm_from_windows(
    batch: dict[str, np.ndarray],
    example_ids: np.ndarray,
    epochs: np.ndarray,
    *,
    cls_id: int,
    sep_id: int,
    pad_id: int,
    **mask_kwargs,
) -> dict[str, np.ndarray]:
    """Packed LM windows -> masked-LM examples `[CLS] window [SEP]` (RoBERTa's full-sentences input).

    batch["inputs"], batch["segment_ids"] [B, T-2] -> inputs, targets, weights, segment_ids [B, T];
    padding (segment 0) becomes pad_id. mask_kwargs go to `mask_rows`.
    """
    b = batch["inputs"].shape[0]
    segments = batch["segment_ids"]
    segment_ids = np.concatenate([segments[:, :1], segments, segments[:, -1:]], axis=1).astype(np.int32)
    tokens = np.concatenate([np.full((b, 1), cls_id), batch["inputs"], np.full((b, 1), sep_id)], axis=1)
    tokens = np.where(segment_ids == 0, pad_id, tokens).astype(np.int32)
    return {**mask_rows(tokens, example_ids, epochs, **mask_kwargs), "segment_ids": segment_ids}


def seq2seq_from_windows(
    batch: dict[str, np.ndarray],
    example_ids: np.ndarray,
    epochs: np.ndarray,
    *,
    noise,
    seed: int,
    inputs_length: int,
    targets_length: int,
    pad_id: int,
    decoder_start_id: int,
) -> dict[str, np.ndarray]:
    """Token windows -> denoising examples, row by row with `masking_rng(seed, id, epoch)`.

    batch["inputs"] [B, W] (padding where segment_ids is 0); noise(tokens [w], rng=) -> {"inputs", "targets"}
    (span corruption or BART noising). Returns inputs / encoder_segment_ids [B, inputs_length] and
    targets / decoder_inputs (targets shifted right after decoder_start_id) / weights [B, targets_length].
    Rows without tokens (padding of the last evaluation batch) get weight 0 everywhere.
    """
    b = batch["inputs"].shape[0]
    out = {
        "inputs": np.full((b, inputs_length), pad_id, np.int32),
        "targets": np.full((b, targets_length), pad_id, np.int32),
    }
    for i in range(b):
        tokens = batch["inputs"][i][batch["segment_ids"][i] != 0]
        example = noise(tokens, rng=masking_rng(seed, int(example_ids[i]), epoch=int(epochs[i])))
        for key, length in (("inputs", inputs_length), ("targets", targets_length)):
            if len(example[key]) > length:
                raise ValueError(f"noised {key} have {len(example[key])} tokens, more than the configured {length}")
            out[key][i, : len(example[key])] = example[key]
    out["encoder_segment_ids"] = (out["inputs"] != pad_id).astype(np.int32)
    real_rows = np.any(batch["segment_ids"] != 0, axis=1)
    out["weights"] = ((out["targets"] != pad_id) & real_rows[:, None]).astype(np.float32)
    out["decoder_inputs"] = shift_right(out["targets"], decoder_start_id)
    return out


def shift_right(targets: np.ndarray, start_id: int) -> np.ndarray:
    """Decoder inputs (teacher forcing): targets [B, T] shifted one step right with `start_id` first."""
    return np.concatenate([np.full((len(targets), 1), start_id, targets.dtype), targets[:, :-1]], axis=1)


def gpt_classifier_example(
    first: list[int],
    second: list[int] | None,
    *,
    start_id: int,
    delim_id: int,
    extract_id: int,
    max_len: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """GPT's (Radford et al. 2018) classification input `[START] a [DELIM] b [EXTRACT]`, right-padded:
    "tokens", "segment_ids" [max_len] int32. The head reads the final state at the last real token
    (pooling="last"), the [EXTRACT] token. Truncates the longer text first."""
    fixed = 2 if second is None else 3
    len_a, len_b = truncated_lengths(len(first), len(second or []), max_len - fixed)
    middle = [] if second is None else [delim_id, *second[:len_b]]
    real = [start_id, *first[:len_a], *middle, extract_id]
    pad = max_len - len(real)
    return {
        "tokens": np.array(real + [pad_id] * pad, dtype=np.int32),
        "segment_ids": np.array([1] * len(real) + [0] * pad, dtype=np.int32),
    }
