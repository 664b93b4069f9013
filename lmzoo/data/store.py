"""Token stores: a corpus tokenized once into flat, memory-mapped shards (`python -m lmzoo.data.prepare`).

A store folder holds
    manifest.json         written last: its presence means the store is complete (format, dtype, tokenizer and its
                          hash, EOS policy, source fingerprint, counts of every split and shard)
    tokenizer/            the tokenizer's files and spec.json: what decodes the ids
    SPLIT/NNNNN.tokens    token ids, little-endian uint16 (vocabulary <= 65,536) or uint32; the split's documents
                          concatenated, each followed by EOS when the manifest's `eos` is "appended"
    SPLIT/NNNNN.starts    int64 offset of each document of the shard, counted from the split's first token
    SPLIT/NNNNN.sentences in a store prepared with --sentences (the manifest's `sentences` is true): int64 offset of
                          each sentence, for the sentence-pair objectives (NSP, SOP); a document is its sentences
                          concatenated (then EOS)
    progress.json         while it is built: the finished shards, after which a killed build resumes

Shards end at document boundaries, so a document is whole in one shard. Opening a store reads the manifest and
maps the shards: start-up time and memory do not grow with the corpus.

A store may be a local folder or a bucket prefix (gs://, s3://; `lmzoo.storage`). In a bucket every file above is an
object: a shard's objects are uploaded once the shard is complete (its token ids last), the progress ledger after
them, the manifest after everything. Its token shards are read by ranged reads through a bounded local read-through
cache (`lmzoo.data.object_pages`), its document and sentence offsets whole when the store is opened.
"""

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import resource
import tempfile
from collections.abc import Sequence

import numpy as np

from lmzoo import storage, tokenizers
from lmzoo.data import object_pages

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
SPLITS = ("train", "validation")
READ_CACHE_GB = 20.0  # the default bound of the local cache of bucket stores (config.data.read_cache_gb)


class StoreError(ValueError):
    """A store that cannot be read or written as asked; the message names the file and the fix."""


# What to do when a shard outgrows the process's file-size limit: a smaller --shard_tokens changes the store's header,
# so it needs a new folder, while the same command resumes after the finished shards.
_FILE_SIZE_LIMIT_FIX = (
    "raise the limit (ulimit -f unlimited) and run the same command to resume, or prepare into a new folder with a "
    "smaller --shard_tokens so that each shard fits under it"
)


def _file_size_limit() -> str:
    """The process's file-size limit (RLIMIT_FSIZE, `ulimit -f`), past which a write fails with EFBIG."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return (
        "a file-size limit (ulimit -f)"
        if limit == resource.RLIM_INFINITY
        else f"a file-size limit of {limit:,} bytes (ulimit -f)"
    )


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def tokenizer_fingerprint(tokenizer: tokenizers.Tokenizer) -> tuple[dict, str]:
    """(spec, sha256 of the spec and the files `save` writes): equal hashes mean equal ids for every text."""
    with tempfile.TemporaryDirectory() as folder:
        spec = tokenizer.save(folder)
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
        for path in sorted(pathlib.Path(folder).rglob("*")):
            if path.is_file():
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return spec, digest.hexdigest()


def write_json(path: str | os.PathLike, value: dict) -> None:
    """Writes `value` as a file or object replaced whole (`storage.write_text`): readers see the old or new one."""
    storage.write_text(path, json.dumps(value, indent=1))


def cache_base(configured: str = "") -> str:
    """lmzoo's local cache folder: `configured`, else $LMZOO_CACHE, else ~/.cache/lmzoo."""
    return os.path.expanduser(configured or os.environ.get("LMZOO_CACHE") or "~/.cache/lmzoo")


def read_cache(configured: str = "", size_gb: float = READ_CACHE_GB) -> object_pages.PageCache:
    """The bounded local cache that bucket stores are read through: `objects/` under `cache_base(configured)`."""
    return object_pages.PageCache(os.path.join(cache_base(configured), "objects"), int(size_gb * 2**30))


