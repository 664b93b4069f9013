"""How an objective's raw splits are read from the run's config: one `Reader` per kind of source.

An objective names its reader (`Objective.reader`); the run reads "train" and "validation" with `splits`,
a file given on the command line (`eval.py --data`) with `file`, and trains a tokenizer on `texts(raw)`.
"""

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import ml_collections
import numpy as np

from lmzoo import storage, tokenizers
from lmzoo.data import chat, comparisons, prepare, problems, sources, store, transforms

Config = ml_collections.ConfigDict


def named_files_fingerprint(config: Config) -> str:
    """sha256 of the paths, sizes and modification times of the files config.data names (path, train_path,
    validation_path; a folder's text files); a named path that is not there is refused, as reading it would be (a dry
    run finds the data so)."""
    named = [config.data[field] for field in ("path", "train_path", "validation_path") if config.data[field]]
    files = [f for path in named if not path.startswith(problems.SYNTHETIC) for f in sources.text_files(path)]
    return sources.fingerprint_files(files)


@dataclasses.dataclass(frozen=True)
class Reader:
    """splits(config) -> {"train": raw, "validation": raw}; file(config, path) -> the raw examples of one file;
    texts(raw) -> the strings a tokenizer learns from; check(config) raises ValueError, naming the field, when the
    inputs the reader needs are missing (run before any data is read); fingerprint(config) changes when the data
    may have (a resumed run warns when it did)."""

    splits: Callable[[Config], dict[str, Any]]
    file: Callable[[Config, str], Any]
    texts: Callable[[Any], list[str]] = list
    check: Callable[[Config], None] = lambda config: None
    fingerprint: Callable[[Config], str] = named_files_fingerprint
    describe: Callable[[Config], str] = lambda config: config.data.path or config.data.train_path


# Stores read directly (source "store"): one folder, or a mixture of (folder, weight) pairs.
def store_paths(config: Config) -> list[tuple[str, float]]:
    data = config.data
    return [(str(path), float(weight)) for path, weight in data.mixture] if data.mixture else [(data.path, 1.0)]


def open_stores(config: Config) -> list[store.Store]:
    """The stores config.data names (local folders or bucket prefixes, mixed as the mixture says), bucket stores read
    through the local cache config.data.cache_dir and read_cache_gb bound."""
    cache = store.read_cache(config.data.cache_dir, config.data.read_cache_gb)
    return [store.open_store(path, cache) for path, _ in store_paths(config)]


@dataclasses.dataclass
class CorpusSplit:
    """One split of the run's documents, tokenized on first use: a raw-text `source` prepared once into a cached
    store (`lmzoo.data.prepare.cached_store`), or, with source None, the prepared store(s) config.data names."""

    config: Config
    split: str
    source: sources.DocumentSource | None = None
    _stores: list[store.Store] | None = None

    def texts(self) -> list[str]:
        """The split's documents as text (what a tokenizer learnt from the corpus reads)."""
        if self.source is None:
            raise ValueError(
                "config.data.source='store' holds tokens, not text: the run uses the store's own tokenizer"
            )
        return [text for split, text in self.source.documents() if split == self.split]

    def stores(self, tokenizer: tokenizers.Tokenizer) -> list[store.Store]:
        if self._stores is None:
            if self.source is None:
                opened = open_stores(self.config)
                for each in opened:
                    each.check_tokenizer(tokenizer)
            else:
                root = prepare.cache_root(self.config.data.cache_dir)
                big = (self.source.size_bytes() or 0) > prepare.PARALLEL_BYTES
                opened = [prepare.cached_store(self.source, tokenizer, root, workers=os.cpu_count() if big else 1)]
            self._stores = opened
        return self._stores

    def sentences(self, tokenizer: tokenizers.Tokenizer) -> store.SentenceIndex:
        """The split's documents as sentences: a raw-text source prepared once into a cached sentence store, or the
        store config.data names (prepared with --sentences)."""
        if self.source is None:
            paths = store_paths(self.config)
            if len(paths) > 1:
                raise ValueError(
                    f"objective {self.config.objective.name!r} reads sentence pairs from one store; config.data.mixture "
                    "names several (prepare their sources into one store with --sentences)"
                )
            opened = open_stores(self.config)[0]
            opened.check_tokenizer(tokenizer)
        else:
            root = prepare.cache_root(self.config.data.cache_dir)
            big = (self.source.size_bytes() or 0) > prepare.PARALLEL_BYTES
            workers = os.cpu_count() if big else 1
            opened = prepare.cached_store(self.source, tokenizer, root, workers=workers, sentences=True)
        return opened.split(self.split).sentences()

    def token_splits(self, tokenizer: tokenizers.Tokenizer) -> list[store.TokenSplit]:
        """The split's tokens, one TokenSplit per store it reads: one, or a mixture's."""
        return [opened.split(self.split) for opened in self.stores(tokenizer)]

    def mixture(self, tokenizer: tokenizers.Tokenizer) -> tuple[list[store.TokenSplit], list[float], list[str]]:
        """(token splits, weights, names) of every store the split reads: one, or a mixture's."""
        weights = [weight for _, weight in store_paths(self.config)] if self.source is None else [1.0]
        return self.token_splits(tokenizer), weights, [opened.folder.name for opened in self.stores(tokenizer)]


