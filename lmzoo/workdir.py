"""One writer per workdir, and run state that is replaced only by a complete, validated version.

`lock(workdir)` gives a workdir to one run at a time.

A local workdir is locked by an exclusive `fcntl.flock` on `<workdir>/lock`. The OS drops the lock when the
holding process exits or crashes, so a lock is never left behind; the file keeps the holder's pid,
host, command and start time so a second run can name it. A run that ends (finished, stopped or failed)
removes the file; one that is killed or crashes leaves it, and info found in an unlocked file belongs to
that dead holder: it is reported as stale and taken over.

A bucket has no flock, and hosts share no kernel: a workdir on gs:// or s3:// is locked by a lease, the object
`<workdir>/lock` holding the holder's host, pid, command, start time, a random token and the time of its last
heartbeat. The lease rule:
- a run takes the lock by creating the object only if there is none (`storage.create_if_absent`: GCS
  `ifGenerationMatch=0`, S3 `If-None-Match: *`), so of runs starting together one gets it;
- while it runs, a heartbeat thread rewrites the object every HEARTBEAT_SECONDS (10 s), each time only if it is still
  the version this run wrote last (`storage.replace_if_version`: GCS `ifGenerationMatch=<generation>`, S3 `If-Match`);
- another run refuses to start, naming the holder, unless the lock is stale: its last heartbeat is more than
  STALE_SECONDS (60 s = 6 periods) old by the reader's clock, or it names a process of this machine (same boot and
  pid namespace) that is gone. A stale lock is taken over, with a warning, by a conditional replace naming the
  version the taker read: of two takers only one wins, and a holder that renewed in between keeps it;
- a holder whose renewals have failed for GIVE_UP_SECONDS (40 s, the bucket not answering) or whose object was
  replaced loses the lease: `check()`, which the training loop calls before each step's writes, raises
  LeaseLostError, so the run stops before a taker may find its lock stale. A renewal is a request that gives up
  within storage's deadline (`storage.deadline_seconds()`, 30 s by default), and `check()` judges by the time since
  the last renewal that succeeded, not by the renewal thread: one that hangs cannot keep a lease. Two live runs are
  therefore never both let in while the hosts' clocks differ by less than STALE_SECONDS - GIVE_UP_SECONDS (20 s; NTP
  keeps them within milliseconds). A checkpoint save already in flight in the background when the lease is lost is not stopped;
- a run that ends deletes the object (only if it is still its version); a killed one leaves it, to be taken over:
  at once by a rerun on the same machine, after STALE_SECONDS from another.

`StagedRunState` collects the files and folders a run writes at start (config.json, data.json, tokenizer/) before
they are checked, and `commit()` puts them into the workdir only after validation succeeded, so a failed start
leaves the workdir as it was. In a local workdir they are staged in a folder inside it and moved into place by
renames (`storage.replace_local`: flushed to disk first, a folder replaced whole). A bucket has no rename: they are staged in a local temporary folder, and
`commit()` writes each file as one whole object (visible only when complete), the tokenizer's files first and
config.json last. A kill between two objects leaves a mix the next start handles: a tokenizer is written only by
a start that finds no checkpoint, and is read back only with checkpoints, which come after the commit, so a start
killed while committing one leaves a workdir whose next start builds and writes it again; config.json and data.json
are each read whole on their own, and a workdir has config.json only once its tokenizer is there.
"""

import dataclasses
import errno
import fcntl
import json
import logging
import os
import pathlib
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time

from lmzoo import storage

log = logging.getLogger(__name__)

LOCK_NAME = "lock"
STAGING_PREFIX = ".staging-"

HEARTBEAT_SECONDS = 10  # a bucket lock's heartbeat period
STALE_SECONDS = 60  # a bucket lock not renewed for this long may be taken over
GIVE_UP_SECONDS = 40  # a holder that could not renew for this long stops (< STALE_SECONDS: the margin for clocks)
RELEASE_WAIT_SECONDS = 10  # how long a run that ends waits to delete its bucket lock (the bucket may not answer)


class WorkdirLockedError(RuntimeError):
    pass


class LeaseLostError(WorkdirLockedError):
    """A bucket workdir's lock was lost while the run held it: the run must write nothing more there."""


@dataclasses.dataclass(frozen=True)
class HolderInfo:
    """Who holds (or last held) a workdir lock."""

    pid: int
    host: str
    command: str
    started: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}: {self.command}"


def _this_holder() -> HolderInfo:
    return HolderInfo(
        pid=os.getpid(),
        host=socket.gethostname(),
        command=" ".join(sys.argv),
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def _read_holder(file) -> HolderInfo | None:
    file.seek(0)
    text = file.read()
    try:
        return HolderInfo(**json.loads(text))
    except (ValueError, TypeError):
        return None


class WorkdirLock:
    """An exclusive lock on a local workdir, held until `release()` or the process ends."""

    def __init__(self, workdir: str | os.PathLike):
        storage.refuse_bucket_mount(workdir, "--workdir")
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
        self.holder = _this_holder()
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(dataclasses.asdict(self.holder)))
        self._file.flush()
        os.fsync(self._file.fileno())

    def check(self) -> None:
        """Nothing to check: the OS holds a flock for as long as the process lives."""

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

    def __exit__(self, exc_type, *exc) -> None:
        self.release(failed_start=exc_type is not None)  # work that failed leaves the workdir as it found it


