"""Text sources, tokenized streams and deterministic, resumable batch loaders.

A loader's batch for step `s` is a pure function of (seed, s, process index), so its position
is one integer saved in every checkpoint, and a resumed run sees exactly the batches an
uninterrupted run would have seen. Each process materialises only its rows of the global batch.
"""

import dataclasses
import gzip
import json
import pathlib
import sysconfig
from collections.abc import Iterator

import ml_collections
import numpy as np

from lmzoo import tokenizers
from lmzoo.data import transforms

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".py", ".md")


def _read_file(path: pathlib.Path, text_field: str) -> list[str]:
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        missing = [i for i, row in enumerate(rows) if text_field not in row]
        if missing:
            raise ValueError(f"{path}: line {missing[0] + 1} has no field {text_field!r}; set config.data.text_field")
        return [row[text_field] for row in rows]
    return [path.read_text(encoding="utf-8", errors="replace")]


def read_local_text(path: str, text_field: str = "text") -> list[str]:
    """Documents from a file or a folder (recursively, sorted): one per .txt/.py/.md file, one per .jsonl line."""
    if not path:
        raise ValueError("config.data.path is empty; set it to a text file or folder (data.source='local')")
    root = pathlib.Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"data path {str(root)!r} does not exist; set config.data.path to a text file or folder")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES))
    docs = [d for f in files for d in _read_file(f, text_field) if d]
    if not docs:
        raise ValueError(f"no text found in {str(root)!r} (looked for {', '.join(TEXT_SUFFIXES)} files); check config.data.path")
    return docs


def read_python_stdlib(max_files: int) -> list[str]:
    """Source files of the running Python's standard library: real text present on every machine."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:max_files]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def read_tfds(name: str, split: str, data_dir: str | None, text_field: str) -> list[str]:
    """Documents of a prepared TFDS dataset, read through `tfds.data_source` (no TensorFlow, no download)."""
    import tensorflow_datasets as tfds

    try:
        source = tfds.data_source(name, data_dir=data_dir, split=split, download=False)
    except Exception as e:
        raise FileNotFoundError(
            f"TFDS dataset {name!r} split {split!r} is not prepared under data_dir={data_dir!r} ({e}); "
            "prepare it first (tfds build, or lmzoo.data.tfds_text.prepare_text_dataset)"
        ) from e
    docs = []
    for i in range(len(source)):
        value = source[i][text_field]
        docs.append(value.decode("utf-8") if isinstance(value, bytes) else str(value))
    return docs


def split_documents(docs: list[str], validation_fraction: float) -> tuple[list[str], list[str]]:
    """Train/validation split: by characters for a single document, otherwise by documents (last ones)."""
    if len(docs) == 1:
        cut = int(len(docs[0]) * (1.0 - validation_fraction))
        return [docs[0][:cut]], [docs[0][cut:]]
    cut = max(1, int(round(len(docs) * (1.0 - validation_fraction))))
    return docs[:cut], docs[cut:]


def load_documents(data: ml_collections.ConfigDict) -> dict[str, list[str]]:
    """{"train": [...], "validation": [...]} documents for the configured source."""
    if data.source == "tfds":
        return {
            split: read_tfds(data.name, getattr(data, f"{split}_split"), data.get("data_dir"), data.text_field)
            for split in ("train", "validation")
        }
    if data.source == "local":
        docs = read_local_text(data.path, data.text_field)
    elif data.source == "python_stdlib":
        docs = read_python_stdlib(data.max_files)
    else:
        raise ValueError(f"unknown config.data.source {data.source!r}; choose 'local', 'python_stdlib' or 'tfds'")
    train, validation = split_documents(docs, data.validation_fraction)
    return {"train": train, "validation": validation}


@dataclasses.dataclass(frozen=True)
class TokenStream:
    """A split as one stream: tokens [N] int32 and the document id of every token [N]."""

    tokens: np.ndarray
    doc_ids: np.ndarray

    @classmethod
    def from_documents(cls, docs: list[str], tokenizer: tokenizers.Tokenizer) -> "TokenStream":
        tokens, doc_ids = transforms.concat_documents(tokenizer.encode_batch(docs), tokenizer.eos_id)
        return cls(tokens, doc_ids)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class LMLoader:
    """Batches of packed next-token windows; `batch(step)` is deterministic and random-access.

    sampler "random": uniform window starts drawn from (seed, step) (nanoGPT); "sequential":
    non-overlapping windows, reshuffled every epoch from (seed, epoch).
    """

    stream: TokenStream
    batch_size: int
    seq_len: int
    seed: int
    sampler: str = "random"
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self):
        if self.sampler not in ("random", "sequential"):
            raise ValueError(f"unknown sampler {self.sampler!r}; choose 'random' or 'sequential'")
        if len(self.stream) < self.seq_len + 2:
            raise ValueError(
                f"the training split has {len(self.stream)} tokens, fewer than seq_len + 2 = {self.seq_len + 2}; "
                "use more data or a shorter config.data.seq_len"
            )
        if self.batch_size % self.process_count:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by {self.process_count} processes")

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def _starts(self, step: int) -> np.ndarray:
        if self.sampler == "random":
            rng = np.random.default_rng([self.seed, step])
            return transforms.random_window_starts(rng, len(self.stream), self.seq_len, self.batch_size)
        num_windows = (len(self.stream) - 1) // self.seq_len
        flat = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs, offsets = np.divmod(flat, num_windows)
        starts = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(num_windows)
            starts[epochs == epoch] = order[offsets[epochs == epoch]] * self.seq_len
        return starts

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows [local_batch, seq_len] of global batch `step`."""
        rows = slice(self.process_index * self.local_batch_size, (self.process_index + 1) * self.local_batch_size)
        return transforms.lm_windows(self.stream.tokens, self.stream.doc_ids, self._starts(step)[rows], self.seq_len)


def eval_batches(
    stream: TokenStream, batch_size: int, seq_len: int, process_index: int = 0, process_count: int = 1
) -> Iterator[dict[str, np.ndarray]]:
    """Every target of the split exactly once: consecutive windows, the last batch padded with weight 0."""
    num_windows = -(-(len(stream) - 1) // seq_len)
    if num_windows <= 0:
        raise ValueError("the validation split is empty; use more data or a smaller config.data.validation_fraction")
    starts = np.arange(num_windows) * seq_len
    local = batch_size // process_count
    for first in range(0, num_windows, batch_size):
        chunk = starts[first : first + batch_size]
        padded = np.concatenate([chunk, np.full(batch_size - len(chunk), len(stream), dtype=chunk.dtype)])
        yield transforms.lm_windows(stream.tokens, stream.doc_ids, padded[process_index * local : (process_index + 1) * local], seq_len)
