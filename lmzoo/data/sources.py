"""Where documents come from: text files and folders, .jsonl(.gz) and parquet fields, prepared TFDS datasets, the
Python standard library, labelled TSV and text pairs; and `DocumentSource`, a corpus streamed document by document
with each document's split, which `lmzoo.data.prepare` tokenizes into a store.

Every reader names the file (and line or row) of a bad input and the config field that fixes it.
"""

import codecs
import dataclasses
import gzip
import hashlib
import json
import os
import pathlib
import re
import sysconfig
from collections.abc import Callable, Iterator

import ml_collections
import numpy as np
from etils import epath

from lmzoo import storage

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet", ".py", ".md")


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
PIECE_CHARS = 1 << 20  # default piece size: a larger text file is streamed, a longer document handed on in pieces
_REPLACEMENT = "\ufffd".encode()


def _refuse_nul(path: pathlib.Path, offset: int) -> None:
    if offset >= 0:
        raise ValueError(
            f"{path}: NUL byte at offset {offset}; this is a binary file, not text. Remove it from config.data.path"
        )


def _refuse_undecodable(path: pathlib.Path, undecodable: int, characters: int) -> None:
    if undecodable > MAX_UNDECODABLE_FRACTION * max(characters, 1):
        raise ValueError(
            f"{path}: {undecodable} of {characters} characters are not valid UTF-8; it is not UTF-8 text "
            "(convert it, e.g. iconv -f latin1 -t utf-8, or remove it from config.data.path)"
        )


def read_text(path: pathlib.Path) -> str:
    """A UTF-8 text file (gunzipped if it ends in .gz). NUL bytes, or more than MAX_UNDECODABLE_FRACTION
    of characters that are not UTF-8, mean the file is not text: an error naming it, not training data."""
    raw = storage.read_bytes(path)
    raw = gzip.decompress(raw) if path.name.endswith(".gz") else raw
    _refuse_nul(path, raw.find(b"\0"))
    text = raw.decode("utf-8", errors="replace")
    _refuse_undecodable(path, text.count("\ufffd") - raw.count(_REPLACEMENT), len(text))
    return text


def _decoded_blocks(path: pathlib.Path, size: int) -> Iterator[tuple[bytes, str]]:
    """(bytes, their text) of `path` (gunzipped if .gz), `size` bytes at a time, decoded as `read_text` decodes the
    whole; the last pair, with no bytes, holds what the decoder kept back for the end."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with storage.open_read(path) as f:
        while raw := f.read(size):
            yield raw, decoder.decode(raw)
    yield b"", decoder.decode(b"", final=True)


def _checked_characters(path: pathlib.Path, size: int) -> int:
    """`read_text`'s checks, streamed: the characters of `path`, or the error `read_text` raises."""
    offset, characters, undecodable, tail = 0, 0, 0, b""
    for raw, text in _decoded_blocks(path, size):
        nul = raw.find(b"\0")
        _refuse_nul(path, offset + nul if nul >= 0 else -1)
        # a replacement character's 3 bytes may straddle two blocks: counted in the block where they end
        undecodable += text.count("\ufffd") - (tail + raw).count(_REPLACEMENT)
        offset, characters, tail = offset + len(raw), characters + len(text), (tail + raw)[-2:]
    _refuse_undecodable(path, undecodable, characters)
    return characters


