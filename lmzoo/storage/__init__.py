"""One path layer for every path a user gives lmzoo: local paths, `gs://` (Google Cloud Storage) and `s3://`
(Amazon S3 and S3-compatible stores).

`path(user_path)` turns what the user typed into an `etils.epath.Path`, the path type orbax takes, so the same object
can go into a checkpoint manager. The functions below read and write through it with the guarantees lmzoo relies on:
- `write_bytes` / `write_text` replace a file or object whole: a reader sees the old content or the new, never a part
  (local: a temporary file in the same folder, flushed to disk and renamed over it, `replace_local`, which also puts a
  local file or folder staged elsewhere in place; bucket: one upload, which the store makes visible only once it is
  complete);
- `create_if_absent` creates a file or object only where there is none, atomically against every other writer
  (local: `O_CREAT | O_EXCL`; GCS: an upload with the precondition `ifGenerationMatch=0`; S3: a conditional put,
  `If-None-Match: *`) and says whether this call created it: the primitive of a one-writer lock;
- `read_range` reads `length` bytes at `offset` (one ranged GET on a bucket) without fetching the whole object;
- `append_bytes` adds to the end of a file or object (GCS: a temporary object composed onto it; S3: the object
  replaced by one with the bytes added);
- on a bucket, `read_versioned`, `replace_if_version` and `delete_if_version` read an object with its version (GCS: its
  generation; S3: its ETag) and replace or delete it only while it still has that version (GCS: `ifGenerationMatch`;
  S3: `If-Match`): with `create_if_absent`, the primitives of a lease (lmzoo.workdir's lock on a bucket).

A bucket whose server does not answer (connection refused or dropped, a timeout, a server error after the client's own
retries) raises BucketUnreachableError, an OSError naming the path, from every function. Every wait on a bucket has a
deadline (`deadline_seconds()`: 30 s, or LMZOO_STORAGE_DEADLINE_S): each request times out after
`request_timeout_seconds()` without an answer (connecting, or reading: no byte for that long), and an operation retries
only while a retry can still end within the deadline. Once an operation gave up, the server is taken for down: later
operations on it try once, without retries, until one is answered (`gave_up`, `answers`).

How lmzoo talks to a bucket's server (its clients, their deadlines and retries, and the errors above) is
`lmzoo.storage.clients`; this module is the path layer and the file API over it.
"""

import contextlib
import functools
import gzip
import io
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from etils import epath

from lmzoo.storage import clients
from lmzoo.storage.clients import CONCURRENT_REQUESTS, BucketUnreachableError, deadline_seconds, request_timeout_seconds

# The bucket errors and the deadline are this module's API too: callers catch and set them as `storage.X`.
from lmzoo.storage.clients import DEADLINE_VARIABLE as DEADLINE_VARIABLE
from lmzoo.storage.clients import DEFAULT_DEADLINE_SECONDS as DEFAULT_DEADLINE_SECONDS
from lmzoo.storage.clients import BucketCredentialsError as BucketCredentialsError
from lmzoo.storage.clients import BucketNotFoundError as BucketNotFoundError

REMOTE_SCHEMES = ("gs://", "s3://")

S3_MIN_PART_BYTES = 5 * 2**20  # S3's smallest part of a multipart upload, but for the last


# Temporary files and objects of `write_bytes` and `append_bytes` (".NAME.<12 hex digits>.tmp"): being written, or
# left by a killed writer.
_TEMPORARY_NAME = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")


def is_remote(user_path: str | os.PathLike) -> bool:
    """Whether `user_path` names an object in a bucket (gs:// or s3://) rather than a local file."""
    return os.fspath(user_path).startswith(REMOTE_SCHEMES)


def path(user_path: str | os.PathLike) -> epath.Path:
    """The path a user typed: a bucket path as it is, a local one with `~` expanded and made absolute.

    Raises ValueError for a scheme other than gs:// and s3://, and for a bucket path that names no bucket.
    """
    text = os.fspath(user_path)
    if is_remote(text):
        scheme, rest = text.split("://", 1)
        if not rest.split("/", 1)[0]:
            raise ValueError(f"{text!r} names no bucket: write {scheme}://BUCKET/PATH")
        if scheme == "gs":
            clients.share_gcs_emulator()
        clients.bound_other_clients()
        return epath.Path(text)
    if "://" in text:
        raise ValueError(f"{text!r}: lmzoo reads and writes local paths, gs://BUCKET/PATH and s3://BUCKET/PATH only")
    return epath.Path(os.path.abspath(os.path.expanduser(text)))


