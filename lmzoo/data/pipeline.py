"""Text sources, tokenized streams and deterministic, resumable batch loaders.

A loader's batch for step `s` is a pure function of (seed, s, process index), so its position
is one integer saved in every checkpoint, and a resumed run sees exactly the batches an
uninterrupted run would have seen. Each process materialises only its rows of the global batch.
"""

import dataclasses
import gzip
import json
import pathlib
import re
import sysconfig
from collections.abc import Callable, Iterator

import ml_collections
import numpy as np

from lmzoo import tokenizers
from lmzoo.data import transforms

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".py", ".md")


DOCUMENT_UNITS = ("file", "paragraph", "line")


def _split_units(text: str, unit: str) -> list[str]:
    if unit == "file":
        return [text]
    if unit == "line":
        return [line for line in text.splitlines() if line.strip()]
    if unit == "paragraph":
        return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    raise ValueError(f"unknown config.data.document_unit {unit!r}; choose one of {DOCUMENT_UNITS}")


MAX_UNDECODABLE_FRACTION = 0.01  # above this share of invalid UTF-8, a file is not text


def read_text(path: pathlib.Path) -> str:
    """A UTF-8 text file (gunzipped if it ends in .gz). NUL bytes, or more than MAX_UNDECODABLE_FRACTION
    of characters that are not UTF-8, mean the file is not text: an error naming it, not training data."""
    raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    nul = raw.find(b"\0")
    if nul >= 0:
        raise ValueError(
            f"{path}: NUL byte at offset {nul}; this is a binary file, not text. Remove it from config.data.path"
        )
    text = raw.decode("utf-8", errors="replace")
    undecodable = text.count("\ufffd") - raw.count("\ufffd".encode())
    if undecodable > MAX_UNDECODABLE_FRACTION * max(len(text), 1):
        raise ValueError(
            f"{path}: {undecodable} of {len(text)} characters are not valid UTF-8; it is not UTF-8 text "
            "(convert it, e.g. iconv -f latin1 -t utf-8, or remove it from config.data.path)"
        )
    return text


def read_jsonl(path: pathlib.Path, fields: tuple[str, ...], fix: str) -> list[dict]:
    """The JSON objects of a .jsonl(.gz) file (blank lines skipped), each with string `fields`.
    Errors name the file and line; `fix` says which config setting to change for a missing field."""
    rows = []
    for number, line in enumerate(read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {number} is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}: line {number} is a JSON {type(row).__name__}, not an object with field(s) {list(fields)}"
            )
        for field in fields:
            if field not in row:
                raise ValueError(f"{path}: line {number} has no field {field!r} (it has {sorted(row)}); {fix}")
            if not isinstance(row[field], str):
                raise ValueError(
                    f"{path}: line {number} field {field!r} is a {type(row[field]).__name__}, not a string"
                )
        rows.append(row)
    return rows


def read_tsv(path: pathlib.Path, columns: tuple[str, ...], fix: str) -> list[dict[str, str]]:
    """Rows of a tab-separated file with a header row naming at least `columns`; a row with a different
    number of cells than the header is an error naming its line."""
    header, *lines = [line.removesuffix("\r") for line in read_text(path).split("\n")]
    names = header.split("\t")
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{path}: columns {missing} not in the header {names}; {fix}")
    rows = []
    for number, line in enumerate(lines, start=2):
        if not line.strip():
            continue
        cells = line.split("\t")
        if len(cells) != len(names):
            raise ValueError(f"{path}: line {number} has {len(cells)} tab-separated cells, the header has {len(names)}")
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def _read_file(path: pathlib.Path, text_field: str, unit: str) -> list[str]:
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return [row[text_field] for row in read_jsonl(path, (text_field,), "set config.data.text_field")]
    return _split_units(read_text(path), unit)


