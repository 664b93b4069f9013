"""One writer per workdir, and run state that is replaced only by a complete, validated version.

`lock(workdir)` takes an exclusive `fcntl.flock` on `<workdir>/lock`. The OS drops the lock when the
holding process exits or crashes, so a lock is never left behind; the file keeps the holder's pid,
host, command and start time so a second run can name it. A run that ends (finished, stopped or failed)
removes the file; one that is killed or crashes leaves it, and info found in an unlocked file belongs to
that dead holder: it is reported as stale and taken over.

`StagedRunState` collects the files and folders a run writes at start (config.json, tokenizer/) in a
staging folder inside the workdir; `commit()` moves them into place only after validation succeeded,
so a failed start leaves the workdir as it was and a half-written folder never appears.
"""

import dataclasses
import errno
import fcntl
import json
import logging
import os
import pathlib
import shutil
import socket
import sys
import time

log = logging.getLogger(__name__)

LOCK_NAME = "lock"
STAGING_PREFIX = ".staging-"


class WorkdirLockedError(RuntimeError):
    pass


def _fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: pathlib.Path) -> None:
    for path in sorted(root.rglob("*")):
        _fsync_path(path)
    _fsync_path(root)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Writes `text` to a temp sibling, fsyncs it and renames it over `path`: readers see the old or the new file."""
    path = pathlib.Path(path)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    _fsync_path(path.parent)


def replace_directory(staged: str | os.PathLike, target: str | os.PathLike) -> None:
    """Moves the complete folder `staged` to `target`, replacing any folder there.

    rename(2) cannot replace a non-empty folder, so an old `target` is first renamed aside and removed
    after the new one is in place: `target` is always either the old or the new folder, never a mix.
    """
    staged, target = pathlib.Path(staged), pathlib.Path(target)
    _fsync_tree(staged)
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(staged, target)
    _fsync_path(target.parent)
    shutil.rmtree(old, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class HolderInfo:
    """Who holds (or last held) a workdir lock."""

    pid: int
    host: str
    command: str
    started: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}: {self.command}"


def _read_holder(file) -> HolderInfo | None:
    file.seek(0)
    text = file.read()
    try:
        return HolderInfo(**json.loads(text))
    except (ValueError, TypeError):
        return None


class WorkdirLock:
    """An exclusive lock on a workdir, held until `release()` or the process ends."""

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = pathlib.Path(workdir)
        self.path = self.workdir / LOCK_NAME
        self.created_workdir = not self.workdir.exists()
        if self.workdir.exists() and not self.workdir.is_dir():
            raise NotADirectoryError(f"workdir {self.workdir} is a file, not a directory; pass --workdir=a folder")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.entries_before = {p.name for p in self.workdir.iterdir()}
        while True:
            self._file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held open for the lock's lifetime)
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(self._file)
                self._file.close()
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                who = holder.describe() if holder else "another process (no holder info yet)"
                raise WorkdirLockedError(
                    f"workdir {str(self.workdir)!r} is in use by {who}. Wait for that run to finish, stop it, "
                    "or use another --workdir."
                ) from None
            if self.path.exists() and os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino:
                break
            self._file.close()  # a failed start removed this file after we opened it: lock the current one
        stale = _read_holder(self._file)
        if stale is not None:
            log.warning(
                "workdir %s: stale lock info of a run that is gone (%s); taking it over",
                self.path.parent,
                stale.describe(),
            )
        self.stale_holder = stale
        self.holder = HolderInfo(
            pid=os.getpid(),
            host=socket.gethostname(),
            command=" ".join(sys.argv),
            started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(dataclasses.asdict(self.holder)))
        self._file.flush()
        os.fsync(self._file.fileno())

    def release(self, *, failed_start: bool = False) -> None:
        """Removes the lock file and drops the lock, so a run that ended leaves no lock file (a killed one
        leaves its holder info, reported as stale by the next run).

        failed_start: the run stopped before changing the workdir; what starting added (empty folders such as
        checkpoints/, the workdir itself if it was created) is removed too, so the workdir is as it was.
        """
        if self._file.closed:
            return
        # Removed while still held, and only if the path is still this lock's file: a run waiting on it re-checks,
        # once it holds it, that it is the path's file, and a newer run's file at the path is left alone.
        if self.path.exists() and os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino:
            self.path.unlink()
        if failed_start:
            for entry in self.workdir.iterdir():
                if entry.name not in self.entries_before and entry.is_dir() and not any(entry.iterdir()):
                    entry.rmdir()
            if self.created_workdir and not any(self.workdir.iterdir()):
                self.workdir.rmdir()
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()

    def __enter__(self) -> "WorkdirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock(workdir: str | os.PathLike) -> WorkdirLock:
    """Takes `workdir`'s exclusive lock or raises WorkdirLockedError naming the process that holds it."""
    return WorkdirLock(workdir)


class StagedRunState:
    """Run-state files and folders staged in `<workdir>/.staging-<pid>/`, moved into the workdir by `commit()`.

    Usage: `stage.path("tokenizer")` is a folder to write the tokenizer into; `stage.write_text("config.json",
    text)`; after every check passed, `stage.commit()`; on failure `stage.discard()` (or leave the `with`
    block by an exception) and the workdir is unchanged.
    """

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = pathlib.Path(workdir)
        self.root = self.workdir / f"{STAGING_PREFIX}{os.getpid()}"
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)

    def path(self, name: str) -> pathlib.Path:
        """The staging location of `<workdir>/<name>` (a file or folder the caller creates)."""
        return self.root / name

    def write_text(self, name: str, text: str) -> None:
        self.path(name).write_text(text, encoding="utf-8")

    def commit(self) -> list[str]:
        """Moves every staged entry over its workdir counterpart; returns the names moved."""
        names = sorted(p.name for p in self.root.iterdir())
        for name in names:
            staged, target = self.root / name, self.workdir / name
            if staged.is_dir():
                replace_directory(staged, target)
            else:
                _fsync_path(staged)
                os.replace(staged, target)
        _fsync_path(self.workdir)
        self.discard()
        return names

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "StagedRunState":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.discard()


def remove_leftovers(workdir: str | os.PathLike) -> list[str]:
    """Removes staging folders and temp files a crashed run left in `workdir`; call it holding the lock."""
    root = pathlib.Path(workdir)
    leftovers = [
        p for p in root.glob(".*") if p.name.startswith(STAGING_PREFIX) or ".tmp-" in p.name or ".old-" in p.name
    ]
    for p in leftovers:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return sorted(p.name for p in leftovers)
