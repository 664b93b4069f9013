"""lmzoo.storage on a local folder, on a GCS server and on an S3 server (tests/storage/conftest.py starts both): each
function, the create-if-absent and replace-if-version races between processes, ranged reads, atomic overwrites,
appends, versioned replaces and deletes, an unreachable server, and an orbax checkpoint through lmzoo.checkpoint in a
bucket."""

import multiprocessing
import os
import threading
import time

import numpy as np
import pytest
from etils import epath

from lmzoo import storage, workdir
from lmzoo.data import store


def test_path_turns_user_strings_into_paths(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert os.fspath(storage.path("runs/a")) == str(tmp_path / "runs" / "a")
    assert os.fspath(storage.path("~/x")) == os.path.expanduser("~/x")
    for remote in ("gs://bucket/runs/a", "s3://bucket/runs/a"):
        assert os.fspath(storage.path(remote)) == remote
        assert isinstance(storage.path(remote), epath.Path)
        assert storage.is_remote(remote) and storage.is_remote(storage.path(remote))
    assert not storage.is_remote("runs/a")
    for wrong in ("gcs://bucket/a", "http://host/a", "gs://", "s3:///key"):
        with pytest.raises(ValueError):
            storage.path(wrong)


def test_write_and_read_back(root):
    target = f"{root}/run/config/settings.json"
    storage.write_bytes(target, b"first")
    assert storage.read_bytes(target) == b"first"
    storage.write_text(target, "second: \u00e9\u4e2d")
    assert storage.read_text(target) == "second: \u00e9\u4e2d"
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(f"{root}/run/missing")


def test_read_range(root):
    target = f"{root}/store/tokens.bin"
    data = bytes(range(256)) * 4
    storage.write_bytes(target, data)
    assert storage.read_range(target, 10, 20) == data[10:30]
    assert storage.read_range(target, 0, len(data)) == data
    assert storage.read_range(target, len(data) - 5, 5) == data[-5:]
    assert storage.read_range(target, len(data), 0) == b""
    for offset, length in ((len(data) - 5, 6), (len(data), 1), (len(data) + 100, 10)):
        with pytest.raises(EOFError):
            storage.read_range(target, offset, length)
    with pytest.raises(ValueError):
        storage.read_range(target, -1, 2)
    with pytest.raises(FileNotFoundError):
        storage.read_range(f"{root}/store/missing.bin", 0, 4)


def test_exists_list_and_delete(root):
    for name in ("a/x", "a/y", "a/sub/z"):
        storage.write_bytes(f"{root}/{name}", name.encode())
    assert storage.exists(f"{root}/a/x") and storage.exists(f"{root}/a/sub")
    assert not storage.exists(f"{root}/a/w")
    assert storage.list_dir(f"{root}/a") == ["sub", "x", "y"]
    assert storage.list_dir(f"{root}/a/") == ["sub", "x", "y"]
    with pytest.raises(FileNotFoundError):
        storage.list_dir(f"{root}/nothing")
    storage.delete(f"{root}/a/x")
    storage.delete(f"{root}/a/x")  # already gone: no error
    assert not storage.exists(f"{root}/a/x")
    assert storage.list_dir(f"{root}/a") == ["sub", "y"]


def test_overwrite_is_atomic_for_readers(root):
    """A reader racing a writer that replaces a 256 KiB file 16 times only ever sees one whole version."""
    target = f"{root}/metrics.jsonl"
    versions = [bytes([version]) * (256 * 1024) for version in range(16)]
    storage.write_bytes(target, versions[0])
    done = threading.Event()

    def rewrite():
        for version in versions[1:]:
            storage.write_bytes(target, version)
        done.set()

    writer = threading.Thread(target=rewrite)
    writer.start()
    reads = 0
    while not done.is_set() or reads == 0:
        assert storage.read_bytes(target) in versions
        reads += 1
    writer.join()
    assert storage.read_bytes(target) == versions[-1]
    assert storage.list_dir(root) == ["metrics.jsonl"]


def test_failed_local_write_keeps_the_old_content(tmp_path):
    target = tmp_path / "config.json"
    storage.write_bytes(target, b"old")
    with pytest.raises(TypeError):
        storage.write_bytes(target, "not bytes")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["config.json"]  # no temporary file left behind
    assert (target.stat().st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def test_replace_local_swaps_whole_folders(tmp_path):
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "old.model").write_text("old")
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "spec.json").write_text("{}")
    storage.replace_local(staged, tmp_path / "tokenizer")
    assert sorted(p.name for p in (tmp_path / "tokenizer").iterdir()) == ["spec.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer"]


