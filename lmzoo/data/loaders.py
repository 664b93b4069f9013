"""Loaders beyond `pipeline`'s (packed LM windows, examples): contiguous streams for truncated BPTT, whole
sentences (counted n-grams, ELMo, the VAE LM), and PPO-ptx's prompts joined with demonstrations. Batch `step` of
each is a pure function of (seed, step, process), so a resumed run reads exactly what it would have.
"""

import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np

from lmzoo.data.pipeline import ExampleLoader, epoch_permutation


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which rows of every global batch this process materialises."""

    process_index: int = 0
    process_count: int = 1


def stream_rows(tokens: np.ndarray, rows: int, *, pad: bool) -> tuple[np.ndarray, np.ndarray]:
    """[N] stream -> (ids [rows, R + 1], weights [rows, R]): row r continues where row r - 1 stops.

    pad=False drops the tail that does not fill every row (training, as Zaremba et al.); pad=True keeps
    every target (R = ceil((N - 1) / rows), padded targets weighted 0). Consecutive rows share one
    token, the last input of one being the first of the next.
    """
    targets = len(tokens) - 1
    length = -(-targets // rows) if pad else targets // rows
    if length < 1:
        raise ValueError(f"a stream of {len(tokens)} tokens is too short for {rows} rows")
    padded = np.concatenate([tokens, np.zeros(max(rows * length + 1 - len(tokens), 0), tokens.dtype)])
    starts = np.arange(rows)[:, None] * length
    ids = padded[starts + np.arange(length + 1)]
    weights = (starts + np.arange(length) < targets).astype(np.float32)
    return ids, weights


def window(ids: np.ndarray, weights: np.ndarray, index: int, seq_len: int) -> dict[str, np.ndarray]:
    """Window `index` of every row: inputs, targets, weights [B, T] (padded with weight 0), reset [B]."""
    start = index * seq_len
    pad = lambda x: np.pad(x, ((0, 0), (0, seq_len - x.shape[1])))  # noqa: E731
    inputs = pad(ids[:, start : start + seq_len])
    targets = pad(ids[:, start + 1 : start + seq_len + 1])
    w = pad(weights[:, start : start + seq_len])
    reset = np.full(ids.shape[0], float(index == 0), np.float32)
    return {"inputs": inputs, "targets": targets, "weights": w, "reset": reset}


@dataclasses.dataclass(frozen=True)
class StreamLoader:
    """Training batches: step s reads window s mod windows_per_epoch of every contiguous row.

    Each process holds its own rows of the global batch (rows stay whole streams)."""

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self):
        ids, weights = stream_rows(self.tokens, self.batch_size, pad=False)
        if self.batch_size % self.process_count:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by {self.process_count} processes")
        local = self.batch_size // self.process_count
        mine = slice(self.process_index * local, (self.process_index + 1) * local)
        object.__setattr__(self, "_ids", ids[mine])
        object.__setattr__(self, "_weights", weights[mine])

    @property
    def dataset_size(self) -> str:
        return f"{len(self.tokens):,} tokens"

    @property
    def windows_per_epoch(self) -> int:
        """Whole windows of every row (Zaremba's epoch_size = (row_len - 1) // num_steps)."""
        return (self._ids.shape[1] - 1) // self.seq_len

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return window(self._ids, self._weights, step % self.windows_per_epoch, self.seq_len)


def stream_eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, shard: Shard):
    """Every target of a split once: consecutive windows of `batch_size` contiguous rows (this process's rows)."""
    ids, weights = stream_rows(tokens, batch_size, pad=True)
    local = batch_size // shard.process_count
    mine = slice(shard.process_index * local, (shard.process_index + 1) * local)
    for index in range(math.ceil(weights.shape[1] / seq_len)):
        yield window(ids[mine], weights[mine], index, seq_len)


