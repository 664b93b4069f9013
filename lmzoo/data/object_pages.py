"""A bounded local read-through cache of bucket objects, filled page by page: how a token store in a bucket is read.

An object is mirrored into a sparse local file of its size, beside a flag per page (1 = fetched). Reading a range
first fetches its missing pages (the runs of missing pages of many ranges go out together, `storage.read_ranges`),
writes them into the file and then sets their flags; readers then index a memory map of the file, as they would a
local store. Pages are small (4 KiB), so a random 1,025-token window fetches one or two pages.

Several processes on a host share the cache safely: a page's bytes are the object's, whoever writes them, and a flag
is set only after its bytes are written, so a reader that finds a flag finds the bytes. An object is cached under its
location, size and version (GCS generation, S3 ETag), so a store prepared again at the same path is never read from a
stale copy. The cache is bounded by `max_bytes` of allocated disk: past it, the objects read least recently are
removed whole (never one read within the last `IN_USE_SECONDS`); a process that still has a removed object open keeps
reading its own copy, as Linux keeps an unlinked file for its open descriptors.
"""

import contextlib
import hashlib
import os
import shutil
import threading
import time

import numpy as np

from lmzoo import storage

PAGE_BYTES = 4096
# A run of missing pages is fetched in requests of at most this many bytes (an evaluation pass reads whole shards).
MAX_REQUEST_BYTES = 8 << 20
# The cache is measured, and trimmed to `max_bytes`, each time a process has fetched this share of the bound.
CHECK_FRACTION = 0.125
IN_USE_SECONDS = 60.0


class PageCache:
    """The cache folder `root`, holding at most about `max_bytes` of fetched pages."""

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"the read cache's size must be > 0 bytes, got {max_bytes}")
        self.root, self.max_bytes = os.fspath(root), int(max_bytes)
        self._fetched_since_check = 0
        self._lock = threading.Lock()

    def object(self, location: str, size: int, version: str) -> "CachedObject":
        """The cached mirror of the bucket object at `location` (of `size` bytes and `version`)."""
        key = hashlib.sha256(f"{location}\0{size}\0{version}".encode()).hexdigest()[:32]
        return CachedObject(self, location, size, os.path.join(self.root, key))

    def _fetched(self, count: int) -> None:
        with self._lock:
            self._fetched_since_check += count
            if self._fetched_since_check < CHECK_FRACTION * self.max_bytes:
                return
            self._fetched_since_check = 0
        self.trim()

    def trim(self) -> None:
        """Removes the least recently read objects until the cache holds at most `max_bytes`."""
        entries = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                with contextlib.suppress(FileNotFoundError):
                    data = os.stat(os.path.join(entry.path, "data"))
                    used = os.stat(os.path.join(entry.path, "pages")).st_mtime
                    entries.append((used, data.st_blocks * 512, entry.path))
        total = sum(size for _, size, _ in entries)
        now = time.time()
        for used, size, folder in sorted(entries):
            if total <= self.max_bytes:
                break
            if now - used < IN_USE_SECONDS:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            total -= size


class CachedObject:
    """One bucket object's local mirror: `ensure(ranges)` fetches what is missing; `array(dtype)` maps the file."""

    def __init__(self, cache: PageCache, location: str, size: int, folder: str):
        self.cache, self.location, self.size, self.folder = cache, location, size, folder
        self.num_pages = -(-size // PAGE_BYTES)
        os.makedirs(folder, exist_ok=True)
        self._data = os.open(os.path.join(folder, "data"), os.O_RDWR | os.O_CREAT, 0o666)
        pages = os.open(os.path.join(folder, "pages"), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            # Every process opening the object sets the same sizes; a file another process has filled keeps its bytes.
            if os.fstat(self._data).st_size != size:
                os.ftruncate(self._data, size)
            if os.fstat(pages).st_size != self.num_pages:
                os.ftruncate(pages, self.num_pages)
            self.pages = (
                np.memmap(os.fdopen(os.dup(pages), "r+b"), np.uint8, "r+", shape=(self.num_pages,))
                if self.num_pages
                else np.zeros(0, np.uint8)
            )
        finally:
            os.close(pages)

    def array(self, dtype: np.dtype) -> np.ndarray:
        """The object's bytes as [size / itemsize] of `dtype`, read through the local file (call `ensure` first)."""
        count = self.size // np.dtype(dtype).itemsize
        if not count:
            return np.zeros(0, dtype)
        return np.memmap(os.path.join(self.folder, "data"), dtype, "r", shape=(count,))

    def ensure(self, starts: np.ndarray, ends: np.ndarray) -> None:
        """Fetches every missing page of the byte ranges [starts[i], ends[i]) (int64 arrays of the same length)."""
        ensure_all([(self, starts, ends)])

    def _missing_runs(self, starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
        """[first page, end page) runs of the pages of the byte ranges not fetched yet, each at most MAX_REQUEST_BYTES."""
        starts, ends = np.asarray(starts, np.int64), np.minimum(np.asarray(ends, np.int64), self.size)
        keep = ends > starts
        if not keep.any():
            return []
        first, last = starts[keep] // PAGE_BYTES, (ends[keep] - 1) // PAGE_BYTES
        counts = last - first + 1
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        needed = np.unique(np.repeat(first, counts) + offsets)
        missing = needed[self.pages[needed] == 0]
        if not len(missing):
            return []
        # Consecutive missing pages are fetched as one range, cut at MAX_REQUEST_BYTES.
        breaks = np.flatnonzero(np.diff(missing) != 1) + 1
        per_request = MAX_REQUEST_BYTES // PAGE_BYTES
        runs = []
        for run in np.split(missing, breaks):
            for begin in range(0, len(run), per_request):
                piece = run[begin : begin + per_request]
                runs.append((int(piece[0]), int(piece[-1]) + 1))
        return runs

    def _fill(self, runs: list[tuple[int, int]], parts: list[bytes]) -> None:
        """Writes fetched pages into the local file, then flags them: a flag set means its bytes are there."""
        for (first, _), data in zip(runs, parts, strict=True):
            os.pwrite(self._data, data, first * PAGE_BYTES)
        if runs:  # one fancy-index store for every run: slicing a memmap per run costs more than the run's flags
            self.pages[np.concatenate([np.arange(first, end) for first, end in runs])] = 1
        os.utime(os.path.join(self.folder, "pages"))
        self.cache._fetched(sum(len(data) for data in parts))

    def read(self) -> bytes:
        """The whole object (small objects: a shard's document starts)."""
        self.ensure(np.array([0]), np.array([self.size]))
        return os.pread(self._data, self.size, 0) if self.size else b""

    def __del__(self):
        with contextlib.suppress(Exception):
            os.close(self._data)


def ensure_all(requests: list[tuple[CachedObject, np.ndarray, np.ndarray]]) -> None:
    """`CachedObject.ensure` of several objects' byte ranges, their missing pages fetched all together (one round trip
    for a training step's windows, whatever the shards they fall in)."""
    plans = [(cached, cached._missing_runs(starts, ends)) for cached, starts, ends in requests]
    reads = [
        (cached.location, first * PAGE_BYTES, min(end * PAGE_BYTES, cached.size) - first * PAGE_BYTES)
        for cached, runs in plans
        for first, end in runs
    ]
    if not reads:
        return
    parts = storage.read_ranges_of(reads)
    done = 0
    for cached, runs in plans:
        cached._fill(runs, parts[done : done + len(runs)])
        done += len(runs)