def test_create_if_absent(root):
    lock = f"{root}/run/lock"
    assert storage.create_if_absent(lock, b"holder-1")
    assert not storage.create_if_absent(lock, b"holder-2")
    assert storage.create_if_absent(lock, b"holder-1")  # the holder's own retry
    assert storage.read_bytes(lock) == b"holder-1"
    with pytest.raises(ValueError):
        storage.create_if_absent(f"{root}/run/other", b"")
    storage.delete(lock)
    assert storage.create_if_absent(lock, b"holder-2")


@pytest.fixture(scope="module")
def contenders(object_storage):
    """Processes of their own, as hosts would be, each with its own clients; started after the servers so that they
    inherit the endpoints."""
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        pool.map(storage.exists, ["/"] * 6)  # each process imports lmzoo.storage once, before the races
        yield pool


def test_create_if_absent_race_has_one_winner(root, contenders):
    rounds, callers = 4, 8
    calls = [(f"{root}/race/lock-{r}", f"round {r} caller {c}".encode()) for r in range(rounds) for c in range(callers)]
    won = contenders.starmap(storage.create_if_absent, calls, chunksize=1)
    for r in range(rounds):
        winners = [data for (_, data), won_it in zip(calls, won) if won_it and data.startswith(b"round %d " % r)]
        assert len(winners) == 1, winners
        assert storage.read_bytes(f"{root}/race/lock-{r}") == winners[0]


@pytest.mark.parametrize("root", ["gs"], indirect=True)
def test_gcs_emulator_is_shared_and_skips_the_grpc_lookup(root, object_storage):
    """With STORAGE_EMULATOR_HOST set, tensorstore is pointed at the emulator too, and no gcsfs client, lmzoo's or the
    one orbax reaches through etils.epath, waits out gcsfs's gRPC bucket-type lookup (60 s, on every call)."""
    started = time.monotonic()
    storage.write_bytes(f"{root}/a/x", b"x")
    assert storage.read_bytes(f"{root}/a/x") == b"x"
    assert storage.list_dir(f"{root}/a") == ["x"]
    assert epath.Path(f"{root}/a/x").exists()
    assert [p.name for p in epath.Path(f"{root}/a").iterdir()] == ["x"]
    assert time.monotonic() - started < 20
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == object_storage["gs"]
    assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"


@pytest.mark.parametrize("root", ["gs"], indirect=True)
def test_checkpoint_round_trip_in_a_gcs_bucket(root):
    import jax

    from lmzoo import checkpoint

    state = {
        "params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, np.float32)},
        "step": np.int32(7),
    }
    state = jax.tree.map(jax.numpy.asarray, state)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    saver = checkpoint.Checkpointer(f"{root}/run/checkpoints")
    saver.save(7, state, {"position": 3})
    saver.wait()
    saver.close()

    reader = checkpoint.Checkpointer(f"{root}/run/checkpoints")
    assert reader.steps() == [7]
    step, restored, data_state = reader.restore_latest(target)
    assert step == 7 and data_state == {"position": 3}
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    jax.tree.map(np.testing.assert_array_equal, reader.restore_params(7), state["params"])
    reader.close()
    assert "7" in storage.list_dir(f"{root}/run/checkpoints")