def sentence_rows(tokens: np.ndarray, eos_id: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """[N] stream of sentences each ending in eos -> (ids [sentences, max_len], weights), padded with 0 / weight 0."""
    ends = np.flatnonzero(tokens == eos_id) + 1
    if len(ends) == 0 or ends[-1] != len(tokens):
        raise ValueError("the stream must end with <eos>: every sentence (line) ends with one")
    starts = np.concatenate([[0], ends[:-1]])
    lengths = ends - starts
    if lengths.max() > max_len:
        raise ValueError(
            f"sentence {int(np.argmax(lengths))} has {lengths.max()} tokens with its <eos>, more than "
            f"config.data.seq_len={max_len}; raise config.data.seq_len to at least {lengths.max()}"
        )
    columns = np.arange(max_len)
    weights = (columns < lengths[:, None]).astype(np.float32)
    ids = np.where(weights > 0, tokens[np.minimum(starts[:, None] + columns, len(tokens) - 1)], 0)
    return ids.astype(np.int32), weights


def padded_width(weights: np.ndarray, multiple: int) -> int:
    """weights [B, T] -> the columns a batch needs: its last weighted column + 1 rounded up to `multiple`, at
    most T (T when multiple is 0). The rounding bounds the distinct widths, hence the recompilations of a jitted
    step, by T / multiple."""
    t = weights.shape[1]
    if multiple <= 0:
        return t
    used = int(np.max(np.flatnonzero(np.any(weights > 0, axis=0)), initial=-1)) + 1
    return min(t, max(multiple, -(-used // multiple) * multiple))


@dataclasses.dataclass(frozen=True)
class SentenceLoader:
    """Batch `step` is sentences [step * B, (step + 1) * B) in file order; the last batch is padded with weight 0.

    With length_multiple > 0 the columns past the global batch's longest sentence, rounded up to that
    multiple, are cut (`padded_width`), so short sentences are not padded to the corpus's longest."""

    ids: np.ndarray
    weights: np.ndarray
    batch_size: int
    process_index: int = 0
    process_count: int = 1
    length_multiple: int = 0

    @property
    def num_batches(self) -> int:
        return math.ceil(len(self.ids) / self.batch_size)

    @property
    def dataset_size(self) -> str:
        return f"{len(self.ids):,} sentences ({int(self.weights.sum()):,} tokens)"

    def batch(self, step: int) -> dict[str, np.ndarray]:
        first = step * self.batch_size
        return self.rows(np.arange(first, min(first + self.batch_size, len(self.ids))))

    def rows(self, order: np.ndarray) -> dict[str, np.ndarray]:
        """The global batch of sentences `order` [<= B]: this process's rows, padded to B / processes with weight 0."""
        width = padded_width(self.weights[order], self.length_multiple)
        local = self.batch_size // self.process_count
        mine = order[self.process_index * local : (self.process_index + 1) * local]
        ids, weights = self.ids[mine, :width], self.weights[mine, :width]
        missing = local - len(ids)
        pad = lambda x: np.pad(x, ((0, missing), (0, 0)))  # noqa: E731
        return {"targets": pad(ids), "weights": pad(weights)}


@dataclasses.dataclass(frozen=True)
class ShuffledSentences:
    """Training batch `step`: `batch_size` sentences of a fresh permutation per epoch from (seed, epoch), bucketed
    by length, then `transform`ed (e.g. decoder inputs added).

    The permuted stream is cut into pools of `pool_batches` batches; a pool's sentences are sorted by length
    and cut into batches, taken in an order shuffled from (seed, pool). Each sentence is still read once an
    epoch, and a batch holds sentences of similar length, so the loader's `length_multiple` trims most padding.
    `transform(batch, rng)` gets a generator fixed by (seed, step, process), so random edits survive restarts."""

    sentences: SentenceLoader
    seed: int
    pool_batches: int = 1
    transform: Callable[[dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]] | None = None

    @property
    def dataset_size(self) -> str:
        return self.sentences.dataset_size

    def batch(self, step: int) -> dict[str, np.ndarray]:
        size, count = self.sentences.batch_size, len(self.sentences.ids)
        pool, slot = divmod(step, self.pool_batches)
        first = pool * self.pool_batches * size
        _, members = epoch_permutation(np.arange(first, first + self.pool_batches * size), count, self.seed)
        members = members[np.argsort(np.sum(self.sentences.weights[members], axis=1), kind="stable")]
        position = np.random.default_rng([self.seed, pool, 1]).permutation(self.pool_batches)[slot]
        batch = self.sentences.rows(members[position * size : (position + 1) * size])
        if self.transform is None:
            return batch
        return self.transform(batch, np.random.default_rng([self.seed, step, self.sentences.process_index, 2]))


def length_sorted_batches(sentences: SentenceLoader) -> Iterator[dict[str, np.ndarray]]:
    """Every sentence once, in batches of similar length (the split sorted by length), the batches in a fixed
    shuffled order: the first batch holds sentences of a typical length, not the shortest."""
    order = np.argsort(np.sum(sentences.weights, axis=1), kind="stable")
    size = sentences.batch_size
    for index in np.random.default_rng(0).permutation(sentences.num_batches):
        yield sentences.rows(order[index * size : (index + 1) * size])


@dataclasses.dataclass(frozen=True)
class PromptsAndDemonstrations:
    """PPO-ptx training batches: the rollout prompts and packed SFT demonstrations (keys prefixed by `prefix`),
    each loader's batch a function of the step, so a resumed run reads the same demonstrations."""

    prompts: ExampleLoader
    demonstrations: ExampleLoader
    prefix: str

    @property
    def dataset_size(self) -> str:
        return f"{self.prompts.num_examples:,} prompts + {self.demonstrations.num_examples:,} packed demonstration rows"

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rows = self.demonstrations.batch(step)
        return {**self.prompts.batch(step), **{self.prefix + k: v for k, v in rows.items()}}