_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def _streamed_units(path: pathlib.Path, unit: str, size: int) -> Iterator[tuple[str, bool]]:
    """`file_records` of a text file as (piece, continues), never holding the file: checked as `read_text` checks it,
    then decoded `size` bytes at a time; a record that spans blocks comes as a piece from each, the later ones
    continuing it. Line and paragraph boundaries are whitespace (line breaks, blank lines), so text cut just after a
    non-whitespace character splits into the units it splits into inside the whole; the whitespace after that
    character waits for the next block."""
    if unit not in DOCUMENT_UNITS:
        _split_units("", unit)  # its error names the units
    _checked_characters(path, size)
    carry, open_unit = "", False
    for raw, block in _decoded_blocks(path, size):
        final, text = not raw, carry + block
        if unit == "file":
            if text or (final and not open_unit):
                yield text, open_unit
                open_unit = True
            carry = ""
            continue
        cut = len(text) if final else len(text.rstrip())
        segment, carry = text[:cut], text[cut:]
        if not segment and not final:
            continue
        parts = segment.splitlines() if unit == "line" else _PARAGRAPH_BREAK.split(segment)
        for k, part in enumerate(parts):
            continues = open_unit and k == 0
            if unit == "paragraph":  # `_split_units` strips line breaks off a paragraph's two ends
                part = part if continues else part.lstrip("\n")
                part = part.rstrip("\n") if final or k < len(parts) - 1 else part
            if part if continues else part.strip():
                yield part, continues
        # the last part ends with the segment's last character, not whitespace: that unit goes on in the next block
        open_unit = not final


def iter_jsonl(path: pathlib.Path, fields: tuple[str, ...], fix: str) -> Iterator[dict]:
    """The JSON objects of a .jsonl(.gz) file, streamed line by line (blank lines skipped), each with string
    `fields`. Errors name the file and line; `fix` says which config setting to change for a missing field."""
    with storage.open_read(path) as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():  # as `count_records` decides, without decoding
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}: line {number} is not UTF-8 text; JSON lines must be UTF-8") from None
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
            yield row


def first_json_row(path) -> object:
    """The first non-blank line of a text file (local or in a bucket) parsed as JSON; None when it is not JSON (the
    reader that reads the file names the line)."""
    with storage.open_read(path, text=True) as f:
        first = next((line for line in f if line.strip()), "")
    try:
        return json.loads(first)
    except ValueError:
        return None


def read_jsonl(path: pathlib.Path, fields: tuple[str, ...], fix: str) -> list[dict]:
    """Every row of `iter_jsonl`."""
    return list(iter_jsonl(path, fields, fix))


