"""Metric reduction and writers (TensorBoard via tensorboardX, plus a JSON-lines file)."""

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile

import jax
import numpy as np

from lmzoo import storage

# A bucket workdir's event file is uploaded whole at each flush; past this size a new one is begun, so that an upload
# stays small however long the run.
EVENT_FILE_BYTES = 1 << 20


def accumulate(total: dict | None, metrics: dict) -> dict:
    """Adds (sum, count) metric pairs; works on device arrays without a host sync."""
    return metrics if total is None else jax.tree.map(lambda a, b: a + b, total, metrics)


def summarize(total: dict, *, token_nll: bool = True) -> dict[str, float]:
    """(sum, count) pairs -> means on the host; adds perplexity and bits per token when "loss" is a token NLL."""
    host = jax.device_get(total)
    out = {name: float(s) / max(float(c), 1e-12) for name, (s, c) in host.items()}
    if "loss" in out and token_nll:
        out["perplexity"] = math.exp(min(out["loss"], 50.0))
        out["bits_per_token"] = out["loss"] / math.log(2)
    return out


def all_finite(summary: dict[str, float]) -> bool:
    return all(np.isfinite(v) for v in summary.values())


def _row_step(line: str) -> float:
    """The step of a metrics.jsonl row; infinity for a line cut short by a killed run (dropped on resume)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


@contextlib.contextmanager
def tensorboardx_without_torch():
    """A block in which tensorboardX is imported without torch (unless torch is loaded already): tensorboardX imports
    torch whenever it is installed (only to accept torch tensors), which costs a process ~200 MiB and a second."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        yield
    finally:
        del sys.modules["torch"]


def event_writer_class():
    """tensorboardX's SummaryWriter, imported without torch (~0.2 s the first time: the loop imports it on a thread
    while a run's state is made)."""
    with tensorboardx_without_torch():
        from tensorboardX import SummaryWriter
    return SummaryWriter


class _EventFiles:
    """tensorboardX event files for `folder` (tensorboardX writes local files only: its own gs:// writer needs
    google-cloud-storage and uploads its whole file at each flush too). A local folder is written in directly. For a
    bucket they are written in a local temporary folder, and `flush` uploads each file that grew as one whole object
    (a kill leaves the version of the last flush), beginning a new file once the current one passes EVENT_FILE_BYTES.
    Events still queued in tensorboardX's writer thread at a flush are uploaded at the next one.
    """

    def __init__(self, folder: str, *, purge_step: int | None):
        self.folder = folder
        self.uploaded: dict[str, int] = {}  # event file name -> the size uploaded
        self.local = folder if not storage.is_remote(folder) else tempfile.mkdtemp(prefix="lmzoo-tb-")
        try:
            self.files_begun = len(storage.list_dir(folder))
        except FileNotFoundError:
            self.files_begun = 0
        self.writer = self._begin_file(purge_step)

    def _begin_file(self, purge_step: int | None = None):
        """A writer of a new event file, numbered after every file already in the folder: tensorboardX names a file by
        the second it began, so a run resumed within that second would write into the first run's file; TensorBoard
        reads files in name order, so files of one second keep theirs."""
        self.files_begun += 1
        return event_writer_class()(self.local, purge_step=purge_step, filename_suffix=f".{self.files_begun:06d}")

    def flush(self) -> None:
        self.writer.flush()
        if self.local == self.folder:
            return
        self._upload()
        (current,) = os.listdir(self.local)
        if os.path.getsize(os.path.join(self.local, current)) > EVENT_FILE_BYTES:
            self.writer.close()
            self._upload()
            os.remove(os.path.join(self.local, current))  # in the bucket whole; the local folder keeps the open file
            self.writer = self._begin_file()

    def _upload(self) -> None:
        for name in sorted(os.listdir(self.local)):
            size = os.path.getsize(os.path.join(self.local, name))
            if self.uploaded.get(name) != size:
                with open(os.path.join(self.local, name), "rb") as file:
                    storage.write_bytes(f"{self.folder}/{name}", file.read())
                self.uploaded[name] = size

    def close(self, *, upload: bool) -> None:
        """Closes the writer; for a bucket, uploads what changed (unless `upload` is False: the bucket failed) and
        removes the local folder."""
        self.writer.close()
        if self.local == self.folder:
            return
        try:
            if upload:
                self._upload()
        finally:
            shutil.rmtree(self.local, ignore_errors=True)


class MetricWriter:
    """Writes scalars to TensorBoard (`<workdir>/tb`) and `<workdir>/metrics.jsonl`; process 0 only.

    Every `write` reaches storage before it returns: a row is appended to metrics.jsonl (`storage.append_bytes`: on
    GCS a compose, so a kill leaves the rows written before it, whole) and the event files are flushed (uploaded
    whole, for a bucket workdir: `_EventFiles`).

    resume_step: the step a run resumes from; rows and events of later steps (written after that
    checkpoint by a run that then stopped) are dropped, so every step appears once.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, resume_step: int = 0):
        self.enabled = enabled
        self.failed = False
        if enabled:
            self.jsonl = f"{workdir}/metrics.jsonl"
            rows = storage.read_text(self.jsonl).splitlines(keepends=True) if storage.exists(self.jsonl) else []
            storage.write_text(self.jsonl, "".join(line for line in rows if _row_step(line) <= resume_step))
            self.events = _EventFiles(f"{workdir}/tb", purge_step=resume_step + 1 if resume_step else None)

    def write(self, step: int, scalars: dict[str, float], prefix: str) -> None:
        if not self.enabled:
            return
        for name, value in scalars.items():
            self.events.writer.add_scalar(f"{prefix}/{name}", value, step)
        try:
            storage.append_bytes(self.jsonl, (json.dumps({"step": step, "split": prefix, **scalars}) + "\n").encode())
            self.events.flush()
        except BaseException:
            self.failed = True  # closing does not try the storage that failed again
            raise

    def close(self) -> None:
        if self.enabled:
            self.events.close(upload=not self.failed)