class TokenSplit:
    """One split's tokens [N] across shards (memory maps or arrays) and the start of each document.

    shards[k]: [n_k] ids of shard k; starts[k]: [d_k] int64 offsets (in the split) of the documents beginning in
    shard k, the first being the shard's own offset. pages[k], for a store in a bucket: shard k's cached object, whose
    missing pages every read fetches first (shards[k] maps its local file).
    """

    def __init__(
        self,
        shards: Sequence[np.ndarray],
        starts: Sequence[np.ndarray],
        name: str = "",
        sentence_starts: Sequence[np.ndarray] | None = None,
        eos_appended: bool = False,
        pages: Sequence[object_pages.CachedObject] | None = None,
    ):
        self.shards, self.starts, self.name, self.pages = list(shards), list(starts), name, pages
        self.sentence_starts, self.eos_appended = sentence_starts, eos_appended
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in self.shards])]).astype(np.int64)
        self.first_document = np.concatenate([[0], np.cumsum([len(s) for s in self.starts])]).astype(np.int64)

    @classmethod
    def from_documents(cls, documents: Sequence[Sequence[int]], eos_id: int | None, name: str = "") -> "TokenSplit":
        """An in-memory split of token lists, EOS appended to each when given (as a store writes them)."""
        arrays = [np.asarray(d, np.int64) for d in documents]
        if eos_id is not None:
            arrays = [np.append(a, eos_id) for a in arrays]
        lengths = np.array([len(a) for a in arrays], np.int64)
        tokens = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
        return cls([tokens], [np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)], name)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_documents(self) -> int:
        return int(self.first_document[-1])

    def __len__(self) -> int:
        return self.num_tokens

    def document(self, index: int) -> np.ndarray:
        """Tokens [n] int32 of document `index` (with its EOS when the store appends one)."""
        k = int(np.searchsorted(self.first_document, index, side="right")) - 1
        local = index - self.first_document[k]
        starts = self.starts[k]
        start = int(starts[local])
        end = int(starts[local + 1]) if local + 1 < len(starts) else int(self.offsets[k + 1])
        return self.tokens_between(start, end)

    def sentences(self) -> "SentenceIndex":
        """The split's documents as sentences (a store prepared with --sentences); StoreError otherwise."""
        if self.sentence_starts is None:
            raise StoreError(
                f"{self.name} has no sentence index: prepare the store with --sentences for the sentence-pair "
                "objectives (mlm_nsp, mlm_sop)"
            )
        return SentenceIndex(self)

    def fetch(self, starts: np.ndarray, ends: np.ndarray) -> None:
        """Makes split positions [starts[i], ends[i]) readable: for a store in a bucket, fetches what the local cache
        lacks of them (all ranges together); nothing for a local store. Reads call it; a prefetch may call it early."""
        if self.pages is None:
            return
        starts, ends = np.asarray(starts, np.int64), np.minimum(np.asarray(ends, np.int64), self.num_tokens)
        itemsize = self.shards[0].dtype.itemsize if self.shards else 1
        first = np.searchsorted(self.offsets, starts, side="right") - 1
        last = np.searchsorted(self.offsets, np.maximum(ends - 1, starts), side="right") - 1
        requests = []
        for k in range(int(first.min(initial=0)), int(last.max(initial=-1)) + 1):
            mine = (first <= k) & (last >= k) & (ends > starts)
            if mine.any():
                begin = np.maximum(starts[mine], self.offsets[k]) - self.offsets[k]
                end = np.minimum(ends[mine], self.offsets[k + 1]) - self.offsets[k]
                requests.append((self.pages[k], begin * itemsize, end * itemsize))
        object_pages.ensure_all(requests)  # every shard's pages in one round trip

    def tokens_between(self, start: int, end: int) -> np.ndarray:
        """Tokens [end - start] int32 of split positions [start, end), inside one shard (as a document is)."""
        self.fetch(np.array([start]), np.array([end]))
        k = int(np.searchsorted(self.offsets, start, side="right")) - 1
        return np.asarray(self.shards[k][start - self.offsets[k] : end - self.offsets[k]], np.int32)

    def windows(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [B, length] int32 from each start and the document index of each token [B, length] int64;
        positions past the end of the split are token 0 with document -1."""
        starts = np.asarray(starts, np.int64)
        self.fetch(starts, starts + length)
        tokens = np.zeros((len(starts), length), np.int32)
        documents = np.full((len(starts), length), -1, np.int64)
        ends = np.minimum(starts + length, self.num_tokens)
        first_shard = np.searchsorted(self.offsets, starts, side="right") - 1
        last_shard = np.searchsorted(self.offsets, ends - 1, side="right") - 1
        whole = (ends - starts == length) & (first_shard == last_shard)
        for k in np.unique(first_shard[whole]):
            rows = np.flatnonzero(whole & (first_shard == k))
            self._fill_whole(int(k), rows, starts[rows], length, tokens, documents)
        rows = np.flatnonzero(~whole & (starts < ends))
        position, column = starts[rows], np.zeros(len(rows), np.int64)
        while len(rows):
            shard_of = np.searchsorted(self.offsets, position, side="right") - 1
            for k in np.unique(shard_of):
                mine = shard_of == k
                stop = np.minimum(ends[rows[mine]], self.offsets[k + 1])
                self._fill(int(k), rows[mine], position[mine], stop, column[mine], tokens, documents)
            moved = np.minimum(ends[rows], self.offsets[shard_of + 1])
            column += moved - position
            position = moved
            more = position < ends[rows]
            rows, position, column = rows[more], position[more], column[more]
        return tokens, documents

    def _fill_whole(self, k, rows, begin, length, tokens, documents) -> None:
        """`rows` read split positions [begin, begin + length), all inside shard k: one gather each for the tokens
        and the document starts (the common case, kept free of per-position masks)."""
        local = begin - self.offsets[k]
        tokens[rows] = np.asarray(self.shards[k])[local[:, None] + np.arange(length)]
        doc_starts = self.starts[k]
        first = np.searchsorted(doc_starts, begin, side="right") - 1
        count = np.searchsorted(doc_starts, begin + length, side="left") - first - 1
        marks = np.zeros((len(rows), length), np.int32)
        if count.sum():
            row = np.repeat(np.arange(len(rows)), count)
            nth = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
            marks[row, np.asarray(doc_starts[first[row] + 1 + nth]) - begin[row]] = 1
        np.cumsum(marks, axis=1, out=marks)
        documents[rows] = marks + (self.first_document[k] + first)[:, None]

    def _fill(self, k, rows, begin, end, column, tokens, documents) -> None:
        """Copies split positions [begin, end) of shard k into `column`.. of `rows`, with their document indices."""
        width = end - begin
        steps = np.arange(int(width.max()))
        inside = steps[None, :] < width[:, None]
        local = np.where(inside, begin[:, None] - self.offsets[k] + steps[None, :], 0)
        target_rows = np.broadcast_to(rows[:, None], inside.shape)[inside]
        target_columns = (column[:, None] + steps[None, :])[inside]
        tokens[target_rows, target_columns] = np.asarray(self.shards[k])[local[inside]]
        doc_starts = self.starts[k]
        first = np.searchsorted(doc_starts, begin, side="right") - 1
        last = np.searchsorted(doc_starts, end, side="left")
        count = last - first - 1  # documents starting inside (begin, end)
        marks = np.zeros(inside.shape, np.int64)
        if count.sum():
            row = np.repeat(np.arange(len(rows)), count)
            nth = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
            marks[row, np.asarray(doc_starts[first[row] + 1 + nth]) - begin[row]] = 1
        index = self.first_document[k] + first[:, None] + np.cumsum(marks, axis=1)
        documents[target_rows, target_columns] = index[inside]


class SentenceIndex:
    """The sentences of a split's documents, what `transforms.SentencePairs` reads: counts [D] sentences
    of each document; sentence(d, i) its tokens. Holds the document and sentence offsets ([D] and [S] int64)."""

    def __init__(self, split: TokenSplit):
        self.split = split
        self.sentence_offsets = np.concatenate([np.zeros(0, np.int64), *split.sentence_starts]).astype(np.int64)
        document_starts = np.concatenate([np.zeros(0, np.int64), *split.starts]).astype(np.int64)
        self.document_ends = np.append(document_starts[1:], split.num_tokens) - int(split.eos_appended)
        self.first_sentence = np.searchsorted(self.sentence_offsets, document_starts, side="left")
        self.counts = np.diff(np.append(self.first_sentence, len(self.sentence_offsets)))

    def sentence(self, document: int, index: int) -> list[int]:
        s = int(self.first_sentence[document]) + index
        last = index + 1 == self.counts[document]
        end = self.document_ends[document] if last else self.sentence_offsets[s + 1]
        return self.split.tokens_between(int(self.sentence_offsets[s]), int(end)).tolist()


@dataclasses.dataclass(frozen=True)
class Store:
    """A complete store, opened: its folder (local or in a bucket), manifest, the size and version of each shard
    file, and (in a bucket) the local cache its shards are read through."""

    folder: storage.epath.Path
    manifest: dict
    files: dict[str, tuple[int, str]] = dataclasses.field(
        default_factory=dict
    )  # "SPLIT/NAME.suffix" -> (size, version)
    cache: object_pages.PageCache | None = None

    @property
    def tokenizer_hash(self) -> str:
        return self.manifest["tokenizer"]["sha256"]

    def tokenizer(self) -> tokenizers.Tokenizer:
        spec, folder = self.manifest["tokenizer"]["spec"], self.folder / "tokenizer"
        if not storage.is_remote(folder) or not storage.exists(folder):  # a fixed tokenizer (byte) saves no files
            return tokenizers.from_spec(spec, os.fspath(folder))
        # Tokenizers read local files, all of them when built: a bucket's tokenizer folder is copied for the build.
        with storage.local_copy(folder) as local:
            return tokenizers.from_spec(spec, local)

    def split(self, name: str) -> TokenSplit:
        info = self.manifest["splits"].get(name)
        if not info or not info["tokens"]:
            raise StoreError(
                f"store {self.folder} has no {name!r} tokens (its splits: {self.summary()}); prepare it with a "
                "validation fraction above 0 or choose another store"
            )
        dtype = np.dtype(self.manifest["dtype"])
        with_sentences = bool(self.manifest.get("sentences"))
        shards, starts, sentences, pages = [], [], [], []
        for shard in info["shards"]:
            base = f"{name}/{shard['name']}"
            if self.cache is None:
                shards.append(np.memmap(self.folder / f"{base}.tokens", dtype, "r", shape=(shard["tokens"],)))
                starts.append(np.memmap(self.folder / f"{base}.starts", "<i8", "r", shape=(shard["documents"],)))
                if with_sentences:
                    sentences.append(
                        np.memmap(self.folder / f"{base}.sentences", "<i8", "r", shape=(shard["sentences"],))
                    )
                continue
            pages.append(self._cached(f"{base}.tokens"))
            shards.append(pages[-1].array(dtype))
            starts.append(self._cached(f"{base}.starts"))
            if with_sentences:
                sentences.append(self._cached(f"{base}.sentences"))
        if self.cache is not None:  # every shard's offsets fetched whole, together
            indexes = [*starts, *sentences]
            object_pages.ensure_all([(cached, np.array([0]), np.array([cached.size])) for cached in indexes])
            starts = [np.frombuffer(cached.read(), "<i8") for cached in starts]
            sentences = [np.frombuffer(cached.read(), "<i8") for cached in sentences]
        return TokenSplit(
            shards,
            starts,
            f"{self.folder.name}/{name}",
            sentence_starts=sentences if with_sentences else None,
            eos_appended=self.manifest["eos"] == "appended",
            pages=pages if self.cache is not None else None,
        )

    def _cached(self, relative: str) -> object_pages.CachedObject:
        size, version = self.files[relative]
        return self.cache.object(os.fspath(self.folder / relative), size, version)

    def summary(self) -> str:
        return ", ".join(
            f"{name} {info['tokens']:,} tokens in {info['documents']:,} documents"
            for name, info in self.manifest["splits"].items()
        )

    def check_tokenizer(self, tokenizer: tokenizers.Tokenizer) -> None:
        """Refuses a run whose tokenizer differs from the one that wrote the store."""
        _, digest = tokenizer_fingerprint(tokenizer)
        if digest != self.tokenizer_hash:
            kind = self.manifest["tokenizer"]["spec"].get("kind")
            raise StoreError(
                f"store {self.folder} was written by another tokenizer ({kind}, sha256 {self.tokenizer_hash[:12]}) "
                f"than the run's ({type(tokenizer).__name__}, sha256 {digest[:12]}), whose ids the run reads (a resumed "
                "run keeps the tokenizer in its workdir): point config.data.path (or config.data.mixture) at a store "
                "prepared with the run's tokenizer (a resume keeps config.data.path, so prepare it again at "
                f"{self.folder}), or train on this store in a new --workdir"
            )


def open_store(folder: str | os.PathLike, cache: object_pages.PageCache | None = None) -> Store:
    """The complete store at `folder` (a local folder or a bucket prefix), every shard file checked for presence and
    size; StoreError otherwise. A store in a bucket is read through `cache` (default: `read_cache()`)."""
    root = storage.path(folder)
    try:
        text = storage.read_text(root / MANIFEST)
    except FileNotFoundError:
        if storage.exists(root / PROGRESS):
            raise StoreError(
                f"store {root} is incomplete (its prepare was interrupted); run the same prepare command again to "
                "finish it (finished shards are kept)"
            ) from None
        if not storage.exists(root):
            raise StoreError(
                f"store {root} does not exist; prepare it first: python -m lmzoo.data.prepare --help"
            ) from None
        raise StoreError(
            f"{root} is not a token store (no {MANIFEST}); prepare one: python -m lmzoo.data.prepare"
        ) from None
    except IsADirectoryError:
        raise StoreError(f"{root / MANIFEST} is a folder, not a store manifest; prepare the store again") from None
    try:
        manifest = json.loads(text)
        version = int(manifest["format_version"])
    except (ValueError, KeyError, TypeError) as e:
        raise StoreError(f"{root / MANIFEST} is not a valid store manifest ({e}); prepare the store again") from None
    if version > FORMAT_VERSION:
        raise StoreError(
            f"{root / MANIFEST} has store format {version}, newer than this lmzoo reads ({FORMAT_VERSION}); "
            "upgrade lmzoo or prepare the store again with this version"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    files = {}
    for name, info in manifest["splits"].items():
        found = storage.file_sizes(root / name) if info["shards"] else {}
        for shard in info["shards"]:
            expected = [(".tokens", shard["tokens"] * itemsize), (".starts", shard["documents"] * 8)]
            if manifest.get("sentences"):
                expected.append((".sentences", shard["sentences"] * 8))
            for suffix, size in expected:
                file = f"{shard['name']}{suffix}"
                if file not in found:
                    raise StoreError(f"{root / name / file} is missing from store {root}; prepare the store again")
                if found[file][0] != size:
                    raise StoreError(
                        f"{root / name / file} has {found[file][0]} bytes, the manifest says {size}: the shard is "
                        "truncated or damaged; prepare the store again"
                    )
                files[f"{name}/{file}"] = found[file]
    if storage.is_remote(root) and cache is None:
        cache = read_cache()
    return Store(root, manifest, files, cache if storage.is_remote(root) else None)


@dataclasses.dataclass
class _OpenShard:
    split: str
    name: str
    tokens: int = 0
    documents: int = 0
    starts: list = dataclasses.field(default_factory=list)
    sentence_starts: list = dataclasses.field(default_factory=list)


class StoreWriter:
    """Writes a store shard by shard, in order of chunks; a build killed at any point resumes after its last
    finished shard (`resume_chunk`), and a half-written shard is never read.

    header: everything that defines the store's content (tokenizer, source fingerprint, settings); a folder
    holding a partial build of another header is refused, never mixed.

    `folder` may be a bucket prefix: a shard is then written into a local staging folder and uploaded once finished
    (its offsets first, its token ids last), and the local copy removed, so local disk holds one shard at a time.
    """

    def __init__(self, folder: str | os.PathLike, header: dict, shard_tokens: int):
        storage.refuse_bucket_mount(folder, "--out")
        self.folder, self.header, self.shard_tokens = storage.path(folder), header, shard_tokens
        self.dtype = np.dtype(header["dtype"])
        self._staging = tempfile.TemporaryDirectory(prefix="lmzoo-prepare-") if storage.is_remote(folder) else None
        self.local = pathlib.Path(self._staging.name if self._staging else self.folder)
        self.local.mkdir(parents=True, exist_ok=True)
        progress = self.folder / PROGRESS
        self.finished: list[dict] = []
        try:
            saved = json.loads(storage.read_text(progress))
        except FileNotFoundError:
            saved = None
        if saved is not None:
            if saved["header"] != header:
                raise StoreError(
                    f"{self.folder} holds a partial store of another source, tokenizer or settings; remove it or "
                    "choose another output folder"
                )
            self.finished = saved["shards"]
        elif storage.exists(self.folder) and storage.list_dir(self.folder):
            raise StoreError(
                f"{self.folder} is not empty and holds no store being built; choose an empty output folder"
            )
        else:
            write_json(progress, {"header": header, "shards": []})
        self._discard_unfinished()
        self.split_offsets = {name: 0 for name in SPLITS}
        self.split_documents = {name: 0 for name in SPLITS}
        for shard in self.finished:
            self.split_offsets[shard["split"]] += shard["tokens"]
            self.split_documents[shard["split"]] += shard["documents"]
        self.current: _OpenShard | None = None
        self._file = None

    @property
    def resume_chunk(self) -> int:
        """The first chunk not in a finished shard."""
        return self.finished[-1]["chunk_end"] if self.finished else 0

    def _discard_unfinished(self) -> None:
        """Removes shard files the ledger does not list (a shard being written when the build was killed), and the
        temporary files of writes a kill cut short (the ledger's own, `storage.write_bytes`)."""
        for folder in (self.folder, *(self.folder / split for split in SPLITS)):
            storage.remove_unfinished(folder)
        suffixes = (".tokens", ".starts", ".sentences")
        listed = {f"{s['split']}/{s['name']}{suffix}" for s in self.finished for suffix in suffixes}
        for split in SPLITS:
            for name in storage.file_sizes(self.folder / split):
                if f"{split}/{name}" not in listed:
                    storage.delete(self.folder / split / name)

    def save_tokenizer(self, tokenizer: tokenizers.Tokenizer) -> None:
        """Writes the tokenizer's files into `tokenizer/` (once: a resumed build finds them there)."""
        target = self.folder / "tokenizer"
        if storage.file_sizes(target):
            return
        if self._staging is None:
            tokenizer.save(os.fspath(target))
            return
        with tempfile.TemporaryDirectory(prefix="lmzoo-tokenizer-") as local:
            tokenizer.save(local)
            for file in sorted(pathlib.Path(local).rglob("*")):
                if file.is_file():
                    storage.upload(file, target / file.relative_to(local).as_posix())

    def _shard_path(self, shard: _OpenShard, suffix: str) -> pathlib.Path:
        return self.local / shard.split / f"{shard.name}{suffix}"

    def add(
        self,
        split: str,
        tokens: np.ndarray,
        lengths: np.ndarray,
        chunk: int,
        sentence_starts: np.ndarray | None = None,
        *,
        continues: bool = False,
        unfinished: bool = False,
    ) -> None:
        """Appends chunk `chunk`: documents of `split` with `lengths` [d] whose tokens [sum(lengths)] are concatenated;
        sentence_starts [s]: offsets in `tokens` of their sentences (a store with a sentence index). A document may
        span chunks: `continues`, the first length goes on with the previous chunk's last document (no start of its
        own); `unfinished`, the last document goes on in the next chunk, so no shard closes after this one."""
        if (sentence_starts is not None) != bool(self.header.get("sentences")):
            raise ValueError("sentence starts are given exactly when the store has a sentence index")
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        try:
            if self.current is not None and self.current.split != split:
                self._finish_shard(chunk)
            if self.current is None:
                number = sum(s["split"] == split for s in self.finished)
                self.current = _OpenShard(split, f"{number:05d}")
                (self.local / split).mkdir(exist_ok=True)
                self._file = open(self._shard_path(self.current, ".partial"), "wb")
            shard = self.current
            offset = self.split_offsets[split] + shard.tokens
            starts = offset + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            shard.starts.append(starts[1:] if continues else starts)
            if sentence_starts is not None:
                shard.sentence_starts.append(offset + np.asarray(sentence_starts, np.int64))
            self._file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
            shard.tokens += int(len(tokens))
            shard.documents += int(len(lengths)) - continues
            if shard.tokens >= self.shard_tokens and not unfinished:
                self._finish_shard(chunk + 1)
        except OSError as e:
            self._abandon_shard()
            kept = f"the shard being written was discarded and {len(self.finished)} finished shard(s) kept"
            if e.errno == errno.ENOSPC:
                raise StoreError(
                    f"the disk filled while writing store {self.folder}; {kept}: free space and run the same command "
                    "to resume"
                ) from None
            if e.errno == errno.EFBIG:
                raise StoreError(
                    f"{_file_size_limit()} stopped writing store {self.folder}; {kept}: {_FILE_SIZE_LIMIT_FIX}"
                ) from None
            raise

    def discard(self, *, remove_folder: bool) -> None:
        """Closes the shard being written and removes what the folder holds (and the folder, with `remove_folder`):
        for a build that failed before finishing a shard, which leaves nothing to resume."""
        self._abandon_shard()
        storage.delete_tree(self.folder, keep_folder=not remove_folder)

    def _abandon_shard(self) -> None:
        if self._file is not None:
            # After a write failed for space, closing flushes the bytes still buffered and fails the same way; the
            # file is closed regardless, and deleted below.
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if self.current is not None:
            self._shard_path(self.current, ".partial").unlink(missing_ok=True)
            self.current = None

    def _finish_shard(self, chunk_end: int) -> None:
        shard = self.current
        self._file.close()
        self._file = None
        starts = np.concatenate(shard.starts) if shard.starts else np.zeros(0, np.int64)
        storage.write_bytes(self._shard_path(shard, ".starts"), starts.astype("<i8").tobytes())
        entry = {"split": shard.split, "name": shard.name, "tokens": shard.tokens, "documents": shard.documents}
        if self.header.get("sentences"):
            sentences = np.concatenate([np.zeros(0, np.int64), *shard.sentence_starts])
            storage.write_bytes(self._shard_path(shard, ".sentences"), sentences.astype("<i8").tobytes())
            entry["sentences"] = len(sentences)
        # The token ids last: a shard whose .tokens file is there has all its files.
        storage.replace_local(self._shard_path(shard, ".partial"), self._shard_path(shard, ".tokens"))
        if self._staging is not None:
            # The token ids last: a shard whose .tokens object is there has all its objects.
            for suffix in (".starts", ".sentences", ".tokens"):
                local = self._shard_path(shard, suffix)
                if local.exists():
                    storage.upload(local, self.folder / shard.split / local.name)
                    local.unlink()
        self.finished.append({**entry, "chunk_end": chunk_end})
        self.split_offsets[shard.split] += shard.tokens
        self.split_documents[shard.split] += shard.documents
        self.current = None
        write_json(self.folder / PROGRESS, {"header": self.header, "shards": self.finished})

    def finish(self, chunks: int) -> Store:
        """Closes the last shard, writes the manifest (the store is complete) and removes the ledger."""
        try:
            if self.current is not None:
                self._finish_shard(chunks)
            splits = {
                name: {
                    "tokens": self.split_offsets[name],
                    "documents": self.split_documents[name],
                    "shards": [
                        {k: v for k, v in s.items() if k not in ("split", "chunk_end")}
                        for s in self.finished
                        if s["split"] == name
                    ],
                }
                for name in SPLITS
            }
            write_json(self.folder / MANIFEST, {**self.header, "splits": splits})
        except OSError as e:
            self._abandon_shard()
            if e.errno == errno.ENOSPC:
                raise StoreError(
                    f"the disk filled while finishing store {self.folder}: free space and run the same command again"
                ) from None
            if e.errno == errno.EFBIG:
                raise StoreError(
                    f"{_file_size_limit()} stopped finishing store {self.folder}: {_FILE_SIZE_LIMIT_FIX}"
                ) from None
            raise
        storage.delete(self.folder / PROGRESS)
        if self._staging is not None:
            self._staging.cleanup()
        return open_store(self.folder)
