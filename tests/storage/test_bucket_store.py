"""Token stores in a bucket (GCS and S3 servers of tests/storage/conftest.py, and a local folder for comparison):
prepare writes shards, ledger and manifest as objects; a killed prepare resumes to the identical store; the loader
reads windows by ranged reads through the bounded local cache and gives exactly the batches of the local store; a
mixture mixes local and bucket stores; a damaged or missing object is refused naming it; train.py trains on a bucket
store."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from lmzoo import storage, tokenizers
from lmzoo.data import object_pages, pipeline, prepare, sources, store

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def _corpus(folder: pathlib.Path, files: int = 40) -> sources.FileCorpus:
    folder.mkdir(exist_ok=True)
    text = SHAKESPEARE.read_text() if SHAKESPEARE.exists() else "to be or not to be, that is the question " * 5000
    for i in range(files):
        (folder / f"{i:04d}.txt").write_text(text[(i * 7919) % 100_000 :][: 2000 + 37 * i])
    return sources.FileCorpus(tuple(sources.text_files(str(folder))), validation_fraction=0.1, description="corpus")


def _objects(location: str) -> dict[str, bytes]:
    """Every file or object under `location`, by relative name."""
    with storage.local_copy(location) as folder:
        return {
            os.path.relpath(os.path.join(parent, name), folder): pathlib.Path(parent, name).read_bytes()
            for parent, _, names in os.walk(folder)
            for name in names
        }


def _prepare(source, out, **settings):
    return prepare.prepare(source, tokenizers.ByteTokenizer(), out, progress=False, **settings)


def test_prepared_in_a_bucket_equals_the_local_store_and_reads_the_same_batches(root, tmp_path):
    source = _corpus(tmp_path / "corpus")
    local = _prepare(source, tmp_path / "local", shard_tokens=20_000, chunk_documents=4)
    _prepare(source, f"{root}/stores/corpus", shard_tokens=20_000, chunk_documents=4)
    assert len(local.manifest["splits"]["train"]["shards"]) >= 3
    assert _objects(f"{root}/stores/corpus") == _objects(str(tmp_path / "local"))

    cache = store.read_cache(str(tmp_path / "cache"), 1.0)
    opened = store.open_store(f"{root}/stores/corpus", cache)
    assert (opened.cache is None) == (not storage.is_remote(root))
    assert opened.tokenizer().encode("abc") == tokenizers.ByteTokenizer().encode("abc")
    for split in ("train", "validation"):
        ours, theirs = opened.split(split), local.split(split)
        assert ours.num_tokens == theirs.num_tokens and ours.num_documents == theirs.num_documents
        assert ours.document(ours.num_documents - 1).tolist() == theirs.document(theirs.num_documents - 1).tolist()
        loaders = [pipeline.LMLoader([s], batch_size=16, seq_len=700, seed=3) for s in (ours, theirs)]
        for step in range(4):  # windows across shard boundaries among them (700 tokens, shards of ~20k)
            a, b = (loader.batch(step) for loader in loaders)
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
        everything = ours.windows(np.array([0]), ours.num_tokens)[0]
        np.testing.assert_array_equal(everything, theirs.windows(np.array([0]), theirs.num_tokens)[0])


def test_cache_serves_a_second_reader_and_stays_within_its_bound(gcs_bucket, tmp_path, monkeypatch):
    source = _corpus(tmp_path / "corpus")
    _prepare(source, f"{gcs_bucket}/corpus", shard_tokens=20_000, chunk_documents=4)
    requests = []
    real_read_ranges = storage.read_ranges_of
    monkeypatch.setattr(storage, "read_ranges_of", lambda reads: requests.append(reads) or real_read_ranges(reads))
    first = store.open_store(f"{gcs_bucket}/corpus", store.read_cache(str(tmp_path / "cache"))).split("train")
    loader = pipeline.LMLoader([first], batch_size=8, seq_len=100, seed=0, prefetch_steps=2)
    batch = loader.batch(0)
    loader._prefetcher.shutdown(wait=True)  # the windows of steps 1 and 2, fetched in the background
    assert len(requests) >= 1
    # A reader opened anew (another process on the host) finds the pages in the cache: no request for the tokens.
    second = store.open_store(f"{gcs_bucket}/corpus", store.read_cache(str(tmp_path / "cache"))).split("train")
    requests.clear()
    reader = pipeline.LMLoader([second], batch_size=8, seq_len=100, seed=0, prefetch_steps=0)
    np.testing.assert_array_equal(reader.batch(0)["inputs"], batch["inputs"])
    expected = pipeline.LMLoader([first], batch_size=8, seq_len=100, seed=0, prefetch_steps=0).batch(2)
    np.testing.assert_array_equal(reader.batch(2)["inputs"], expected["inputs"])
    assert requests == []

    # A bound below what was read: trimming removes objects not read within IN_USE_SECONDS, down to the bound.
    cache = object_pages.PageCache(str(tmp_path / "cache" / "objects"), max_bytes=1)
    monkeypatch.setattr(object_pages, "IN_USE_SECONDS", 0.0)
    cache.trim()
    assert os.listdir(tmp_path / "cache" / "objects") == []
    # A process that still reads an object whose files were removed keeps its own copy.
    np.testing.assert_array_equal(reader.batch(0)["inputs"], batch["inputs"])


def test_mixture_of_a_local_and_a_bucket_store(gcs_bucket, tmp_path):
    source = _corpus(tmp_path / "corpus", files=12)
    local = _prepare(source, tmp_path / "local", shard_tokens=10_000)
    _prepare(source, f"{gcs_bucket}/corpus", shard_tokens=10_000)
    remote = store.open_store(f"{gcs_bucket}/corpus", store.read_cache(str(tmp_path / "cache")))
    mixed = pipeline.LMLoader([local.split("train"), remote.split("train")], 32, 64, 5, weights=(1.0, 1.0))
    same = pipeline.LMLoader([local.split("train"), local.split("train")], 32, 64, 5, weights=(1.0, 1.0))
    np.testing.assert_array_equal(mixed.batch(7)["inputs"], same.batch(7)["inputs"])


def test_damaged_or_missing_objects_are_refused_naming_them(root, tmp_path):
    source = _corpus(tmp_path / "corpus", files=8)
    folder = f"{root}/store"
    _prepare(source, folder)
    shard = f"{folder}/train/00000.tokens"
    storage.write_bytes(shard, storage.read_bytes(shard)[:-2])
    with pytest.raises(store.StoreError, match=r"00000\.tokens has \d+ bytes, the manifest says \d+"):
        store.open_store(folder)
    storage.delete(shard)
    with pytest.raises(store.StoreError, match=r"00000\.tokens is missing"):
        store.open_store(folder)
    storage.write_text(f"{folder}/manifest.json", "{not json")
    with pytest.raises(store.StoreError, match="is not a valid store manifest"):
        store.open_store(folder)
    with pytest.raises(store.StoreError, match="does not exist"):
        store.open_store(f"{root}/nothing-here")


@pytest.mark.slow  # subprocesses
def test_prepare_killed_mid_way_into_a_bucket_resumes_to_the_identical_store(gcs_bucket, tmp_path):
    corpus = tmp_path / "corpus"
    _corpus(corpus, files=300)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    command = [
        sys.executable, "-m", "lmzoo.data.prepare", f"--source={corpus}", "--validation_fraction=0.1",
        "--shard_tokens=40000", "--workers=1", "--chunk_documents=10",
    ]  # fmt: skip
    clean = subprocess.run([*command, f"--out={tmp_path / 'clean'}"], env=env, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr
    killed = f"{gcs_bucket}/killed"
    proc = subprocess.Popen([*command, f"--out={killed}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not storage.exists(f"{killed}/train/00001.tokens"):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with pytest.raises(store.StoreError, match="incomplete"):
        store.open_store(killed)
    rerun = subprocess.run([*command, f"--out={killed}"], env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert _objects(killed) == _objects(str(tmp_path / "clean"))


@pytest.mark.slow  # a training subprocess
def test_train_py_trains_on_a_bucket_store(gcs_bucket, tmp_path):
    _prepare(_corpus(tmp_path / "corpus"), f"{gcs_bucket}/corpus")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), "LMZOO_CACHE": str(tmp_path / "c")}
    command = [
        sys.executable, str(ROOT / "train.py"), "--config=configs/default.py:tiny", f"--workdir={tmp_path / 'run'}",
        "--config.data.source=store", f"--config.data.path={gcs_bucket}/corpus", "--config.train.steps=3",
        "--config.model.vocab_size=258",
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.listdir(tmp_path / "c" / "objects"), "the bucket store was not read through the cache"


def test_a_step_fetches_every_shard_in_one_round_trip(gcs_bucket, tmp_path, monkeypatch):
    _prepare(_corpus(tmp_path / "corpus"), f"{gcs_bucket}/corpus", shard_tokens=5_000, chunk_documents=2)
    calls = []
    real = storage.read_ranges_of
    monkeypatch.setattr(storage, "read_ranges_of", lambda reads: calls.append(len(reads)) or real(reads))
    split = store.open_store(f"{gcs_bucket}/corpus", store.read_cache(str(tmp_path / "cache"))).split("train")
    assert len(split.shards) >= 8 and calls == [len(split.shards)]  # every shard's offsets in one call
    calls.clear()
    pipeline.LMLoader([split], batch_size=64, seq_len=100, seed=1, prefetch_steps=0).batch(0)
    assert len(calls) == 1 and calls[0] >= 8  # 64 windows over the shards: one concurrent call