# FUSE file systems that present a bucket as a folder (/proc/mounts type -> scheme): their folder renames are
# refused or are copies, and a flock there is not shared between hosts, so lmzoo refuses them for what it writes.
BUCKET_MOUNTS = {"fuse.gcsfuse": "gs", "fuse.s3fs": "s3", "fuse.mountpoint-s3": "s3", "fuse.goofys": "s3"}


MOUNTS_FILE = "/proc/mounts"


def bucket_mount(local_path: str | os.PathLike, mounts: str | None = None) -> str | None:
    """The gs:// or s3:// form of a local path that lies on a FUSE mount of a bucket (gcsfuse, s3fs, mountpoint-s3,
    goofys), or None where it does not; `mounts` is /proc/mounts' text (read when not given; none on non-Linux)."""
    if mounts is None:
        try:
            with open(MOUNTS_FILE, encoding="utf-8") as file:
                mounts = file.read()
        except OSError:
            return None
    location = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(local_path))))
    best = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        # /proc/mounts escapes spaces and other separators in paths as octal (\040).
        device, point = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f) for f in fields[:2])
        if (location + "/").startswith(point.rstrip("/") + "/") and (best is None or len(point) > len(best[1])):
            best = (device, point, fields[2])
    if best is None or best[2] not in BUCKET_MOUNTS:
        return None
    device, point, kind = best
    # gcsfuse lists the bucket as the device; s3fs may list "s3fs" or "s3fs:BUCKET", goofys "BUCKET" or "BUCKET:PREFIX".
    bucket = device.removeprefix("s3fs:").split(":", 1)[0]
    bucket = "BUCKET" if bucket == "s3fs" else bucket
    relative = os.path.relpath(location, point)
    suffix = "" if relative == "." else "/" + relative
    return f"{BUCKET_MOUNTS[kind]}://{bucket}{suffix}"


def refuse_bucket_mount(local_path: str | os.PathLike, flag: str) -> None:
    """Raises ValueError, naming the gs:// or s3:// form to pass instead, where `local_path` (what `flag` gave) lies on
    a FUSE mount of a bucket."""
    if is_remote(local_path):
        return
    remote = bucket_mount(local_path)
    if remote is not None:
        raise ValueError(
            f"{flag}={os.fspath(local_path)} is on a FUSE mount of a bucket, which renames folders by copying (or not "
            f"at all) and shares no lock between hosts; pass {flag}={remote} instead (lmzoo writes buckets directly)"
        )


def read_bytes(user_path: str | os.PathLike) -> bytes:
    """The whole content of a file or object; FileNotFoundError if there is none."""
    location = os.fspath(path(user_path))
    if is_remote(location):
        with clients.unreachable_named(location):
            return clients.client_for(location).cat_file(location)
    with open(location, "rb") as file:
        return file.read()


@contextlib.contextmanager
def open_read(user_path: str | os.PathLike, *, text: bool = False) -> Iterator:
    """A file or object opened to be read as a stream (on a bucket: ranged reads with read-ahead, never the whole
    object at once), gunzipped when its name ends in .gz; `text`: decoded as UTF-8 (decode errors raise).
    FileNotFoundError if there is none; IsADirectoryError for a local folder."""
    location = os.fspath(path(user_path))
    with contextlib.ExitStack() as stack:
        if is_remote(location):
            with clients.unreachable_named(location):
                stream = stack.enter_context(clients.client_for(location).open(location, "rb"))
        else:
            stream = stack.enter_context(open(location, "rb"))
        if location.endswith(".gz"):
            stream = stack.enter_context(gzip.GzipFile(fileobj=stream, mode="rb"))
        if text:
            stream = stack.enter_context(io.TextIOWrapper(stream, encoding="utf-8"))
        with clients.unreachable_named(location):
            yield stream


def read_text(user_path: str | os.PathLike) -> str:
    """`read_bytes` decoded as UTF-8."""
    return read_bytes(user_path).decode("utf-8")