def iter_parquet(path: pathlib.Path, field: str, fix: str) -> Iterator[str]:
    """The strings of column `field` of a parquet file (the on-disk form of HF datasets), streamed by record batch."""
    with storage.open_read(path) as file:
        table = _parquet(path, file)
        names = table.schema_arrow.names
        if field not in names:
            raise ValueError(f"{path}: no column {field!r} (it has {names}); {fix}")
        row = 0
        for batch in table.iter_batches(columns=[field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                if not isinstance(value, str):
                    raise ValueError(f"{path}: row {row} column {field!r} is {type(value).__name__}, not a string")
                yield value


def _parquet(path, file):
    """A pyarrow ParquetFile over the open `file`; ValueError naming `path` if it is not one."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file)
    except Exception as e:
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None


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


def file_records(
    path: pathlib.Path, text_field: str, unit: str, text_field_fix: str = "set config.data.text_field"
) -> Iterator[str]:
    """The texts of one file's records, streamed, empty ones included: a field of each .jsonl(.gz) line or parquet
    row; a .txt/.py/.md file as one record per file, paragraph (blank-line separated) or line, by `unit`.
    text_field_fix: what an error on a row without `text_field` tells the user to change."""
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return (row[text_field] for row in iter_jsonl(path, (text_field,), text_field_fix))
    if path.name.endswith(".parquet"):
        return iter_parquet(path, text_field, text_field_fix)
    if unit == "file":
        return iter([read_text(path)])
    return iter(_split_units(read_text(path), unit))


def file_record_pieces(
    path: pathlib.Path,
    text_field: str,
    unit: str,
    size: int = PIECE_CHARS,
    text_field_fix: str = "set config.data.text_field",
) -> Iterator[tuple[str, bool]]:
    """`file_records` as (piece, continues): a record longer than `size` characters comes as consecutive pieces, each
    after the first continuing it. A text file above `size` bytes is streamed (`_streamed_units`), never held whole;
    a .jsonl or parquet record is read whole and handed on in pieces."""
    if not path.name.endswith((".jsonl", ".jsonl.gz", ".parquet")) and storage.stat(path)[0] > size:
        yield from _streamed_units(path, unit, size)
        return
    for text in file_records(path, text_field, unit, text_field_fix):
        for start in range(0, max(len(text), 1), size):
            yield text[start : start + size], start > 0


def count_records(path: pathlib.Path, unit: str) -> int:
    """How many records `file_records` streams from `path`, without parsing them where the format allows: the
    non-blank lines of a .jsonl(.gz), a parquet file's row count, one for a whole-file document."""
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        with storage.open_read(path) as f:
            return sum(1 for line in f if line.strip())
    if path.name.endswith(".parquet"):
        with storage.open_read(path) as file:
            return _parquet(path, file).metadata.num_rows
    if unit == "file":
        return 1
    if storage.stat(path)[0] > PIECE_CHARS:
        return sum(not continues for _, continues in _streamed_units(path, unit, PIECE_CHARS))
    return len(_split_units(read_text(path), unit))


def file_documents(path: pathlib.Path, text_field: str, unit: str) -> Iterator[str]:
    """The documents of one file: its records (`file_records`) that are not empty."""
    return (text for text in file_records(path, text_field, unit) if text)


def text_files(path: str) -> list[epath.Path]:
    """`path` itself, or the text files under the folder `path` (recursively, sorted); local or in a bucket."""
    if not path:
        raise ValueError("config.data.path is empty; set it to a text file or folder (data.source='local')")
    root = os.fspath(storage.path(path))
    try:
        found = storage.find_files(root)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"data path {root!r} does not exist; set config.data.path to a text file or folder"
        ) from None
    if len(found) == 1 and os.fspath(found[0]) == root:
        return found
    files = [p for p in found if p.name.endswith(TEXT_SUFFIXES)]
    if not files:
        raise ValueError(
            f"no text found in {str(root)!r} (looked for {', '.join(TEXT_SUFFIXES)}); check config.data.path"
        )
    return files


def read_local_text(path: str, text_field: str = "text", unit: str = "file") -> list[str]:
    """Documents from a file or a folder (`text_files`, `file_documents`)."""
    docs = [d for f in text_files(path) for d in file_documents(f, text_field, unit)]
    if not docs:
        raise ValueError(f"no text found in {path!r}; check config.data.path")
    return docs


def python_stdlib_files(max_files: int) -> list[pathlib.Path]:
    """Source files of the running Python's standard library: real text present on every machine."""
    return sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:max_files]


def iter_tfds(name: str, split: str, data_dir: str | None, text_field: str) -> Iterator[str]:
    """Documents of a prepared TFDS dataset, read through `tfds.data_source` (no TensorFlow, no download)."""
    import tensorflow_datasets as tfds

    try:
        source = tfds.data_source(name, data_dir=data_dir, split=split, download=False)
    except Exception as e:
        raise FileNotFoundError(
            f"TFDS dataset {name!r} split {split!r} is not prepared under data_dir={data_dir!r} ({e}); "
            "prepare it first (tfds build, or lmzoo.data.tfds_text.prepare_text_dataset)"
        ) from e
    for i in range(len(source)):
        value = source[i][text_field]
        yield value.decode("utf-8") if isinstance(value, bytes) else str(value)


def training_documents(count: int, validation_fraction: float) -> int:
    """How many of `count` (>= 2) documents train: all but the last `validation_fraction`, at least one on each side
    (a fraction too small for the corpus still holds one out)."""
    return min(count - 1, max(1, int(round(count * (1.0 - validation_fraction)))))


def split_documents(docs: list[str], validation_fraction: float) -> tuple[list[str], list[str]]:
    """Train/validation split: by characters for a single document, otherwise by documents (last ones)."""
    if len(docs) == 1:
        cut = int(len(docs[0]) * (1.0 - validation_fraction))
        return [docs[0][:cut]], [docs[0][cut:]]
    cut = training_documents(len(docs), validation_fraction)
    return docs[:cut], docs[cut:]