def test_append_bytes(root):
    target = f"{root}/run/metrics.jsonl"
    if not storage.is_remote(root):  # GCS answers 404 too; fake-gcs-server answers 500, retried for 30 s
        with pytest.raises(FileNotFoundError):
            storage.append_bytes(f"{root}/run/absent.jsonl", b"row\n")
    storage.write_bytes(target, b"")
    for row in range(3):
        storage.append_bytes(target, b"row %d\n" % row)
    storage.append_bytes(target, b"")
    assert storage.read_bytes(target) == b"row 0\nrow 1\nrow 2\n"
    assert storage.list_dir(f"{root}/run") == ["metrics.jsonl"]
    assert storage.remove_unfinished(f"{root}/run") == []  # the temporary part objects were deleted


@pytest.mark.parametrize("root", ["s3"], indirect=True)
def test_append_bytes_to_an_s3_object_of_a_part_and_more(root):
    """Past S3's smallest part, an append is a multipart upload: the object copied server-side, then the new bytes."""
    target = f"{root}/run/metrics.jsonl"
    first = bytes(range(256)) * (storage.S3_MIN_PART_BYTES // 256)
    storage.write_bytes(target, first)
    storage.append_bytes(target, b"row 1\n")
    storage.append_bytes(target, b"row 2\n")
    assert storage.read_bytes(target) == first + b"row 1\nrow 2\n"
    assert storage.file_sizes(f"{root}/run")["metrics.jsonl"][0] == len(first) + 12


def test_remove_unfinished_deletes_what_killed_writers_left(root):
    storage.write_bytes(f"{root}/run/config.json", b"{}")
    storage.write_bytes(f"{root}/run/.metrics.jsonl.0123456789ab.tmp", b"half")
    assert storage.list_dir(f"{root}/run") == ["config.json"]
    assert storage.remove_unfinished(f"{root}/run") == [".metrics.jsonl.0123456789ab.tmp"]
    assert storage.remove_unfinished(f"{root}/run") == []
    assert storage.remove_unfinished(f"{root}/nothing") == []
    assert storage.read_bytes(f"{root}/run/config.json") == b"{}"


def test_local_copy(root):
    for name in ("tokenizer/spec.json", "tokenizer/sub/words.txt"):
        storage.write_bytes(f"{root}/run/{name}", name.encode())
    with storage.local_copy(f"{root}/run/tokenizer") as folder:
        with open(os.path.join(folder, "spec.json"), "rb") as file:
            assert file.read() == b"tokenizer/spec.json"
        with open(os.path.join(folder, "sub", "words.txt"), "rb") as file:
            assert file.read() == b"tokenizer/sub/words.txt"
    assert os.path.isdir(folder) == (not storage.is_remote(root))  # a bucket's copy is removed after the block
    with pytest.raises(FileNotFoundError), storage.local_copy(f"{root}/run/nothing"):
        pass


@pytest.mark.parametrize("root", ["gs", "s3"], indirect=True)
def test_versioned_replace_and_delete(root):
    lock = f"{root}/run/lock"
    assert storage.create_if_absent(lock, b"holder 1")
    content, version = storage.read_versioned(lock)
    assert content == b"holder 1"
    renewed = storage.replace_if_version(lock, b"holder 1, renewed", version)
    assert renewed is not None and renewed != version
    assert storage.replace_if_version(lock, b"holder 2", version) is None  # named a version that is gone
    assert storage.read_versioned(lock) == (b"holder 1, renewed", renewed)
    if root.startswith("s3://"):  # fake-gcs-server ignores preconditions on delete (GCS enforces them)
        assert not storage.delete_if_version(lock, version)
        assert storage.exists(lock)
    assert storage.delete_if_version(lock, renewed)
    assert not storage.exists(lock)
    assert storage.replace_if_version(lock, b"holder 3", renewed) is None  # nothing left to replace
    with pytest.raises(FileNotFoundError):
        storage.read_versioned(lock)


def test_versioned_operations_refuse_local_paths(tmp_path):
    for call in (
        lambda: storage.read_versioned(tmp_path / "lock"),
        lambda: storage.replace_if_version(tmp_path / "lock", b"x", "1"),
        lambda: storage.delete_if_version(tmp_path / "lock", "1"),
    ):
        with pytest.raises(ValueError, match="is a local path"):
            call()


@pytest.mark.parametrize("root", ["gs", "s3"], indirect=True)
def test_replace_if_version_race_has_one_winner(root, contenders):
    """The lease takeover's arbiter: 8 callers on 3 processes replace the same version; one wins each round."""
    rounds, callers = 4, 8
    calls = []
    for r in range(rounds):
        storage.write_bytes(f"{root}/race/lock-{r}", b"stale holder %d" % r)
        version = storage.read_versioned(f"{root}/race/lock-{r}")[1]
        calls += [(f"{root}/race/lock-{r}", f"round {r} taker {c}".encode(), version) for c in range(callers)]
    won = contenders.starmap(storage.replace_if_version, calls, chunksize=1)
    for r in range(rounds):
        winners = [data for (_, data, _), new in zip(calls, won) if new and data.startswith(b"round %d " % r)]
        assert len(winners) == 1, winners
        assert storage.read_bytes(f"{root}/race/lock-{r}") == winners[0]


def test_an_unreachable_bucket_raises_one_error_naming_the_path(object_storage, monkeypatch):
    """s3fs gives up on a refused connection within seconds (gcsfs retries for 30 s: the GCS case is
    tests/storage/test_bucket_workdir.py's stopped server)."""
    if not object_storage["s3"].startswith("http://"):
        pytest.skip(object_storage["s3"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # no retries by botocore: the error comes at once
    with pytest.raises(storage.BucketUnreachableError, match=r"^s3://bucket/run/config.json: the bucket's server did"):
        storage.write_bytes("s3://bucket/run/config.json", b"{}")
    assert issubclass(storage.BucketUnreachableError, OSError)  # an entry point's one-line error (exit status 2)


def test_a_bucket_mounted_by_fuse_is_named_and_refused_for_workdirs_and_stores(tmp_path, monkeypatch):
    mounts = "\n".join(
        [
            "/dev/sda1 / ext4 rw,relatime 0 0",
            f"training-data {tmp_path}/gcs fuse.gcsfuse rw,nosuid,nodev 0 0",
            f"s3fs:corpora {tmp_path}/s3 fuse.s3fs rw 0 0",
            f"nfs-server:/export {tmp_path}/nfs nfs4 rw 0 0",
        ]
    )
    assert storage.bucket_mount(f"{tmp_path}/gcs/runs/a", mounts) == "gs://training-data/runs/a"
    assert storage.bucket_mount(f"{tmp_path}/gcs", mounts) == "gs://training-data"
    assert storage.bucket_mount(f"{tmp_path}/s3/stores/x", mounts) == "s3://corpora/stores/x"
    assert storage.bucket_mount(f"{tmp_path}/gcs-other/run", mounts) is None
    assert storage.bucket_mount(f"{tmp_path}/nfs/run", mounts) is None  # NFS shares flock (NLM): allowed

    table = tmp_path / "mounts"
    table.write_text(mounts + "\n")
    monkeypatch.setattr(storage, "MOUNTS_FILE", str(table))
    with pytest.raises(ValueError, match=r"pass --workdir=gs://training-data/runs/a instead"):
        workdir.lock(f"{tmp_path}/gcs/runs/a")
    assert not (tmp_path / "gcs").exists()  # refused before anything was written
    with pytest.raises(ValueError, match=r"pass --out=s3://corpora/stores/x instead"):
        store.StoreWriter(f"{tmp_path}/s3/stores/x", {"dtype": "<u2"}, 100)
    with workdir.lock(f"{tmp_path}/nfs/run"):
        pass
