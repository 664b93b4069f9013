"""Tokenize a corpus once into a token store (`lmzoo.data.store`), in parallel, resumably.

    python -m lmzoo.data.prepare --source=corpus/ --out=/data/stores/corpus_gpt2 \\
        --tokenizer=gpt2 --tokenizer_path=../shared/data/tokenizers/gpt2 --validation_fraction=0.0005 --workers=8

Sources: text files and folders (.txt/.md/.py: one document per file, paragraph or line), .jsonl(.gz) and parquet
files (the text in `--text_field`), or a prepared TFDS dataset (`--tfds=NAME`). Documents are cut into chunks in
one fixed order and tokenized by `--workers` processes, at most two chunks each in flight, so memory is bounded by
workers x chunk and the store's bytes do not depend on the worker count. A killed prepare, run again, resumes after
its last finished shard. A training config that names raw text gets the same store built once into a cache keyed
by the source's and tokenizer's fingerprints (`cached_store`). `--sentences` also records where each sentence starts
(each encoded on its own; `lmzoo.data.transforms.split_sentences`), for the sentence-pair objectives.
"""

import argparse
import collections
import fcntl
import hashlib
import logging
import multiprocessing
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from lmzoo import storage, tokenizers
from lmzoo.data import sources, store, transforms

CHUNK_DOCUMENTS = 1024  # documents per chunk of work, at most
CHUNK_BYTES = 1 << 20  # text per chunk of work, at most (a longer document goes over several, `chunks`)
SHARD_TOKENS = 100_000_000  # a shard is closed at the first chunk end past this many tokens (llm.c's size)
PARALLEL_BYTES = 64 << 20  # a config's corpus larger than this is cached by one worker per CPU (spawning costs ~2 s)


WHOLE_WARNING_CHARS = 16 * CHUNK_BYTES  # a document held whole past this size is reported


class Chunk(NamedTuple):
    """A unit of work: `texts` of one split, each a document or a piece of one. continues: texts[0] goes on with the
    previous chunk's last document; unfinished: texts[-1]'s document goes on in the next chunk (no EOS here)."""

    index: int
    split: str
    texts: list[str]
    continues: bool = False
    unfinished: bool = False


def _tail(parts: list[str], length: int) -> str:
    """The last `length` characters of the text `parts` hold, joining only the parts it needs."""
    taken, count = [], 0
    for part in reversed(parts):
        taken.append(part)
        count += len(part)
        if count >= length:
            break
    text = "".join(reversed(taken))
    return text[len(text) - length :]