def read_text_pairs(path: str, text_fields: tuple[str, ...], split_marker: str = "") -> list[tuple[str, str]]:
    """(source, target) texts from a .jsonl(.gz) or .tsv file (with a header row).

    Two text_fields name the source and target columns. One field with `split_marker` splits that text
    at the marker's last occurrence, the marker ending the source: HH-RLHF's "...\n\nAssistant:" prompt
    and the final response.
    """
    file = storage.path(path)
    if not storage.exists(file):
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
    file = storage.path(path)
    if not storage.exists(file):
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


class DocumentSource:
    """A corpus: `documents()` streams (split, text) in a fixed order, train documents first, never holding the
    corpus in memory; `fingerprint()` changes whenever the documents may have."""

    description: str = ""

    def documents(self) -> Iterator[tuple[str, str]]:
        raise NotImplementedError

    def pieces(self, size: int = PIECE_CHARS) -> Iterator[tuple[str, str, bool]]:
        """(split, text, continues): the documents, one longer than `size` characters handed on as consecutive
        pieces, each after the first continuing it. Here they are cut from `documents()`; a source reading files
        streams them instead (`FileCorpus`), never holding such a document whole."""
        for split, text in self.documents():
            for start in range(0, max(len(text), 1), size):
                yield split, text[start : start + size], start > 0

    def fingerprint(self) -> str:
        raise NotImplementedError

    def size_bytes(self) -> int | None:
        """Bytes of the files read (for progress and ETA), None when unknown."""
        return None


def joined_documents(pieces: Iterator[tuple[str, str, bool]]) -> Iterator[tuple[str, str]]:
    """(split, text) of every whole document of `pieces` (`DocumentSource.pieces`)."""
    split, parts = None, []
    for piece_split, text, continues in pieces:
        if parts and not continues:
            yield split, "".join(parts)
            parts = []
        split = piece_split
        parts.append(text)
    if parts:
        yield split, "".join(parts)


def _file_stats(files: list) -> list:
    """[path, size, version] of each file (local: the resolved path and the modification time in ns)."""
    stats = []
    for file in files:
        location = os.fspath(file)
        name = location if storage.is_remote(location) else os.path.realpath(location)
        stats.append([name, *storage.stat(location)])
    return stats


def digest(value) -> str:
    """sha256 of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def fingerprint_files(files: list[pathlib.Path]) -> str:
    """Changes when any file's path, size or modification time does (content is not read: corpora are large)."""
    return digest(["files", _file_stats(files)])


@dataclasses.dataclass(frozen=True)
class FileCorpus(DocumentSource):
    """Documents of text files (`file_records`, empty ones skipped), the last `validation_fraction` of the records
    held out (at least one); a corpus of one record is cut by characters instead. The records are counted without
    parsing them (`count_records`): jsonl lines, parquet metadata, files; only line and paragraph units read the text.
    `pieces(size)` streams a text file of more than `size` bytes (`file_record_pieces`), never holding it whole."""

    files: tuple[os.PathLike, ...]  # local or bucket paths (pathlib or epath)
    text_field: str = "text"
    unit: str = "file"
    validation_fraction: float = 0.0
    description: str = ""
    text_field_fix: str = "set config.data.text_field"  # the setting that names text_field where the corpus comes from

    def _record_pieces(self, size: int) -> Iterator[tuple[str, bool]]:
        for path in self.files:
            yield from file_record_pieces(path, self.text_field, self.unit, size, self.text_field_fix)

    def documents(self) -> Iterator[tuple[str, str]]:
        return joined_documents(self.pieces())

    def pieces(self, size: int = PIECE_CHARS) -> Iterator[tuple[str, str, bool]]:
        if not self.validation_fraction:
            yield from (("train", text, continues) for text, continues in self._record_pieces(size) if text)
            return
        count = sum(count_records(path, self.unit) for path in self.files)
        length = sum(len(text) for text, _ in self._record_pieces(size)) if count == 1 else None
        if count == 0 or length == 0:
            raise ValueError(f"no text found in {self.description}; check config.data.path")
        if length is not None:  # one record: its first characters train (a document even when empty), the rest not
            cut = int(length * (1.0 - self.validation_fraction))
            if cut == 0:
                yield "train", "", False
            position, train, validation = 0, False, False
            for text, _ in self._record_pieces(size):
                head = max(min(cut - position, len(text)), 0)
                if head:
                    yield "train", text[:head], train
                    train = True
                if head < len(text):
                    yield "validation", text[head:], validation
                    validation = True
                position += len(text)
            return
        cut = training_documents(count, self.validation_fraction)
        index = -1
        for text, continues in self._record_pieces(size):
            index += not continues
            if text:
                yield ("train" if index < cut else "validation"), text, continues

    def fingerprint(self) -> str:
        split = "last records"  # the validation split's rule is part of what decides the documents of each split
        return digest(
            ["files", _file_stats(list(self.files)), self.text_field, self.unit, self.validation_fraction, split]
        )

    def size_bytes(self) -> int:
        return sum(storage.stat(f)[0] for f in self.files)