def _document_splits(config: Config) -> dict[str, CorpusSplit]:
    source = None if config.data.source == "store" else sources.source_from_config(config.data)
    return {split: CorpusSplit(config, split, source) for split in ("train", "validation")}


def _document_file(config: Config, path: str) -> CorpusSplit:
    data = config.data
    return CorpusSplit(
        config,
        "train",
        sources.FileCorpus(tuple(sources.text_files(path)), data.text_field, data.document_unit, 0.0, path),
    )


# The run's documents (config.data: raw text sources or prepared stores), read as token splits.
def _documents_fingerprint(config: Config) -> str:
    if config.data.source != "store":
        return sources.source_from_config(config.data).fingerprint()
    manifests = [opened.manifest for opened in open_stores(config)]
    return sources.digest([[m["source"]["fingerprint"], m["tokenizer"]["sha256"], m["splits"]] for m in manifests])


def _describe_documents(config: Config) -> str:
    data = config.data
    if data.source == "store" and data.mixture:
        return "stores " + ", ".join(str(path) for path, _ in data.mixture)
    named = {"python_stdlib": "the Python standard library", "tfds": f"tfds {data.name}"}.get(data.source)
    return f"{data.source} {named or data.path or data.train_path}"


DOCUMENTS = Reader(
    splits=_document_splits,
    file=_document_file,
    texts=lambda raw: raw.texts(),
    fingerprint=_documents_fingerprint,
    describe=_describe_documents,
)


def _split_paths(config: Config, read_file: Callable[[Config, str], Any]) -> dict[str, Any]:
    return {split: read_file(config, config.data[f"{split}_path"]) for split in ("train", "validation")}


def _check_split_files(config: Config) -> None:
    for field in ("train_path", "validation_path"):
        path = config.data[field]
        if not path or not storage.is_file(path):
            raise ValueError(
                f"config.data.{field}={path!r} is not a file; objective {config.objective.name!r} reads "
                "one text file per split (e.g. ptb.train.txt and ptb.valid.txt)"
            )


def _text_file(config: Config, path: str) -> list[str]:
    return [storage.read_text(path)]


# Whole text files, one per split: config.data.{train,validation}_path (Mikolov's PTB files).
TEXT_FILES = Reader(splits=lambda config: _split_paths(config, _text_file), file=_text_file, check=_check_split_files)


def text_file_tokens(raw: list[str], tokenizer: tokenizers.Tokenizer, vocab_size: int, where: str) -> np.ndarray:
    """A TEXT_FILES split as one [N] int32 stream (a word tokenizer ends every line with <eos>)."""
    ids = np.concatenate([np.asarray(tokenizer.encode(text), dtype=np.int32) for text in raw])
    transforms.check_token_ids(ids, vocab_size, where=where)
    return ids


def _labelled_tsv(config: Config, path: str) -> tuple[list[tuple[str, ...]], np.ndarray]:
    return sources.read_labelled_tsv(path, tuple(config.data.text_fields), config.data.label_field)


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


def _conversation_file(config: Config, path: str) -> list:
    if problems.is_problem_file(path):
        return problems.read_problems(path, config.data.prompt_template)
    return chat.read_conversations(path) if chat.is_chat_file(path) else comparisons.read_comparisons(path)


def _conversation_splits(config: Config) -> dict[str, list]:
    if not config.data.path:
        raise ValueError(
            f"objective {config.objective.name!r} reads comparisons or conversations: set --config.data.path="
            "FILE.jsonl(.gz) (HH-RLHF format) or a chat file (.jsonl(.gz) or .parquet of `messages` rows or pairs)"
        )
    o = config.objective
    read = functools.partial(_conversation_file, config)
    return comparisons.read_splits(config.data.path, o.heldout_fraction, o.split_seed, read=read)


def _conversation_texts(raw: list) -> list[str]:
    if problems.holds_problems(raw):
        return [p.prompt + " " + problems.solution(p.fields) for p in raw]
    return chat.texts(raw) if chat.holds_conversations(raw) else COMPARISONS.texts(raw)


# COMPARISONS, chat rows (`lmzoo.data.chat`: `messages` conversations and conversational preference pairs, read
# from .jsonl(.gz) or parquet) or problems with checkable answers (`lmzoo.data.problems`: GSM8K rows, synthetic
# tasks) when config.data.path holds them, split alike by a hash of the prompt.
CONVERSATIONS = Reader(splits=_conversation_splits, file=_conversation_file, texts=_conversation_texts)


def _text_pairs(config: Config, path: str) -> list[tuple[str, str]]:
    return sources.read_text_pairs(path, tuple(config.data.text_fields), config.data.split_marker)


def _text_pair_splits(config: Config) -> dict[str, list[tuple[str, str]]]:
    train, validation = sources.split_documents(_text_pairs(config, config.data.path), config.data.validation_fraction)
    return {"train": train, "validation": validation}


# (source, target) pairs of config.data.path: two text fields, or one split at config.data.split_marker; the
# last config.data.validation_fraction of them held out.
TEXT_PAIRS = Reader(
    splits=_text_pair_splits,
    file=_text_pairs,
    texts=lambda raw: [f"{source}\n{target}" for source, target in raw],
)