def _this_machine() -> str:
    """This boot of this machine and its pid namespace (Linux), so that a lock's pid can be looked up here only
    where it means the same process; "" where that cannot be told."""
    try:
        boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class LeaseLock:
    """The lock of a bucket workdir: a lease kept alive by a heartbeat thread (the rule: this module's docstring)."""

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = os.fspath(storage.path(workdir))
        self.path = f"{self.workdir}/{LOCK_NAME}"
        self.holder = _this_holder()
        self.token = secrets.token_hex(8)
        self.machine = _this_machine()
        self.stale_holder: HolderInfo | None = None
        self._lost: str | None = None  # why this run may no longer write, once it may not
        self._last_error: BaseException | None = None
        self._released = False
        self._version, self._renewed_at = self._take()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._renew_until_released, name="workdir-lease", daemon=True)
        self._heartbeat.start()

    def _record(self) -> bytes:
        """The lock object's content as of now."""
        record = {
            **dataclasses.asdict(self.holder),
            "token": self.token,
            "machine": self.machine,
            "heartbeat": time.time(),
            "heartbeat_every_s": HEARTBEAT_SECONDS,
        }
        return json.dumps(record).encode()

    def _take(self) -> tuple[str, float]:
        """Creates the lock object, or takes over a stale one; (its version, monotonic time its write began)."""
        for _ in range(3):  # the object may be released or taken over while this run looks at it
            began, record = time.monotonic(), self._record()
            if storage.create_if_absent(self.path, record):
                content, version = storage.read_versioned(self.path)
                if content == record:
                    return version, began
                continue
            try:
                content, version = storage.read_versioned(self.path)
            except FileNotFoundError:
                continue
            holder, stale = self._judge(content)
            began = time.monotonic()
            taken = storage.replace_if_version(self.path, self._record(), version)
            if taken is not None:
                log.warning("workdir %s: taking over the lock of %s: %s", self.workdir, holder.describe(), stale)
                self.stale_holder = holder
                return taken, began
        raise WorkdirLockedError(
            f"workdir {self.workdir!r}: its lock object {self.path} kept changing while this run tried to take it; "
            "another run is starting there. Wait for it, or use another --workdir."
        )

    def _judge(self, content: bytes) -> tuple[HolderInfo, str]:
        """(holder, why its lock is stale) of a lock object; raises WorkdirLockedError, naming the holder, if live."""
        try:
            record = json.loads(content)
            holder = HolderInfo(**{field.name: record[field.name] for field in dataclasses.fields(HolderInfo)})
            age = time.time() - float(record["heartbeat"])
        except (ValueError, TypeError, KeyError):
            raise WorkdirLockedError(
                f"workdir {self.workdir!r} has a lock object {self.path} that is not lmzoo's ({content[:80]!r}); "
                "if no run uses this workdir, delete that object, or use another --workdir."
            ) from None
        if self.machine and record.get("machine") == self.machine and not _process_exists(holder.pid):
            return holder, f"its process {holder.pid} on this machine is gone"
        if age > STALE_SECONDS:
            return holder, f"its last heartbeat was {age:.0f} s ago (stale after {STALE_SECONDS} s)"
        raise WorkdirLockedError(
            f"workdir {self.workdir!r} is in use by {holder.describe()} (last heartbeat {max(age, 0):.0f} s ago; "
            f"a lock is stale {STALE_SECONDS} s after its last heartbeat). Wait for that run to finish, stop it, "
            "or use another --workdir."
        )

    def _renew_until_released(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            began = time.monotonic()
            try:
                version = storage.replace_if_version(self.path, self._record(), self._version)
            except Exception as error:  # the bucket did not answer or refused: `check` judges by the time since
                self._last_error = error
                continue
            if version is None:
                self._lost = f"its lock object {self.path} was replaced or deleted by another run that found it stale (or by hand)"
                return
            self._version, self._renewed_at = version, began

    def check(self) -> None:
        """Raises LeaseLostError if this run may no longer write to the workdir (see the lease rule)."""
        silent = time.monotonic() - self._renewed_at
        if self._lost is None and silent > GIVE_UP_SECONDS:
            cause = f": {self._last_error}" if self._last_error else ""
            self._lost = f"its lock could not be renewed for {silent:.0f} s{cause}"
        if self._lost is not None:
            raise LeaseLostError(
                f"workdir {self.workdir!r} is no longer this run's: {self._lost}. Training stopped before writing "
                "more there; the checkpoints saved so far are kept. Rerun the same command to resume."
            )

    def release(self, *, failed_start: bool = False) -> None:
        """Stops the heartbeat and deletes the lock object if it is still this run's, waiting at most
        RELEASE_WAIT_SECONDS for the bucket (a lock left behind is taken over as stale). `failed_start`: a bucket
        workdir has no folders to remove, so there is nothing more to undo."""
        if self._released:
            return
        self._released = True
        self._stop.set()

        def delete_own_lock():
            self._heartbeat.join()  # a renewal in flight changes the version to delete
            if self._lost is None:
                try:
                    storage.delete_if_version(self.path, self._version)
                except Exception as error:  # no answer (or the client closed at exit): the next run takes it over
                    log.info("workdir %s: its lock object could not be deleted: %s", self.workdir, error)

        deleting = threading.Thread(target=delete_own_lock, name="workdir-lease-release", daemon=True)
        deleting.start()
        # A bucket an operation gave up on is not waited for: the error that stops the run names it already.
        unanswered = storage.gave_up(self.path)
        deleting.join(0 if unanswered else RELEASE_WAIT_SECONDS)
        if deleting.is_alive():
            (log.info if unanswered else log.warning)(
                "workdir %s: its lock object %s could not be deleted within %d s (the bucket does not answer); the "
                "next run takes it over",
                self.workdir,
                self.path,
                0 if unanswered else RELEASE_WAIT_SECONDS,
            )

    def __enter__(self) -> "LeaseLock":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.release(failed_start=exc_type is not None)


def lock(workdir: str | os.PathLike) -> WorkdirLock | LeaseLock:
    """Takes `workdir`'s lock (a flock on a local workdir, a lease on a bucket) or raises WorkdirLockedError naming
    the run that holds it."""
    return LeaseLock(workdir) if storage.is_remote(workdir) else WorkdirLock(workdir)


class StagedRunState:
    """Run-state files and folders staged before they are checked and put into the workdir by `commit()` (renamed
    into a local workdir, written as whole objects to a bucket: the module docstring says why each is safe).

    Usage: `stage.path("tokenizer")` is a local folder to write the tokenizer into; `stage.write_text("config.json",
    text)`; after every check passed, `stage.commit()`; on failure `stage.discard()` (or leave the `with`
    block by an exception) and the workdir is unchanged.
    """

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = os.fspath(storage.path(workdir))
        if storage.is_remote(self.workdir):
            self.root = pathlib.Path(tempfile.mkdtemp(prefix="lmzoo-run-state-"))
        else:
            self.root = pathlib.Path(self.workdir) / f"{STAGING_PREFIX}{os.getpid()}"
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True)

    def path(self, name: str) -> pathlib.Path:
        """The staging location of `<workdir>/<name>` (a local file or folder the caller creates)."""
        return self.root / name

    def write_text(self, name: str, text: str) -> None:
        self.path(name).write_text(text, encoding="utf-8")

    def write_folder(self, name: str, write) -> None:
        """Stages the folder `<workdir>/<name>`: `write(local_folder)` fills a new, empty local folder."""
        folder = self.path(name)
        folder.mkdir()
        write(str(folder))

    def commit(self) -> list[str]:
        """Puts every staged entry in place of its workdir counterpart; returns the names committed."""
        names = sorted(p.name for p in self.root.iterdir())
        if storage.is_remote(self.workdir):
            self._write_objects(names)
        else:
            for name in names:
                storage.replace_local(self.root / name, pathlib.Path(self.workdir) / name)
        self.discard()
        return names

    def _write_objects(self, names: list[str]) -> None:
        """Each staged file as one whole object: folders first (objects of the folder that the new one lacks are
        deleted after), then files, config.json last."""
        folders = [name for name in names if (self.root / name).is_dir()]
        files = sorted((name for name in names if name not in folders), key=lambda name: name == "config.json")
        for folder in folders:
            staged = sorted(p.relative_to(self.root / folder) for p in (self.root / folder).rglob("*") if p.is_file())
            for relative in staged:
                storage.write_bytes(f"{self.workdir}/{folder}/{relative}", (self.root / folder / relative).read_bytes())
            try:
                previous = storage.list_dir(f"{self.workdir}/{folder}")
            except FileNotFoundError:
                previous = []
            kept = {relative.parts[0] for relative in staged}
            for name in previous:
                if name not in kept:
                    storage.delete(f"{self.workdir}/{folder}/{name}")
        for name in files:
            storage.write_bytes(f"{self.workdir}/{name}", (self.root / name).read_bytes())

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "StagedRunState":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.discard()


def remove_leftovers(workdir: str | os.PathLike) -> list[str]:
    """Removes what a crashed run left half-written in `workdir` (staging folders, folders renamed aside, temporary
    files and objects of unfinished writes); call it holding the lock."""
    removed = storage.remove_unfinished(workdir)
    if storage.is_remote(workdir):
        return removed
    root = pathlib.Path(workdir)
    leftovers = [p for p in root.glob(".*") if p.name.startswith(STAGING_PREFIX) or storage.ASIDE_MARK in p.name]
    for p in leftovers:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return sorted(removed + [p.name for p in leftovers])
