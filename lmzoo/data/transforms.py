"""Stateless data transforms: pure functions of numpy arrays (and an explicit rng when random).

Language-model batches are windows over a token stream in which documents are concatenated,
each followed by EOS. A window of T+1 tokens becomes a packed example:
    inputs      [B, T]  tokens 0..T-1 of the window
    targets     [B, T]  tokens 1..T (next-token targets)
    weights     [B, T]  1 where input and target belong to the same document
    segment_ids [B, T]  1, 2, ... per document piece inside the row (attention never crosses them)
    positions   [B, T]  position inside the document piece, restarting at 0
"""

import numpy as np


def check_token_ids(tokens: np.ndarray, vocab_size: int, *, where: str) -> None:
    """Raises if any id is outside [0, vocab_size): JAX would silently clamp the gather."""
    if tokens.size == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{where}: token id {high if high >= vocab_size else low} is outside the model's vocabulary "
            f"[0, {vocab_size}); set config.model.vocab_size to at least the tokenizer's vocab size ({high + 1} needed)"
        )


def concat_documents(docs: list[list[int]], eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (tokens [N], doc_ids [N]) with EOS appended to each document when given."""
    if eos_id is not None:
        docs = [d + [eos_id] for d in docs]
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    tokens = np.fromiter((t for d in docs for t in d), dtype=np.int32, count=int(lengths.sum()))
    doc_ids = np.repeat(np.arange(len(docs), dtype=np.int32), lengths)
    return tokens, doc_ids


def segment_positions(doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """doc_ids [B, T] -> (segment_ids [B, T] counting from 1 per row, positions [B, T])."""
    b, t = doc_ids.shape
    boundary = np.ones((b, t), dtype=bool)
    boundary[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    segment_ids = np.cumsum(boundary, axis=1, dtype=np.int32)
    index = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    segment_start = np.maximum.accumulate(np.where(boundary, index, 0), axis=1)
    return segment_ids, (index - segment_start).astype(np.int32)


def lm_windows(tokens: np.ndarray, doc_ids: np.ndarray, starts: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """Packed next-token examples from windows [start, start + length] of a stream; see module doc.

    Windows running past the end of the stream are padded with weight 0 and segment id 0.
    """
    index = starts[:, None] + np.arange(length + 1)[None, :]
    valid = index < len(tokens)
    index = np.minimum(index, len(tokens) - 1)
    window, docs = tokens[index], np.where(valid, doc_ids[index], -1)
    segment_ids, positions = segment_positions(docs[:, :-1])
    in_doc = (docs[:, :-1] == docs[:, 1:]) & valid[:, 1:]
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