def read_range(user_path: str | os.PathLike, offset: int, length: int) -> bytes:
    """Exactly `length` bytes starting at byte `offset` (a length of 0 returns b"" without touching storage).

    Raises EOFError when the file or object ends before `offset + length`, FileNotFoundError when there is none.
    """
    if offset < 0 or length < 0:
        raise ValueError(f"offset and length must be >= 0, got offset={offset}, length={length}")
    if length == 0:
        return b""
    location = os.fspath(path(user_path))
    if is_remote(location):
        filesystem = clients.client_for(location)
        with clients.unreachable_named(location):
            try:
                data = filesystem.cat_file(location, start=offset, end=offset + length)
            except FileNotFoundError:
                raise
            except Exception:
                # A range that starts past the end is refused by the server ("416 Range Not Satisfiable"), which gcsfs
                # and s3fs raise as different errors; the size tells that case apart from a real failure.
                if offset >= filesystem.size(location):
                    data = b""
                else:
                    raise
    else:
        with open(location, "rb") as file:
            file.seek(offset)
            data = file.read(length)
    if len(data) != length:
        raise EOFError(
            f"{location}: {length} bytes at offset {offset} were asked for, but it ends after {offset + len(data)}"
        )
    return data


def write_bytes(user_path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` as the whole content of a file or object, replacing any previous one at once: a reader, or a
    process that reads after this one was killed, finds the old content or the new, never part of either.

    Local folders are created as needed. On a bucket this is one upload: a single request up to gcsfs's and s3fs's
    multipart thresholds (50 MiB, 100 MiB), a resumable or multipart upload above them, which the store also makes
    visible only when it completes.
    """
    location = os.fspath(path(user_path))
    if is_remote(location):
        with clients.unreachable_named(location):
            clients.client_for(location).pipe_file(location, data)
        return

    def fill(temporary: str) -> None:
        with open(temporary, "xb") as file:
            file.write(data)

    _write_local(location, fill)


def write_text(user_path: str | os.PathLike, text: str) -> None:
    """`write_bytes` of `text` encoded as UTF-8."""
    write_bytes(user_path, text.encode("utf-8"))


# A folder `replace_local` renamed aside holds this in its name (".NAME.old-PID") until it is deleted; one a crash left
# behind is the caller's to remove (lmzoo.workdir.remove_leftovers).
ASIDE_MARK = ".old-"


def replace_local(staged: str | os.PathLike, location: str | os.PathLike) -> None:
    """Puts the complete local file or folder `staged` in place of `location`, on the same file system (beside it, or
    in a staging folder next to it): `staged` is flushed to disk (a folder with everything in it), renamed to
    `location`, and the folder's entry flushed too. A reader, or a process that reads after a crash, finds at
    `location` the old content or all of the new, never part of either.

    rename(2) replaces a file in one step but not a non-empty folder: an old folder at `location` is first renamed aside
    (".NAME.old-PID", `ASIDE_MARK`) and deleted once the new one is in place, so `location` is always either the old
    folder or the new one, never a mix."""
    staged, location = os.fspath(staged), os.path.abspath(location)
    folder = os.path.dirname(location)
    aside = None
    if os.path.isdir(staged):
        _fsync_tree(staged)
        if os.path.exists(location):
            aside = os.path.join(folder, f".{os.path.basename(location)}{ASIDE_MARK}{os.getpid()}")
            os.replace(location, aside)
    else:
        _fsync(staged)
    os.replace(staged, location)
    _fsync(folder)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _write_local(location: str, fill: Callable[[str], None]) -> None:
    """`fill(temporary)` writes a new temporary file beside `location` (".NAME.<12 hex digits>.tmp", which listings
    leave out), which then replaces it (`replace_local`); local folders are created as needed. The temporary file is
    removed if anything fails."""
    os.makedirs(os.path.dirname(location), exist_ok=True)
    temporary = _temporary_name(location)
    try:
        fill(temporary)
        replace_local(temporary, location)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise


def _fsync(location: str) -> None:
    """Flushes a local file's content, or a folder's entries, to disk."""
    descriptor = os.open(location, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(folder: str) -> None:
    """`_fsync` of every file and folder below `folder`, and of `folder` itself."""
    for parent, folders, files in os.walk(folder, topdown=False):
        for name in [*files, *folders]:
            _fsync(os.path.join(parent, name))
    _fsync(folder)


def create_if_absent(user_path: str | os.PathLike, data: bytes) -> bool:
    """Creates a file or object holding `data` if there is none at `user_path`; returns True if this call created it,
    or if what is there already holds exactly `data`.

    Of any number of processes or hosts calling this at once on the same path with different `data`, exactly one gets
    True. `data` should therefore be unique to the caller (a holder id and a random token): then True also covers a
    bucket client that retried an upload whose first attempt succeeded but whose answer was lost, and was refused by
    its own object. A local file's content is written just after it is created, so a reader may briefly find it empty
    (which is why `data` must not be empty: a loser would take that for its own).
    """
    if not data:
        raise ValueError("create_if_absent needs non-empty data, unique to the caller")
    location = os.fspath(path(user_path))
    try:
        if is_remote(location):
            with clients.unreachable_named(location):
                clients.client_for(location).pipe_file(location, data, mode="create")
        else:
            _create_local_file(location, data)
    except FileExistsError:
        try:
            return read_bytes(location) == data
        except FileNotFoundError:  # another writer created it and has removed it already
            return False
    return True


def _create_local_file(location: str, data: bytes) -> None:
    """Writes `data` to a new file; FileExistsError, atomically, if one is there (O_EXCL)."""
    os.makedirs(os.path.dirname(location), exist_ok=True)
    descriptor = os.open(location, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        os.remove(location)  # a file this call could not fill must not stand as anyone's claim
        raise


def exists(user_path: str | os.PathLike) -> bool:
    """Whether a file, a folder, or (on a bucket) an object or a prefix of objects is at `user_path`; a bucket that
    does not exist raises BucketNotFoundError (a FileNotFoundError) naming it."""
    location = os.fspath(path(user_path))
    if is_remote(location):
        with clients.unreachable_named(location):
            if clients.client_for(location).exists(location):
                return True
        clients.refuse_missing_bucket(location)
        return False
    return os.path.exists(location)


def is_file(user_path: str | os.PathLike) -> bool:
    """Whether a file (on a bucket: an object, not a prefix of objects) is at `user_path`."""
    location = os.fspath(path(user_path))
    if is_remote(location):
        with clients.unreachable_named(location):
            return clients.client_for(location).isfile(location)
    return os.path.isfile(location)


def list_dir(user_path: str | os.PathLike) -> list[str]:
    """The sorted names of the files and folders directly in a folder (on a bucket: the objects and prefixes one level
    below it). Temporary files of unfinished writes are left out. FileNotFoundError if there is nothing there."""
    location = os.fspath(path(user_path))
    if is_remote(location):
        folder = location.split("://", 1)[1].rstrip("/")
        with clients.unreachable_named(location):
            entries = [entry.rstrip("/") for entry in clients.client_for(location).ls(location, detail=False)]
        # A listing can include the folder itself: a placeholder object "folder/" some tools write, or the one object.
        names = [entry.rsplit("/", 1)[-1] for entry in entries if entry != folder]
    else:
        names = os.listdir(location)
    return sorted(name for name in names if not _TEMPORARY_NAME.match(name))


def stat(user_path: str | os.PathLike) -> tuple[int, int | str]:
    """(size in bytes, version) of a file or object: the version changes whenever the content is replaced (local: the
    modification time in ns; GCS: the generation; S3: the ETag). FileNotFoundError if there is none."""
    location = os.fspath(path(user_path))
    if is_remote(location):
        with clients.unreachable_named(location):
            info = clients.client_for(location).info(location)
        if info.get("type") != "file":
            raise FileNotFoundError(f"{location}: no such object (a folder of objects)")
        return int(info["size"]), clients.version(info)
    status = os.stat(location)
    return status.st_size, status.st_mtime_ns


def find_files(user_path: str | os.PathLike) -> list[epath.Path]:
    """`user_path` itself when it is a file or object, else every file below the folder (on a bucket: every object
    below the prefix), sorted; temporary files of unfinished writes left out. FileNotFoundError if there is nothing
    there (an empty local folder gives [])."""
    location = os.fspath(path(user_path))
    if is_remote(location):
        filesystem, scheme = clients.client_for(location), location.split("://", 1)[0]
        with clients.unreachable_named(location):
            if filesystem.isfile(location):
                return [epath.Path(location)]
            keys = filesystem.find(location)
        if not keys:
            raise FileNotFoundError(f"{location}: no such object or prefix")
        found = [epath.Path(f"{scheme}://{key}") for key in keys]
    elif os.path.isfile(location):
        return [epath.Path(location)]
    elif os.path.isdir(location):
        found = [epath.Path(os.path.join(folder, name)) for folder, _, names in os.walk(location) for name in names]
    else:
        raise FileNotFoundError(f"{location}: no such file or folder")
    return sorted((file for file in found if not _TEMPORARY_NAME.match(file.name)), key=os.fspath)


def read_only(user_path: str | os.PathLike) -> bool:
    """Whether `user_path` is a local folder this process may not write in (a bucket's permissions show only when
    written to: False)."""
    location = os.fspath(path(user_path))
    return not is_remote(location) and os.path.isdir(location) and not os.access(location, os.W_OK)


def file_sizes(user_path: str | os.PathLike) -> dict[str, tuple[int, str]]:
    """{name: (size in bytes, version)} of the files directly in a folder (on a bucket: the objects one level below
    it), in one listing; the version changes whenever the content is replaced (GCS: the generation; S3: the ETag;
    local: the modification time and inode). Temporary files of unfinished writes are left out; {} if there is
    nothing there."""
    location = os.fspath(path(user_path))
    found = {}
    if is_remote(location):
        with clients.unreachable_named(location):
            try:
                entries = clients.client_for(location).ls(location, detail=True)
            except FileNotFoundError:
                return {}
        for info in entries:
            if info.get("type") == "file":
                found[info["name"].rstrip("/").rsplit("/", 1)[-1]] = (int(info["size"]), clients.version(info))
    elif os.path.isdir(location):
        for entry in os.scandir(location):
            if entry.is_file():
                status = entry.stat()
                found[entry.name] = (status.st_size, f"{status.st_mtime_ns}-{status.st_ino}")
    return {name: value for name, value in found.items() if not _TEMPORARY_NAME.match(name)}


def upload(local_file: str | os.PathLike, user_path: str | os.PathLike) -> None:
    """Copies a local file to `user_path` as a whole: on a bucket one upload (streamed from the file, made visible
    by the store only when complete); locally a `write_bytes`-style replace through a temporary file."""
    location = os.fspath(path(user_path))
    if is_remote(location):
        with clients.unreachable_named(location):
            clients.client_for(location).put_file(os.fspath(local_file), location)
        return
    _write_local(location, lambda temporary: shutil.copyfile(local_file, temporary))


def read_ranges(user_path: str | os.PathLike, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of each (offset, length) range of one file or object (`read_ranges_of`)."""
    return read_ranges_of([(user_path, offset, length) for offset, length in ranges])


def read_ranges_of(requests: list[tuple[str | os.PathLike, int, int]]) -> list[bytes]:
    """The bytes of each (path, offset, length) request, of one or several files or objects; on a bucket the ranged
    GETs go out together (fsspec's concurrent `cat_ranges`, up to CONCURRENT_REQUESTS at once), so many small reads,
    of many objects, cost about one round trip. EOFError where a file or object ends before its range does."""
    # Checked and resolved once per file or object, not per range: a step reads hundreds of ranges of a few shards.
    resolved = {where: os.fspath(path(where)) for where in {os.fspath(where) for where, _, _ in requests}}
    locations = [resolved[os.fspath(where)] for where, _, _ in requests]
    parts: list[bytes] = [b""] * len(requests)
    remote = [i for i, location in enumerate(locations) if is_remote(location)]
    for scheme in {locations[i].split("://", 1)[0] for i in remote}:
        mine = [i for i in remote if locations[i].startswith(scheme + "://")]
        if scheme == "gs":
            fetched = _gcs_ranges([(locations[i], requests[i][1], requests[i][2]) for i in mine])
        else:
            with clients.unreachable_named(
                locations[mine[0]] if len(mine) == 1 else f"{scheme}:// ({len(mine)} ranges)"
            ):
                fetched = clients.client_for(locations[mine[0]]).cat_ranges(
                    [locations[i] for i in mine],
                    [requests[i][1] for i in mine],
                    [requests[i][1] + requests[i][2] for i in mine],
                    on_error="raise",
                    batch_size=CONCURRENT_REQUESTS,
                )
        for i, part in zip(mine, fetched, strict=True):
            parts[i] = part
    for i, location in enumerate(locations):
        if not is_remote(location):
            with open(location, "rb") as file:
                parts[i] = os.pread(file.fileno(), requests[i][2], requests[i][1])
    for location, (_, offset, length), part in zip(locations, requests, parts, strict=True):
        if len(part) != length:
            raise EOFError(f"{location}: {length} bytes at offset {offset} were asked for, it ends before that")
    return parts


def _gcs_ranges(requests: list[tuple[str, int, int]]) -> list[bytes]:
    """Ranged reads of GCS objects through tensorstore's GCS kvstore (what orbax writes arrays with): a C++ client,
    cheaper per request than gcsfs, for the hundreds of small ranges a training step reads."""
    futures, emulator_url = [], clients.gcs_emulator_url()
    for location, offset, length in requests:
        bucket, key = location.removeprefix("gs://").split("/", 1)
        futures.append(_gcs_kvstore(bucket, emulator_url).read(key, byte_range=slice(offset, offset + length)))
    parts, deadline = [], deadline_seconds()
    answered = time.monotonic()  # the deadline runs from the last read that finished: a long batch may take longer
    for (location, offset, length), future in zip(requests, futures, strict=True):
        try:
            result = future.result(timeout=max(0.0, answered + deadline - time.monotonic()))
        except TimeoutError:
            give_up_on(location)
            raise BucketUnreachableError(
                f"{location}: the bucket's server did not answer (no read finished for {deadline:g} s)"
            ) from None
        except ValueError as error:  # tensorstore's status errors
            if "OUT_OF_RANGE" in str(error):
                raise EOFError(
                    f"{location}: {length} bytes at offset {offset} were asked for, it ends before that"
                ) from None
            give_up_on(location)
            raise BucketUnreachableError(
                f"{location}: the bucket's server did not answer ({_first_line(error)})"
            ) from None
        if result.state == "missing":
            raise FileNotFoundError(f"{location}: no such object")
        parts.append(bytes(result.value))
        answered = time.monotonic()
    return parts


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0][:300] if str(error) else type(error).__name__


@functools.cache
def _gcs_kvstore(bucket: str, emulator_url: str | None):
    """tensorstore's kvstore of a GCS bucket (STORAGE_EMULATOR_HOST's server when set, through
    TENSORSTORE_GCS_HTTP_URL), with CONCURRENT_REQUESTS requests in flight and gcsfs's patience with a server that
    does not answer (a few retries, then an error)."""
    import tensorstore as ts

    clients.share_gcs_emulator()
    context = ts.Context(
        {
            "gcs_request_concurrency": {"limit": CONCURRENT_REQUESTS},
            "gcs_request_retries": {"max_retries": 6, "initial_delay": "0.5s", "max_delay": "8s"},
        }
    )
    return ts.KvStore.open({"driver": "gcs", "bucket": bucket}, context=context).result()


# tensorstore's retries of a request to a bucket, for the kvstore specs lmzoo builds (its defaults: 32 retries, delays
# up to 32 s): 4 retries, 15 s of delays in all.
TENSORSTORE_RETRIES = {"max_retries": 4, "initial_delay": "1s", "max_delay": "8s"}


def tensorstore_s3_kvstore(location: str) -> dict[str, Any]:
    """tensorstore's kvstore spec of an s3:// location, pointed where s3fs is: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL
    when set, in AWS_REGION or AWS_DEFAULT_REGION (us-east-1 if neither); credentials from tensorstore's AWS chain
    (environment, ~/.aws files, instance metadata)."""
    bucket, _, key = location.removeprefix("s3://").partition("/")
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key, "s3_request_retries": TENSORSTORE_RETRIES}
    spec["aws_region"] = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    return spec


def delete(user_path: str | os.PathLike) -> None:
    """Deletes the file or object at `user_path`; one that is not there is no error (S3 itself does not tell)."""
    location = os.fspath(path(user_path))
    with contextlib.suppress(FileNotFoundError):
        if is_remote(location):
            with clients.unreachable_named(location):
                clients.client_for(location).rm_file(location)
        else:
            os.remove(location)


def delete_tree(user_path: str | os.PathLike, *, keep_folder: bool = False) -> None:
    """Deletes a folder and everything under it (on a bucket: every object below the prefix); with `keep_folder`, a
    local folder itself stays, emptied. Nothing there is no error."""
    location = os.fspath(path(user_path))
    if is_remote(location):
        with clients.unreachable_named(location), contextlib.suppress(FileNotFoundError):
            clients.client_for(location).rm(location, recursive=True)
        return
    if not os.path.isdir(location):
        return
    if not keep_folder:
        shutil.rmtree(location)
        return
    for entry in os.scandir(location):
        shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.remove(entry.path)


def append_bytes(user_path: str | os.PathLike, data: bytes) -> None:
    """Adds `data` at the end of an existing file or object (`write_bytes` creates one); FileNotFoundError if there is
    none (fake-gcs-server answers that compose with 500, which gcsfs retries for 30 s: create the object first).

    On GCS a reader, or a process that reads after this one was killed, finds the content as it was or followed by all
    of `data`: `data` is uploaded as a temporary object beside it and composed onto it, one server-side request (the
    temporary object is deleted then, or by `remove_unfinished` where the writer was killed before). A local file is
    one append write, which a kill can cut short: readers of line files drop an unfinished last line. S3 has no append:
    `_s3_append` replaces the object with content + `data` in one request that either happens whole or not at all.
    """
    location = os.fspath(path(user_path))
    if location.startswith("s3://"):
        _s3_append(location, data)
        return
    if not is_remote(location):
        descriptor = os.open(location, os.O_WRONLY | os.O_APPEND)
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        return
    if not data:
        return
    filesystem, part = clients.client_for(location), _temporary_name(location)
    with clients.unreachable_named(location):
        filesystem.pipe_file(part, data)
        filesystem.merge(location, [location, part])
        filesystem.rm_file(part)


def _s3_append(location: str, data: bytes) -> None:
    """S3's append: an object below S3_MIN_PART_BYTES is read and written back with `data` added, on the condition
    that it is still the version read (If-Match); a larger one becomes the first part of a multipart upload, copied
    server-side, `data` its last part, so each append moves only `data`. Either way the object is replaced in one
    step: a reader, or a process that reads after this one was killed, finds it as it was or with all of `data`. (A
    kill mid-upload leaves an unfinished multipart upload, which S3 never shows; a bucket lifecycle rule aborts
    those.)"""
    if not data:
        return
    filesystem = clients.client_for(location)
    bucket, key, _ = filesystem.split_path(location)
    with clients.unreachable_named(location):
        info = filesystem.info(location)
        if info["size"] < S3_MIN_PART_BYTES:
            content, version = read_versioned(location)
            if replace_if_version(location, content + data, version) is None:
                raise OSError(f"{location} changed while {len(data)} bytes were appended to it: another writer")
            return
        upload = filesystem.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        where = dict(Bucket=bucket, Key=key, UploadId=upload)
        try:
            copied = filesystem.call_s3(
                "upload_part_copy",
                PartNumber=1,
                CopySource={"Bucket": bucket, "Key": key},
                CopySourceIfMatch=clients.version(info),
                **where,
            )["CopyPartResult"]["ETag"]
            added = filesystem.call_s3("upload_part", PartNumber=2, Body=data, **where)["ETag"]
            parts = [{"PartNumber": 1, "ETag": copied}, {"PartNumber": 2, "ETag": added}]
            filesystem.call_s3("complete_multipart_upload", MultipartUpload={"Parts": parts}, **where)
        except BaseException:
            with contextlib.suppress(OSError):
                filesystem.call_s3("abort_multipart_upload", **where)
            raise
        filesystem.invalidate_cache(location)


def read_versioned(user_path: str | os.PathLike) -> tuple[bytes, str]:
    """The content of a bucket object and its version (GCS: its generation; S3: its ETag), to name in
    `replace_if_version` and `delete_if_version`; FileNotFoundError if there is none.

    The version is read first, then the content: the content is that version's or a newer one's, and a conditional
    call naming the version then fails, the safe way round. Bucket objects only (a local file has no version).
    """
    location = _bucket_location(user_path, "read_versioned")
    filesystem = clients.client_for(location)
    with clients.unreachable_named(location):
        info = filesystem.info(location)
        return filesystem.cat_file(location), clients.version(info)


def replace_if_version(user_path: str | os.PathLike, data: bytes, version: str) -> str | None:
    """Replaces a bucket object's content with `data` only if the object still has `version` (GCS: an upload with
    `ifGenerationMatch`; S3: a PUT with `If-Match` on the ETag); returns the new version, or None, writing nothing, if
    the object was replaced or deleted since. Of any number of callers naming the same version, at most one succeeds.
    `data` should differ from the content it replaces (an S3 ETag is the content's MD5: the same bytes, the same ETag).
    """
    location = _bucket_location(user_path, "replace_if_version")
    filesystem = clients.client_for(location)
    with clients.unreachable_named(location):
        try:
            if location.startswith("gs://"):
                return str(clients.gcs_upload_if_generation(filesystem, location, data, version)["generation"])
            return filesystem.pipe_file(location, data, IfMatch=version)["ETag"]
        except (FileExistsError, FileNotFoundError):  # GCS: 412 Precondition Failed; S3: no such object
            return None
        except OSError as error:
            if clients.s3_lost_precondition(error):
                return None
            raise


def delete_if_version(user_path: str | os.PathLike, version: str) -> bool:
    """Deletes a bucket object only if it still has `version` (GCS: `ifGenerationMatch`; S3: `If-Match`); returns
    whether it did. fake-gcs-server ignores this precondition (GCS itself enforces it)."""
    location = _bucket_location(user_path, "delete_if_version")
    filesystem = clients.client_for(location)
    bucket, key, _ = filesystem.split_path(location)
    with clients.unreachable_named(location):
        try:
            if location.startswith("gs://"):
                filesystem.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=version)
            else:
                filesystem.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
        except (FileExistsError, FileNotFoundError):
            return False
        except OSError as error:
            if clients.s3_lost_precondition(error):
                return False
            raise
    return True


def remove_unfinished(user_path: str | os.PathLike) -> list[str]:
    """Deletes the temporary files or objects that writers killed mid-write (`write_bytes`, `append_bytes`) left
    directly in a folder; returns their names. Call it only where no other process writes there."""
    location = os.fspath(path(user_path))
    if is_remote(location):
        with clients.unreachable_named(location):
            try:
                entries = clients.client_for(location).ls(location, detail=False)
            except FileNotFoundError:
                return []
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]
    else:
        names = os.listdir(location) if os.path.isdir(location) else []
    unfinished = sorted(name for name in names if _TEMPORARY_NAME.match(name))
    for name in unfinished:
        delete(f"{location}/{name}")
    return unfinished


@contextlib.contextmanager
def local_copy(user_path: str | os.PathLike) -> Iterator[str]:
    """A local folder holding what is under `user_path`, for libraries that read local files only (tokenizers): the
    folder itself when it is local; for a bucket, a temporary folder with every object below the prefix (subfolders
    kept), removed when the block ends. FileNotFoundError if there is nothing there."""
    location = os.fspath(path(user_path))
    if not is_remote(location):
        if not os.path.isdir(location):
            raise FileNotFoundError(f"{location}: no such folder")
        yield location
        return
    filesystem = clients.client_for(location)
    prefix = location.split("://", 1)[1].rstrip("/") + "/"
    with clients.unreachable_named(location):
        keys = [key for key in filesystem.find(location) if key.startswith(prefix)]
    if not keys:
        raise FileNotFoundError(f"{location}: no objects there")
    with tempfile.TemporaryDirectory(prefix="lmzoo-copy-") as scratch:
        for key in keys:
            relative = key[len(prefix) :]
            if _TEMPORARY_NAME.match(os.path.basename(relative)):
                continue
            target = os.path.join(scratch, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with clients.unreachable_named(location):
                data = filesystem.cat_file(f"{location.split('://', 1)[0]}://{key}")
            with open(target, "wb") as file:
                file.write(data)
        yield scratch


def _temporary_name(location: str) -> str:
    """A new temporary sibling of `location` (".NAME.<12 hex digits>.tmp"), which `list_dir` leaves out."""
    folder, name = location.rsplit("/", 1)
    return f"{folder}/.{name}.{secrets.token_hex(6)}.tmp"


def _bucket_location(user_path: str | os.PathLike, operation: str) -> str:
    location = os.fspath(path(user_path))
    if not is_remote(location):
        raise ValueError(f"{operation} works on bucket objects (gs://, s3://); {location} is a local path")
    return location


def gave_up(user_path: str | os.PathLike) -> bool:
    """Whether an operation on `user_path`'s store (its server) gave up on it for want of an answer, and none has been
    answered since: later operations there try once, without retries."""
    location = os.fspath(path(user_path))
    return is_remote(location) and clients.client_for(location).gave_up_at is not None


def give_up_on(user_path: str | os.PathLike) -> None:
    """Records that the server of `user_path` does not answer (a wait on it, such as a checkpoint save, ran past the
    deadline): until it answers again, operations there try once, without retries."""
    location = os.fspath(path(user_path))
    if is_remote(location):
        filesystem = clients.client_for(location)
        filesystem.gave_up_at = filesystem.gave_up_at or time.monotonic()


def answers(user_path: str | os.PathLike) -> bool:
    """Whether the server of a bucket path answers (anything, "not found" included) within `request_timeout_seconds()`:
    one look-up of `user_path`. Always True for a local path."""
    location = os.fspath(path(user_path))
    if not is_remote(location):
        return True
    filesystem = clients.client_for(location)
    try:
        filesystem.info(location, timeout=request_timeout_seconds())  # fsspec's own bound on the whole call
    except FileNotFoundError:
        pass
    except Exception as error:
        if clients.did_not_answer(error):
            return False
    filesystem.gave_up_at = None
    return True


def writable_local_folder(location: str | os.PathLike) -> None:
    """Creates the local folder `location` (and its parents) if absent and checks that a file can be written in it;
    raises OSError naming why not (a file where a folder should be, no permission, a read-only disk)."""
    os.makedirs(location, exist_ok=True)
    probe = os.path.join(location, f".write-probe-{os.getpid()}")
    with open(probe, "w"):
        pass
    os.remove(probe)
