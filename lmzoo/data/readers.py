"""How an objective's raw splits are read from the run's config: one `Reader` per kind of source.

An objective names its reader (`Objective.reader`); the run reads "train" and "validation" with `splits`,
a file given on the command line (`eval.py --data`) with `file`, and trains a tokenizer on `texts(raw)`.
"""

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import ml_collections
import numpy as np

from lmzoo import tokenizers
from lmzoo.data import comparisons, pipeline, transforms

Config = ml_collections.ConfigDict


@dataclasses.dataclass(frozen=True)
class Reader:
    """splits(config) -> {"train": raw, "validation": raw}; file(config, path) -> the raw examples of one file;
    texts(raw) -> the strings a tokenizer learns from; check(config) raises ValueError, naming the field, when the
    inputs the reader needs are missing (run before any data is read)."""

    splits: Callable[[Config], dict[str, Any]]
    file: Callable[[Config, str], Any]
    texts: Callable[[Any], list[str]] = list
    check: Callable[[Config], None] = lambda config: None


DOCUMENTS = Reader(
    splits=lambda config: pipeline.load_documents(config.data),
    file=lambda config, path: pipeline.read_local_text(path, config.data.text_field, config.data.document_unit),
)


def _split_paths(config: Config, read_file: Callable[[Config, str], Any]) -> dict[str, Any]:
    return {split: read_file(config, config.data[f"{split}_path"]) for split in ("train", "validation")}


def _check_split_files(config: Config) -> None:
    for field in ("train_path", "validation_path"):
        path = config.data[field]
        if not path or not pathlib.Path(path).is_file():
            raise ValueError(
                f"config.data.{field}={path!r} is not a file; objective {config.objective.name!r} reads "
                "one text file per split (e.g. ptb.train.txt and ptb.valid.txt)"
            )


def _text_file(config: Config, path: str) -> list[str]:
    return [pathlib.Path(path).read_text(encoding="utf-8")]


# Whole text files, one per split: config.data.{train,validation}_path (Mikolov's PTB files).
TEXT_FILES = Reader(splits=lambda config: _split_paths(config, _text_file), file=_text_file, check=_check_split_files)


def text_file_tokens(raw: list[str], tokenizer: tokenizers.Tokenizer, vocab_size: int, where: str) -> np.ndarray:
    """A TEXT_FILES split as one [N] int32 stream (a word tokenizer ends every line with <eos>)."""
    ids = np.concatenate([np.asarray(tokenizer.encode(text), dtype=np.int32) for text in raw])
    transforms.check_token_ids(ids, vocab_size, where=where)
    return ids


def _labelled_tsv(config: Config, path: str) -> tuple[list[tuple[str, ...]], np.ndarray]:
    return pipeline.read_labelled_tsv(path, tuple(config.data.text_fields), config.data.label_field)


# (text[, text pair], label) rows of GLUE-style TSV files: config.data.{train,validation}_path.
LABELLED_TSV = Reader(
    splits=lambda config: _split_paths(config, _labelled_tsv),
    file=_labelled_tsv,
    texts=lambda raw: [" ".join(texts) for texts in raw[0]],
)


def _comparison_splits(config: Config) -> dict[str, list[comparisons.Comparison]]:
    if not config.data.path:
        raise ValueError(
            f"objective {config.objective.name!r} reads comparisons: set --config.data.path=FILE.jsonl(.gz) "
            "(HH-RLHF format)"
        )
    o = config.objective
    return comparisons.read_splits(config.data.path, o.heldout_fraction, o.split_seed)


# Preference comparisons of config.data.path (.jsonl or .jsonl.gz, HH-RLHF format), split by a hash of the
# prompt (config.objective.heldout_fraction, split_seed) so every alignment stage holds out the same prompts.
COMPARISONS = Reader(
    splits=_comparison_splits,
    file=lambda config, path: comparisons.read_comparisons(path),
    texts=lambda raw: [c.prompt + c.chosen for c in raw] + [c.rejected for c in raw],
)


def _text_pairs(config: Config, path: str) -> list[tuple[str, str]]:
    return pipeline.read_text_pairs(path, tuple(config.data.text_fields), config.data.split_marker)


def _text_pair_splits(config: Config) -> dict[str, list[tuple[str, str]]]:
    train, validation = pipeline.split_documents(_text_pairs(config, config.data.path), config.data.validation_fraction)
    return {"train": train, "validation": validation}


# (source, target) pairs of config.data.path: two text fields, or one split at config.data.split_marker; the
# last config.data.validation_fraction of them held out.
TEXT_PAIRS = Reader(
    splits=_text_pair_splits,
    file=_text_pairs,
    texts=lambda raw: [f"{source}\n{target}" for source, target in raw],
)