@dataclasses.dataclass(frozen=True)
class SplitCorpus(DocumentSource):
    """Documents whose splits come from separate readers (TFDS splits, a TSV file per split, text pairs)."""

    readers: tuple[tuple[str, Callable[[], Iterator[str]]], ...]
    identity: tuple
    description: str = ""

    def documents(self) -> Iterator[tuple[str, str]]:
        for split, read in self.readers:
            yield from ((split, text) for text in read())

    def fingerprint(self) -> str:
        return digest(["splits", *map(str, self.identity)])


def _tfds_files(name: str, data_dir: str) -> list[pathlib.Path]:
    root = pathlib.Path(data_dir or os.path.expanduser("~/tensorflow_datasets")) / name
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []


def source_from_config(data: ml_collections.ConfigDict) -> DocumentSource:
    """The corpus `config.data` names (its `source`: local, python_stdlib, tfds, tsv or pairs)."""
    fraction = data.validation_fraction
    if data.source == "local":
        return FileCorpus(tuple(text_files(data.path)), data.text_field, data.document_unit, fraction, data.path)
    if data.source == "python_stdlib":
        return FileCorpus(tuple(python_stdlib_files(data.max_files)), "text", "file", fraction, "python_stdlib")
    if data.source == "tfds":
        splits = {"train": data.train_split, "validation": data.validation_split}
        return SplitCorpus(
            tuple(
                (split, lambda s=name: iter_tfds(data.name, s, data.get("data_dir"), data.text_field))
                for split, name in splits.items()
            ),
            (
                "tfds",
                data.name,
                data.get("data_dir"),
                splits,
                data.text_field,
                _file_stats(_tfds_files(data.name, data.get("data_dir"))),
            ),
            f"tfds {data.name}",
        )
    if data.source == "tsv":
        fields, label = tuple(data.text_fields), data.label_field
        paths = {split: data[f"{split}_path"] for split in ("train", "validation")}
        return SplitCorpus(
            tuple(
                (split, lambda p=path: iter(" ".join(t) for t in read_labelled_tsv(p, fields, label)[0]))
                for split, path in paths.items()
            ),
            ("tsv", fields, label, _file_stats(list(paths.values()))),
            f"tsv {paths['train']}",
        )
    if data.source == "pairs":
        fields, marker = tuple(data.text_fields), data.split_marker

        def split_pairs(index: int) -> Iterator[str]:
            pairs = split_documents(read_text_pairs(data.path, fields, marker), fraction)[index]
            return iter(f"{a}\n{b}" for a, b in pairs)

        return SplitCorpus(
            (("train", lambda: split_pairs(0)), ("validation", lambda: split_pairs(1))),
            ("pairs", fields, marker, fraction, _file_stats([data.path])),
            data.path,
        )
    raise ValueError(
        f"unknown config.data.source {data.source!r}; choose 'local', 'python_stdlib', 'tfds', 'tsv', 'pairs' or "
        "'store'"
    )