def _safe_pieces(
    source: sources.DocumentSource, cut: Callable[[str, int], int | None] | None
) -> Iterator[tuple[str, str, bool]]:
    """(split, text, continues): the source's documents, read in pieces (`DocumentSource.pieces`); one longer than
    CHUNK_BYTES characters handed on in pieces of at least CHUNK_BYTES, each cut at the first place from there where
    `cut` (a tokenizer's `safe_split`) allows, so that the pieces' ids are the whole's. Without such a place (`cut`
    None, or it finds none) the document is held whole, and one over WHOLE_WARNING_CHARS is reported."""
    split, parts, held, continues, searched, warned = None, [], 0, False, CHUNK_BYTES, False
    # read in quarters of a chunk, so that a cut comes when a quarter more than a chunk is held, not twice a chunk
    for piece_split, text, piece_continues in source.pieces(max(CHUNK_BYTES // 4, 1)):
        if not piece_continues:
            if split is not None:
                yield split, "".join(parts), continues
            split, parts, held, continues, searched, warned = piece_split, [], 0, False, CHUNK_BYTES, False
        parts.append(text)
        held += len(text)
        while cut is not None and held > searched:
            # A rule decides a cut at i from the characters at i - 1 and i alone: the search reads the text from
            # `searched` on and the character before it, and one that finds nothing starts the next search at `held`.
            window = _tail(parts, held - searched + 1)
            at = cut(window, 1)
            if at is None:
                searched = held
                break
            pending, at = "".join(parts), searched - 1 + at
            yield split, pending[:at], continues
            parts, held, continues, searched = [pending[at:]], held - at, True, CHUNK_BYTES
        if held > WHOLE_WARNING_CHARS and not warned:
            warned = True
            logging.warning(
                "a %s document goes on past %s characters with no place to cut it where its tokenizer's ids stay "
                "those of the whole (SentencePiece and --sentences never cut): it is held and tokenized whole, by one "
                "worker, and memory grows with it",
                split,
                f"{held:,}",
            )
    if split is not None:
        yield split, "".join(parts), continues


def chunks(
    source: sources.DocumentSource,
    documents: int = CHUNK_DOCUMENTS,
    cut: Callable[[str, int], int | None] | None = None,
) -> Iterator[Chunk]:
    """The source's documents in order, cut into chunks of one split, at most `documents` texts and about CHUNK_BYTES
    of text each. A document longer than CHUNK_BYTES goes over several chunks as pieces cut where `cut` (a tokenizer's
    `safe_split`) allows (`_safe_pieces`), each piece after the first opening a chunk; without `cut` it is whole."""
    index, split, texts, size, continues = 0, None, [], 0, False
    for piece_split, text, piece_continues in _safe_pieces(source, cut):
        if texts and (piece_continues or piece_split != split or len(texts) >= documents or size >= CHUNK_BYTES):
            yield Chunk(index, split, texts, continues, unfinished=piece_continues)
            index, texts, size = index + 1, [], 0
        if not texts:
            continues = piece_continues
        split = piece_split
        texts.append(text)
        size += len(text)
    if texts:
        yield Chunk(index, split, texts, continues)


def encode_sentence_documents(
    tokenizer: tokenizers.Tokenizer, texts: list[str], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents as their sentences (`transforms.split_sentences`, each encoded on its own, empty ones dropped)
    concatenated, then EOS when the tokenizer has one: (tokens [N] of `dtype`, lengths [d] of the documents that have
    a sentence, sentence starts [s] int64 in `tokens`)."""
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    tokens, lengths, starts = [], [], []
    for text in texts:
        sentences = [ids for ids in tokenizer.encode_batch(transforms.split_sentences(text, wrapped=True)) if ids]
        if not sentences:
            continue
        for ids in sentences:
            starts.append(len(tokens))
            tokens.extend(ids)
        tokens.extend(eos)
        lengths.append(sum(map(len, sentences)) + len(eos))
    return np.array(tokens, dtype), np.array(lengths, np.int64), np.array(starts, np.int64)


def encode_chunk(
    tokenizer: tokenizers.Tokenizer, dtype: np.dtype, sentences: bool, texts: list[str], unfinished: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(tokens [N], document lengths [d], sentence starts [s] or None) of one chunk of documents, the last of them
    without its EOS when `unfinished` (it goes on in the next chunk, which ends it; never with `sentences`)."""
    if sentences:
        return encode_sentence_documents(tokenizer, texts, dtype)
    tokens, lengths = tokenizer.encode_documents(texts, dtype)
    if unfinished and tokenizer.eos_id is not None:
        tokens, lengths[-1] = tokens[:-1], lengths[-1] - 1
    return tokens, lengths, None


_worker_encoding: tuple[tokenizers.Tokenizer, np.dtype, bool] | None = None


def _init_worker(tokenizer: tokenizers.Tokenizer, dtype: np.dtype, sentences: bool) -> None:
    global _worker_encoding
    _worker_encoding = (tokenizer, dtype, sentences)


def _encode_in_worker(texts: list[str], unfinished: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return encode_chunk(*_worker_encoding, texts, unfinished)


def _encoded(
    work: Iterator[Chunk], tokenizer: tokenizers.Tokenizer, dtype: np.dtype, sentences: bool, workers: int
) -> Iterator[tuple[Chunk, np.ndarray, np.ndarray, np.ndarray | None]]:
    """(chunk, tokens, lengths, sentence starts) of every chunk of `work`, in order, tokenized by `workers`
    processes."""
    global _worker_encoding
    if workers <= 1:
        for chunk in work:
            yield chunk, *encode_chunk(tokenizer, dtype, sentences, chunk.texts, chunk.unfinished)
        return
    # fork shares the tokenizer with the workers at no cost (spawning them and sending it takes seconds); a process
    # that has started JAX's threads must not fork, so there the workers are spawned and get it pickled.
    if "jax" in sys.modules:
        context, initializer = multiprocessing.get_context("spawn"), _init_worker
        initargs = (tokenizer, dtype, sentences)
    else:
        context, initializer, initargs = multiprocessing.get_context("fork"), None, ()
        _worker_encoding = (tokenizer, dtype, sentences)
    with context.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        pending = collections.deque()
        for chunk in work:
            pending.append((chunk, pool.apply_async(_encode_in_worker, (chunk.texts, chunk.unfinished))))
            if len(pending) >= 2 * workers:
                chunk, result = pending.popleft()
                yield chunk, *result.get()
        while pending:
            chunk, result = pending.popleft()
            yield chunk, *result.get()


def header(
    source: sources.DocumentSource, tokenizer: tokenizers.Tokenizer, dtype: str | None = None, sentences: bool = False
) -> dict:
    """What defines a store's content: format, dtype, tokenizer (spec and hash), EOS policy, source fingerprint and
    whether documents are stored as sentences."""
    chosen = token_dtype_for(tokenizer, dtype)
    spec, digest = store.tokenizer_fingerprint(tokenizer)
    return ({"sentences": True} if sentences else {}) | {
        "format_version": store.FORMAT_VERSION,
        "dtype": chosen.str,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": {"spec": spec, "sha256": digest},
        "eos": "none" if tokenizer.eos_id is None else "appended",
        "eos_id": tokenizer.eos_id,
        "source": {"description": source.description, "fingerprint": source.fingerprint()},
    }


def token_dtype_for(tokenizer: tokenizers.Tokenizer, dtype: str | None) -> np.dtype:
    """The store's dtype: `dtype` if given and wide enough for the vocabulary, else the narrowest that is."""
    if not dtype:
        return store.token_dtype(tokenizer.vocab_size)
    chosen = np.dtype(dtype).newbyteorder("<")
    if chosen.kind != "u" or tokenizer.vocab_size > 2 ** (8 * chosen.itemsize):
        raise store.StoreError(
            f"--dtype={dtype} cannot hold the tokenizer's {tokenizer.vocab_size:,} ids; use uint32 (or leave "
            "--dtype out to choose the narrowest that fits)"
        )
    return chosen


def prepare(
    source: sources.DocumentSource,
    tokenizer: tokenizers.Tokenizer,
    folder: str | os.PathLike,
    *,
    workers: int = 1,
    shard_tokens: int = SHARD_TOKENS,
    chunk_documents: int = CHUNK_DOCUMENTS,
    dtype: str | None = None,
    sentences: bool = False,
    progress: bool = True,
) -> store.Store:
    """Tokenizes `source` into the store at `folder` (resuming a killed build there) and opens it. The chunking
    (`chunk_documents`) and `shard_tokens` decide the bytes written, so a resumed build must keep them. `sentences`:
    documents as sentences, with the sentence index (`encode_sentence_documents`)."""
    root = storage.path(folder)
    if storage.exists(root / store.MANIFEST):
        raise store.StoreError(f"{root} already holds a complete store; choose another output folder or remove it")
    settings = {"shard_tokens": shard_tokens, "chunk_documents": chunk_documents, "chunk_bytes": CHUNK_BYTES}
    existed = storage.exists(root)
    writer = store.StoreWriter(
        root, {**header(source, tokenizer, dtype, sentences), "settings": settings}, shard_tokens
    )
    try:
        return _write(
            source, tokenizer, writer, chunk_documents, workers=workers, sentences=sentences, progress=progress
        )
    except Exception:
        # A build that finished no shard has nothing to resume, and the ledger it left would refuse the corrected
        # command (another source or settings): the folder goes back to how it was.
        if not writer.finished:
            writer.discard(remove_folder=not existed)
        raise


def _write(
    source: sources.DocumentSource,
    tokenizer: tokenizers.Tokenizer,
    writer: store.StoreWriter,
    chunk_documents: int,
    *,
    workers: int,
    sentences: bool,
    progress: bool,
) -> store.Store:
    """`prepare`'s build into `writer`'s folder, from its first unfinished chunk."""
    writer.save_tokenizer(tokenizer)
    start, last = writer.resume_chunk, -1
    # A long document is cut where the tokenizer's ids stay the whole's; documents as sentences are kept whole.
    cut = None if sentences else tokenizer.safe_split
    work = (chunk for chunk in chunks(source, chunk_documents, cut) if chunk.index >= start)
    # disable=None: the bar shows on a terminal only, so logs and pipes get the final summary line alone.
    bar = tqdm(total=source.size_bytes(), unit="B", unit_scale=True, disable=None if progress else True)
    bar.set_description(f"prepare {writer.folder.name}")
    tokens, began = 0, time.monotonic()
    try:
        for chunk, chunk_tokens, lengths, starts in _encoded(work, tokenizer, writer.dtype, sentences, workers):
            writer.add(
                chunk.split,
                chunk_tokens,
                lengths,
                chunk.index,
                starts,
                continues=chunk.continues,
                unfinished=chunk.unfinished,
            )
            last, tokens = chunk.index, tokens + len(chunk_tokens)
            bar.update(sum(len(t.encode("utf-8", "replace")) for t in chunk.texts))
            bar.set_postfix_str(f"{tokens / max(time.monotonic() - began, 1e-9) / 1e6:.2f}M tokens/s")
    finally:
        bar.close()
    if not any(writer.split_offsets.values()) and writer.current is None:
        raise store.StoreError(f"{source.description} has no documents; check the source")
    return writer.finish(max(last + 1, start))


def cache_root(configured: str = "") -> pathlib.Path:
    """Where stores of configs that name raw text are cached: `configured`, else $LMZOO_CACHE, else ~/.cache/lmzoo."""
    return pathlib.Path(store.cache_base(configured)) / "stores"


def cached_store(
    source: sources.DocumentSource,
    tokenizer: tokenizers.Tokenizer,
    root: pathlib.Path,
    workers: int = 1,
    sentences: bool = False,
) -> store.Store:
    """The store of `source` tokenized by `tokenizer` under `root` (as sentences: `sentences`), built on first use.
    Its folder is named by the fingerprints of both, so a changed source or tokenizer gets a new store and a stale
    one is never read; a lock makes concurrent processes build it once."""
    identity = source.fingerprint() + store.tokenizer_fingerprint(tokenizer)[1] + str(store.FORMAT_VERSION)
    key = hashlib.sha256((identity + (":sentences" if sentences else "")).encode()).hexdigest()[:20]
    folder = root / key
    if (folder / store.MANIFEST).is_file():
        return store.open_store(folder)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / store.MANIFEST).is_file():
            return store.open_store(folder)
        return prepare(source, tokenizer, folder, workers=workers, sentences=sentences, progress=False)


def _source_from_args(args: argparse.Namespace) -> sources.DocumentSource:
    if args.tfds:
        if args.source:
            raise ValueError("give --source or --tfds, not both")
        splits = (("train", args.tfds_train_split), ("validation", args.tfds_validation_split))
        return sources.SplitCorpus(
            tuple(
                (split, lambda s=name: sources.iter_tfds(args.tfds, s, args.tfds_data_dir or None, args.text_field))
                for split, name in splits
                if name
            ),
            ("tfds", args.tfds, args.tfds_data_dir, splits, args.text_field),
            f"tfds {args.tfds}",
        )
    if not args.source:
        raise ValueError("--source (files or folders) or --tfds is required")
    files = [f for path in args.source for f in sources.text_files(path)]
    return sources.FileCorpus(
        tuple(files),
        args.text_field,
        args.document_unit,
        args.validation_fraction,
        ", ".join(args.source),
        text_field_fix="pass --text_field=NAME, the field that holds the text",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmzoo.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--source", nargs="*", default=[], help="text files or folders (.txt .md .py .jsonl(.gz) .parquet)"
    )
    parser.add_argument("--tfds", default="", help="a prepared TFDS dataset's name (instead of --source)")
    parser.add_argument("--tfds_data_dir", default="")
    parser.add_argument("--tfds_train_split", default="train")
    parser.add_argument("--tfds_validation_split", default="validation")
    parser.add_argument("--out", required=True, help="the store folder (empty, or a killed prepare's to resume)")
    parser.add_argument("--tokenizer", default="byte", help=f"tokenizer kind: {', '.join(tokenizers.KINDS)}")
    parser.add_argument("--tokenizer_path", default=None, help="its file or folder (gpt2: vocab.json + merges.txt)")
    parser.add_argument("--text_field", default="text", help="the text's field in .jsonl rows, parquet and TFDS")
    parser.add_argument("--document_unit", default="file", choices=sources.DOCUMENT_UNITS)
    parser.add_argument("--validation_fraction", type=float, default=0.0005, help="last share of records held out")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--shard_tokens", type=int, default=SHARD_TOKENS, help="tokens per shard (closed at a chunk end)"
    )
    parser.add_argument("--chunk_documents", type=int, default=CHUNK_DOCUMENTS, help="documents per unit of work")
    parser.add_argument("--dtype", default="", help="uint16 or uint32 (default: the narrowest that fits)")
    parser.add_argument(
        "--sentences", action="store_true", help="also index sentences (for mlm_nsp and mlm_sop); each encoded alone"
    )
    args = parser.parse_args(argv)
    try:
        if not 0 <= args.validation_fraction < 1:
            raise ValueError(f"--validation_fraction={args.validation_fraction} must be in [0, 1)")
        if min(args.workers, args.shard_tokens, args.chunk_documents) < 1:
            raise ValueError("--workers, --shard_tokens and --chunk_documents must be >= 1")
        if args.tokenizer in ("char", "word") or (args.tokenizer == "sentencepiece" and not args.tokenizer_path):
            raise ValueError(
                f"--tokenizer={args.tokenizer} is learnt from a corpus; give a saved one (--tokenizer=word or "
                "sentencepiece with --tokenizer_path) or a fixed kind (byte, gpt2, wordpiece, hf_json)"
            )
        tokenizer = tokenizers.build_tokenizer(args.tokenizer, path=args.tokenizer_path)
        source = _source_from_args(args)
        began = time.monotonic()
        result = prepare(
            source,
            tokenizer,
            args.out,
            workers=args.workers,
            shard_tokens=args.shard_tokens,
            chunk_documents=args.chunk_documents,
            dtype=args.dtype,
            sentences=args.sentences,
        )
    except (ValueError, OSError) as e:  # bad flags or inputs; an output folder that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokens = sum(info["tokens"] for info in result.manifest["splits"].values())
    rate = tokens / max(time.monotonic() - began, 1e-9) / 1e6
    print(f"prepared {result.folder}: {result.summary()} ({rate:.2f}M tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
