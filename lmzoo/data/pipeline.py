"""Deterministic, resumable batch loaders: packed windows of token stores (`lmzoo.data.store`) and fixed examples.

A loader's batch for step `s` is a pure function of (seed, s, process index), so its position
is one integer saved in every checkpoint, and a resumed run sees exactly the batches an
uninterrupted run would have seen. Each process materialises only its rows of the global batch.
"""

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import numpy as np

from lmzoo.data import transforms
from lmzoo.data.store import TokenSplit

log = logging.getLogger(__name__)


def epoch_permutation(flat_index: np.ndarray, num_examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Position i of an endless stream of epochs, each a fresh permutation from (seed, epoch) -> (epochs, example ids)."""
    epochs, offsets = np.divmod(flat_index, num_examples)
    ids = np.empty_like(flat_index)
    for epoch in np.unique(epochs):
        order = np.random.default_rng([seed, int(epoch)]).permutation(num_examples)
        ids[epochs == epoch] = order[offsets[epochs == epoch]]
    return epochs, ids


@dataclasses.dataclass(frozen=True)
class LMLoader:
    """Batches of packed next-token windows of one token split, or of a mixture of several; `batch(step)` is
    deterministic and random-access.

    sampler "random": uniform window starts drawn from (seed, step) (nanoGPT); with several splits each row first
    draws its split by `weights` from the same generator. "sequential": non-overlapping windows of one split,
    reshuffled every epoch from (seed, epoch).

    Where a split is a store in a bucket, `batch(step)` also starts fetching the windows of the next `prefetch_steps`
    steps into the local cache in a background thread; what a batch holds does not depend on it.
    """

    splits: Sequence[TokenSplit]
    batch_size: int
    seq_len: int
    seed: int
    sampler: str = "random"
    process_index: int = 0
    process_count: int = 1
    transform: Callable[..., dict[str, np.ndarray]] | None = None  # (batch, example_ids [b], epochs [b]) -> batch
    weights: Sequence[float] = (1.0,)
    names: Sequence[str] = ()  # of the mixture's splits, for the start summary
    prefetch_steps: int = 8

    def __post_init__(self):
        remote = any(split.pages is not None for split in self.splits) and self.prefetch_steps > 0
        # The steps ahead are fetched concurrently, each in one round trip (`TokenSplit.fetch`).
        prefetcher = concurrent.futures.ThreadPoolExecutor(self.prefetch_steps, "lmzoo-prefetch") if remote else None
        object.__setattr__(self, "_prefetcher", prefetcher)
        object.__setattr__(self, "_prefetched", {})  # step -> its fetch in flight
        if self.sampler not in ("random", "sequential"):
            raise ValueError(f"unknown sampler {self.sampler!r}; choose 'random' or 'sequential'")
        if len(self.weights) != len(self.splits) or min(self.weights) <= 0:
            raise ValueError(f"mixture weights {list(self.weights)} must be > 0, one per split ({len(self.splits)})")
        if len(self.splits) > 1 and self.sampler != "random":
            raise ValueError("a mixture of stores draws random windows; set config.data.sampler='random'")
        for split in self.splits:
            if split.num_tokens < self.seq_len + 2:
                raise ValueError(
                    f"the training split {split.name} has {split.num_tokens} tokens, fewer than seq_len + 2 = "
                    f"{self.seq_len + 2}; use more data or a shorter config.data.seq_len"
                )
        if self.batch_size % self.process_count:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by {self.process_count} processes")
        tokens = sum(split.num_tokens for split in self.splits)
        if tokens < self.batch_size * self.seq_len:
            log.warning(
                "the training data has %d tokens, fewer than one batch of %d x %d: every step reads the same text again",
                tokens,
                self.batch_size,
                self.seq_len,
            )

    @property
    def dataset_size(self) -> str:
        """The training split's size, for the start summary."""
        if len(self.splits) == 1:
            return f"{self.splits[0].num_tokens:,} tokens"
        share = np.asarray(self.weights) / np.sum(self.weights)
        names = self.names or [split.name for split in self.splits]
        parts = [
            f"{name} {p:.2f} of rows ({split.num_tokens:,} tokens)"
            for name, p, split in zip(names, share, self.splits, strict=True)
        ]
        return "mixture: " + ", ".join(parts)

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def _starts(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Split index [B], window start [B] and epoch [B] of every row of global batch `step` (random sampler:
        the epoch is the step)."""
        if self.sampler == "random":
            rng = np.random.default_rng([self.seed, step])
            if len(self.splits) == 1:
                which = np.zeros(self.batch_size, np.int64)
                starts = transforms.random_window_starts(rng, self.splits[0].num_tokens, self.seq_len, self.batch_size)
            else:
                share = np.asarray(self.weights, np.float64) / np.sum(self.weights)
                which = rng.choice(len(self.splits), size=self.batch_size, p=share)
                sizes = np.array([split.num_tokens for split in self.splits])[which]
                starts = rng.integers(0, sizes - self.seq_len - 1)
            return which, starts, np.full(self.batch_size, step)
        flat = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs, order = epoch_permutation(flat, (self.splits[0].num_tokens - 1) // self.seq_len, self.seed)
        return np.zeros(self.batch_size, np.int64), order * self.seq_len, epochs

    def _rows(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Split index, window start and epoch [local_batch] of this process's rows of global batch `step`."""
        rows = slice(self.process_index * self.local_batch_size, (self.process_index + 1) * self.local_batch_size)
        return tuple(x[rows] for x in self._starts(step))

    def _fetch(self, step: int) -> None:
        which, starts, _ = self._rows(step)
        for k in np.unique(which):
            mine = starts[which == k]
            self.splits[k].fetch(mine, mine + self.seq_len + 1)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows [local_batch, ...] of global batch `step`."""
        if self._prefetcher is not None:
            for ahead in range(step + 1, step + 1 + self.prefetch_steps):
                if ahead not in self._prefetched:
                    self._prefetched[ahead] = self._prefetcher.submit(self._fetch, ahead)
            in_flight = self._prefetched.pop(step, None)
            if in_flight is not None:  # wait for it rather than fetch the same pages twice; a failure is fetched again
                concurrent.futures.wait([in_flight])
            for done in [s for s in self._prefetched if s < step]:
                del self._prefetched[done]
        which, starts, epochs = self._rows(step)
        window = np.zeros((len(starts), self.seq_len + 1), np.int32)
        documents = np.zeros((len(starts), self.seq_len + 1), np.int64)
        for k in np.unique(which):
            mine = which == k
            window[mine], documents[mine] = self.splits[k].windows(starts[mine], self.seq_len + 1)
        batch = transforms.lm_windows(window, documents)
        return batch if self.transform is None else self.transform(batch, starts, epochs)


def eval_batches(
    splits: Sequence[TokenSplit],
    batch_size: int,
    seq_len: int,
    process_index: int = 0,
    process_count: int = 1,
    transform: Callable[..., dict[str, np.ndarray]] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Every target of each split exactly once (a mixture's stores one after another, whatever their weights):
    consecutive windows, the last batch padded with weight 0.

    `transform` (as in LMLoader) sees each window's start, counted through the splits in order, as its example id and
    epoch 0.
    """
    counts = [max(-(-(split.num_tokens - 1) // seq_len), 0) for split in splits]  # windows of each split
    if not sum(counts):
        raise ValueError("the validation split is empty; use more data or a smaller config.data.validation_fraction")
    split_of = np.repeat(np.arange(len(splits)), counts)
    starts = np.concatenate([np.arange(count, dtype=np.int64) * seq_len for count in counts])
    first_token = np.cumsum([0] + [split.num_tokens for split in splits])  # of each split, in example ids
    local = batch_size // process_count
    for first in range(0, len(starts), batch_size):
        rows = np.arange(first, first + batch_size)[process_index * local : (process_index + 1) * local]
        real = rows < len(starts)
        window = np.minimum(rows, len(starts) - 1)  # a valid index for padding rows too
        tokens = np.zeros((local, seq_len + 1), np.int32)
        documents = np.full((local, seq_len + 1), -1, np.int64)  # padding: past the end, as `TokenSplit.windows`
        for k in np.unique(split_of[window[real]]):
            mine = np.flatnonzero(real & (split_of[window] == k))
            tokens[mine], documents[mine] = splits[k].windows(starts[window[mine]], seq_len + 1)
        ids = np.where(real, first_token[split_of[window]] + starts[window], first_token[-1])
        batch = transforms.lm_windows(tokens, documents)
        yield batch if transform is None else transform(batch, ids, np.zeros_like(ids))


class RowSource(Protocol):
    """Examples built when read: `rows(ids)` gives the arrays [len(ids), ...] by name of those example ids."""

    def __len__(self) -> int: ...

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]: ...


@dataclasses.dataclass(frozen=True)
class ExampleLoader:
    """Batches of fixed examples, reshuffled every epoch from (seed, epoch).

    `examples` holds them: arrays [N, ...] by name, or a `RowSource` that builds them when read (e.g. sentence
    pairs). `transform(rows, example_ids,
    epochs) -> batch` turns the selected rows into model inputs (e.g. masks them); it is pure, so a batch is a
    function of (seed, step) and resumes exactly.
    """

    examples: Mapping[str, np.ndarray] | RowSource
    batch_size: int
    seed: int
    transform: Callable[..., dict[str, np.ndarray]]
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self):
        if not self.num_examples:
            raise ValueError("the dataset has no examples; check config.data")

    @property
    def num_examples(self) -> int:
        if isinstance(self.examples, Mapping):
            return len(next(iter(self.examples.values())))
        return len(self.examples)

    def _rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        if isinstance(self.examples, Mapping):
            return {k: v[ids] for k, v in self.examples.items()}
        return self.examples.rows(ids)

    @property
    def dataset_size(self) -> str:
        """The training split's size, for the start summary."""
        return f"{self.num_examples:,} examples"

    def _local(self, flat: np.ndarray) -> np.ndarray:
        local = self.batch_size // self.process_count
        return flat[self.process_index * local : (self.process_index + 1) * local]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        flat = self._local(np.arange(step * self.batch_size, (step + 1) * self.batch_size))
        epochs, ids = epoch_permutation(flat, self.num_examples, self.seed)
        return self.transform(self._rows(ids), ids, epochs)

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """Each example once, in order, epoch 0; rows padding the last batch get example_weights 0."""
        n = self.num_examples
        for first in range(0, n, self.batch_size):
            ids = self._local(np.arange(first, first + self.batch_size))
            batch = self.transform(self._rows(np.minimum(ids, n - 1)), ids, np.zeros_like(ids))
            batch["example_weights"] = (ids < n).astype(np.float32)
            if "weights" in batch:
                batch["weights"] = batch["weights"] * batch["example_weights"][:, None]
            yield batch