def read_local_text(path: str, text_field: str = "text", unit: str = "file") -> list[str]:
    """Documents from a file or a folder (recursively, sorted): one per .jsonl line; .txt/.py/.md files
    give one document per file, paragraph (blank-line separated) or line, by `unit`."""
    if not path:
        raise ValueError("config.data.path is empty; set it to a text file or folder (data.source='local')")
    root = pathlib.Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"data path {str(root)!r} does not exist; set config.data.path to a text file or folder"
        )
    files = (
        [root]
        if root.is_file()
        else sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES))
    )
    docs = [d for f in files for d in _read_file(f, text_field, unit) if d]
    if not docs:
        raise ValueError(
            f"no text found in {str(root)!r} (looked for {', '.join(TEXT_SUFFIXES)} files); check config.data.path"
        )
    return docs


def read_python_stdlib(max_files: int) -> list[str]:
    """Source files of the running Python's standard library: real text present on every machine."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [read_text(f) for f in sorted(root.glob("*.py"))[:max_files]]


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
    if data.source == "tsv":
        return {
            split: [
                " ".join(t)
                for t in read_labelled_tsv(data[f"{split}_path"], tuple(data.text_fields), data.label_field)[0]
            ]
            for split in ("train", "validation")
        }
    if data.source == "pairs":
        train, validation = split_documents(
            read_text_pairs(data.path, tuple(data.text_fields), data.split_marker), data.validation_fraction
        )
        return {"train": [f"{a}\n{b}" for a, b in train], "validation": [f"{a}\n{b}" for a, b in validation]}
    if data.source == "local":
        docs = read_local_text(data.path, data.text_field, data.document_unit)
    elif data.source == "python_stdlib":
        docs = read_python_stdlib(data.max_files)
    else:
        raise ValueError(
            f"unknown config.data.source {data.source!r}; choose 'local', 'python_stdlib', 'tfds', 'tsv' or 'pairs'"
        )
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


def token_stream(docs: list[str], tokenizer: tokenizers.Tokenizer, vocab_size: int, where: str) -> TokenStream:
    """Documents as one stream, every id checked against the model's vocabulary."""
    stream = TokenStream.from_documents(docs, tokenizer)
    transforms.check_token_ids(stream.tokens, vocab_size, where=where)
    return stream


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
    transform: Callable[..., dict[str, np.ndarray]] | None = None  # (batch, example_ids [b], epochs [b]) -> batch

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
    def dataset_size(self) -> str:
        """The training split's size, for the start summary."""
        return f"{len(self.stream):,} tokens"

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def _starts(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Window starts [B] of global batch `step` and the epoch of each (random sampler: the step)."""
        if self.sampler == "random":
            rng = np.random.default_rng([self.seed, step])
            starts = transforms.random_window_starts(rng, len(self.stream), self.seq_len, self.batch_size)
            return starts, np.full(self.batch_size, step)
        flat = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs, order = epoch_permutation(flat, (len(self.stream) - 1) // self.seq_len, self.seed)
        return order * self.seq_len, epochs

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows [local_batch, ...] of global batch `step`."""
        rows = slice(self.process_index * self.local_batch_size, (self.process_index + 1) * self.local_batch_size)
        starts, epochs = self._starts(step)
        batch = transforms.lm_windows(self.stream.tokens, self.stream.doc_ids, starts[rows], self.seq_len)
        return batch if self.transform is None else self.transform(batch, starts[rows], epochs[rows])


def eval_batches(
    stream: TokenStream,
    batch_size: int,
    seq_len: int,
    process_index: int = 0,
    process_count: int = 1,
    transform: Callable[..., dict[str, np.ndarray]] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Every target of the split exactly once: consecutive windows, the last batch padded with weight 0.

    `transform` (as in LMLoader) sees each window's start as its example id and epoch 0.
    """
    num_windows = -(-(len(stream) - 1) // seq_len)
    if num_windows <= 0:
        raise ValueError("the validation split is empty; use more data or a smaller config.data.validation_fraction")
    starts = np.arange(num_windows) * seq_len
    local = batch_size // process_count
    for first in range(0, num_windows, batch_size):
        chunk = starts[first : first + batch_size]
        padded = np.concatenate([chunk, np.full(batch_size - len(chunk), len(stream), dtype=chunk.dtype)])
        mine = padded[process_index * local : (process_index + 1) * local]
        batch = transforms.lm_windows(stream.tokens, stream.doc_ids, mine, seq_len)
        yield batch if transform is None else transform(batch, mine, np.zeros_like(mine))


@dataclasses.dataclass(frozen=True)
class ExampleLoader:
    """Batches of fixed examples (arrays [N, ...]), reshuffled every epoch from (seed, epoch).

    `transform(rows, example_ids, epochs) -> batch` turns the selected rows into model inputs
    (e.g. masks them); it is pure, so a batch is a function of (seed, step) and resumes exactly.
    """

    examples: dict[str, np.ndarray]
    batch_size: int
    seed: int
    transform: Callable[..., dict[str, np.ndarray]]
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self):
        if not len(next(iter(self.examples.values()))):
            raise ValueError("the dataset has no examples; check config.data")

    @property
    def num_examples(self) -> int:
        return len(next(iter(self.examples.values())))

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
        return self.transform({k: v[ids] for k, v in self.examples.items()}, ids, epochs)

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """Each example once, in order, epoch 0; rows padding the last batch get example_weights 0."""
        n = self.num_examples
        for first in range(0, n, self.batch_size):
            ids = self._local(np.arange(first, first + self.batch_size))
            batch = self.transform(
                {k: v[np.minimum(ids, n - 1)] for k, v in self.examples.items()}, ids, np.zeros_like(ids)
            )
            batch["example_weights"] = (ids < n).astype(np.float32)
            if "weights" in batch:
                batch["weights"] = batch["weights"] * batch["example_weights"][:, None]
            yield batch


def read_text_pairs(path: str, text_fields: tuple[str, ...], split_marker: str = "") -> list[tuple[str, str]]:
    """(source, target) texts from a .jsonl(.gz) or .tsv file (with a header row).

    Two text_fields name the source and target columns. One field with `split_marker` splits that text
    at the marker's last occurrence, the marker ending the source: HH-RLHF's "...\n\nAssistant:" prompt
    and the final response.
    """
    file = pathlib.Path(path).expanduser()
    if not file.exists():
        raise FileNotFoundError(f"pairs file {path!r} does not exist; set config.data.path")
    if file.name.endswith((".jsonl", ".jsonl.gz")):
        rows = read_jsonl(file, text_fields, "set config.data.text_fields")
    elif file.name.endswith(".tsv"):
        rows = read_tsv(file, text_fields, "set config.data.text_fields")
    else:
        raise ValueError(f"{path}: pairs are read from .jsonl, .jsonl.gz or .tsv files")
    if len(rows) < 2:
        raise ValueError(
            f"{path} has {len(rows)} rows; pairs need at least 2 (the last config.data.validation_fraction are held out)"
        )
    if len(text_fields) == 2 and not split_marker:
        return [(row[text_fields[0]], row[text_fields[1]]) for row in rows]
    if len(text_fields) == 1 and split_marker:
        pairs = []
        for i, row in enumerate(rows):
            cut = row[text_fields[0]].rfind(split_marker)
            if cut < 0:
                raise ValueError(
                    f"{path}: row {i + 1} has no {split_marker!r} (config.data.split_marker) in {text_fields[0]!r}"
                )
            cut += len(split_marker)
            pairs.append((row[text_fields[0]][:cut], row[text_fields[0]][cut:]))
        return pairs
    raise ValueError("pairs need config.data.text_fields = (source, target), or one field and config.data.split_marker")


def read_labelled_tsv(
    path: str, text_fields: tuple[str, ...], label_field: str
) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """(texts, labels) from a TSV with a header row (GLUE format)."""
    file = pathlib.Path(path)
    if not file.exists():
        raise FileNotFoundError(
            f"labelled data file {path!r} does not exist; check config.data.{{train,validation}}_path"
        )
    rows = read_tsv(file, (*text_fields, label_field), "set config.data.text_fields / label_field")
    if not rows:
        raise ValueError(f"{path} has no examples (needs a header row and at least one row)")
    labels = []
    for number, row in enumerate(rows, start=1):
        if not row[label_field].strip().lstrip("-").isdigit():
            raise ValueError(
                f"{path}: example {number} has label {row[label_field]!r} in column {label_field!r}, not an integer"
            )
        labels.append(int(row[label_field]))
    return [tuple(row[f].strip() for f in text_fields) for row in rows], np.array(labels, np.int32)
