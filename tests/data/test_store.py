"""Token stores (issue 25): prepared once, read by memory map, byte-identical for any worker count, resumable after
kill -9 or a full disk, and every bad input refused with one line naming the file and the fix."""

import errno
import gzip
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmzoo import tokenizers
from lmzoo.data import pipeline, prepare, sources, store, transforms
from lmzoo.data.loaders import Shard
from lmzoo.data.store import TokenSplit

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
GPT2 = ROOT.parent / "shared" / "data" / "tokenizers" / "gpt2"
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def _corpus(folder: pathlib.Path) -> pathlib.Path:
    """Documents in every file form a source may take: text, jsonl, jsonl.gz and parquet."""
    folder.mkdir()
    (folder / "a.txt").write_text("First document, plain text.\nWith a second line.")
    (folder / "b.jsonl").write_text('{"text": "second", "id": 1}\n\n{"text": "third \\u00e9t\\u00e9"}\n')
    with gzip.open(folder / "c.jsonl.gz", "wt") as f:
        f.write('{"text": "fourth, gzipped"}\n')
    pq.write_table(pa.table({"text": ["fifth from parquet", "sixth"], "n": [1, 2]}), folder / "d.parquet")
    for i in range(6):
        (folder / f"e{i}.md").write_text(f"markdown document {i} " * (i + 1))
    return folder


def _file_digests(folder: os.PathLike) -> dict[str, str]:
    folder = pathlib.Path(folder)
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_store_round_trip_equals_direct_tokenization(tmp_path):
    root = _corpus(tmp_path / "corpus")
    source = sources.FileCorpus(tuple(sources.text_files(str(root))), validation_fraction=0.2, description="corpus")
    tokenizer = tokenizers.ByteTokenizer()
    built = prepare.prepare(source, tokenizer, tmp_path / "store", shard_tokens=40, chunk_documents=2, progress=False)
    documents = {"train": [], "validation": []}
    for split, text in source.documents():
        documents[split].append(text)
    assert len(documents["train"]) == 10 and len(documents["validation"]) == 2
    assert built.manifest["dtype"] == "<u2" and built.manifest["eos"] == "appended"
    for name, texts in documents.items():
        split = built.split(name)
        direct = TokenSplit.from_documents(tokenizer.encode_batch(texts), tokenizer.eos_id)
        assert split.num_documents == len(texts) and split.num_tokens == direct.num_tokens
        for i, text in enumerate(texts):
            assert split.document(i).tolist() == tokenizer.encode(text) + [tokenizer.eos_id]
        starts = np.arange(0, split.num_tokens + 5, 7)
        for got, want in zip(split.windows(starts, 23), direct.windows(starts, 23)):
            np.testing.assert_array_equal(got, want)
    assert len(built.manifest["splits"]["train"]["shards"]) > 2  # windows above crossed shard boundaries
    assert built.tokenizer().encode("x") == tokenizer.encode("x")


def test_windows_give_packed_examples_across_shards():
    split = TokenSplit(
        [np.array([5, 6, 7, 1, 8, 9, 1]), np.array([10, 11, 12, 13, 1])], [np.array([0, 4]), np.array([7])]
    )
    batch = transforms.lm_windows(*split.windows(np.array([2, 8]), 7))
    np.testing.assert_array_equal(batch["inputs"], [[7, 1, 8, 9, 1, 10], [11, 12, 13, 1, 0, 0]])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 2, 2, 2, 3], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["weights"], [[1, 0, 1, 1, 0, 1], [1, 1, 1, 0, 0, 0]])


def test_same_bytes_for_any_worker_count(tmp_path):
    root = _corpus(tmp_path / "corpus")
    source = sources.FileCorpus(tuple(sources.text_files(str(root))), validation_fraction=0.3, description="c")
    tokenizer = tokenizers.ByteTokenizer()
    settings = dict(shard_tokens=50, chunk_documents=3, progress=False)
    one = prepare.prepare(source, tokenizer, tmp_path / "one", **settings)
    two = prepare.prepare(source, tokenizer, tmp_path / "two", workers=2, **settings)
    assert _file_digests(one.folder) == _file_digests(two.folder)
    assert len(one.manifest["splits"]["train"]["shards"]) > 1


def test_gpt2_store_uses_tiktoken_and_matches_the_decoding_tokenizer(tmp_path):
    if not GPT2.is_dir():
        pytest.skip("needs ../shared/data/tokenizers/gpt2")
    tokenizer = tokenizers.build_tokenizer("gpt2", path=str(GPT2))
    assert tokenizer._tiktoken is not None
    texts = [
        SHAKESPEARE.read_text()[:200_000],
        pathlib.Path(sources.python_stdlib_files(1)[0]).read_text(),
        "unicode: héllo wörld, 日本語, emoji 🎉, tabs\t\tand  spaces \n\n\n",
        "special tokens in text: a<|endoftext|>b",
        "",
    ]
    hf_ids = [e.ids for e in tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False)]
    assert tokenizer.encode_batch(texts) == hf_ids
    assert tokenizer.decode(tokenizer.encode_batch(texts)[2]) == texts[2]
    for dtype in (np.uint16, np.uint32):
        tokens, lengths = tokenizer.encode_documents(texts, np.dtype(dtype))
        assert tokens.dtype == dtype and tokens.tolist() == [i for ids in hf_ids for i in ids + [50256]]
        assert lengths.tolist() == [len(ids) + 1 for ids in hf_ids]
    (tmp_path / "doc.txt").write_text(texts[0])
    source = sources.FileCorpus((tmp_path / "doc.txt",), description="doc")
    built = prepare.prepare(source, tokenizer, tmp_path / "store", progress=False)
    assert built.split("train").document(0).tolist() == hf_ids[0] + [50256]


def test_kill_minus_nine_then_rerun_gives_the_identical_store(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    text = SHAKESPEARE.read_text() if SHAKESPEARE.exists() else "to be or not to be " * 50_000
    for i in range(1200):
        (root / f"{i:04d}.txt").write_text(text[(i * 7919) % 500_000 :][: 4000 + i])
    command = [
        sys.executable, "-m", "lmzoo.data.prepare", f"--source={root}", "--validation_fraction=0.1",
        "--shard_tokens=300000", "--workers=1", "--chunk_documents=100",
    ]  # fmt: skip
    clean = subprocess.run([*command, f"--out={tmp_path / 'clean'}"], env=ENV, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr
    killed = tmp_path / "killed"
    proc = subprocess.Popen([*command, f"--out={killed}"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (killed / "train" / "00000.tokens").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with pytest.raises(store.StoreError, match="incomplete"):
        store.open_store(killed)
    rerun = subprocess.run([*command, f"--out={killed}"], env=ENV, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert _file_digests(killed) == _file_digests(tmp_path / "clean")


def test_a_resumed_build_removes_the_temporary_files_a_killed_one_left(tmp_path):
    """A kill -9 while the ledger (or a shard) was being written leaves `storage.write_bytes`' temporary sibling: the
    resumed build deletes it, so the finished store holds what a clean build holds."""
    header = {"dtype": "<u2"}
    store.StoreWriter(tmp_path / "out", header, 100)  # starts the build: the ledger
    (tmp_path / "out" / "train").mkdir()
    left = [
        tmp_path / "out" / ".progress.json.0e4eb258f485.tmp",
        tmp_path / "out" / "train" / ".00000.starts.0123456789ab.tmp",
    ]
    for path in left:
        path.write_bytes(b"half")
    store.StoreWriter(tmp_path / "out", header, 100)  # the rerun resumes it
    assert not any(path.exists() for path in left)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["progress.json", "train"]


def test_disk_full_keeps_finished_shards_and_the_rerun_completes(tmp_path, failing_open):
    root = _corpus(tmp_path / "corpus")
    out = tmp_path / "store"
    command = [
        sys.executable, "-m", "lmzoo.data.prepare", f"--source={root}", f"--out={out}", "--shard_tokens=40",
        "--workers=1", "--validation_fraction=0", "--chunk_documents=2",
    ]  # fmt: skip
    env = {**ENV, "LD_PRELOAD": str(failing_open), "FAILFS_MATCH": "00002.partial", "FAILFS_ERRNO": str(errno.ENOSPC)}
    full = subprocess.run(command, env=env, capture_output=True, text=True)
    assert full.returncode == 2
    assert full.stderr.strip().splitlines() == [
        f"error: the disk filled while writing store {out}; the shard being written was discarded and 2 finished "
        "shard(s) kept: free space and run the same command to resume"
    ]
    assert sorted(p.name for p in (out / "train").iterdir()) == [
        f"0000{i}.{s}" for i in (0, 1) for s in ("starts", "tokens")
    ]
    rerun = subprocess.run(command, env=ENV, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    clean = prepare.prepare(
        sources.FileCorpus(tuple(sources.text_files(str(root))), description=str(root)),
        tokenizers.ByteTokenizer(),
        tmp_path / "clean",
        shard_tokens=40,
        chunk_documents=2,
        progress=False,
    )
    assert _file_digests(out) == _file_digests(clean.folder)


def _small_store(tmp_path, name="store", tokenizer=None) -> store.Store:
    root = tmp_path / f"{name}-corpus"
    if not root.exists():
        _corpus(root)
    source = sources.FileCorpus(tuple(sources.text_files(str(root))), validation_fraction=0.2, description=name)
    return prepare.prepare(source, tokenizer or tokenizers.ByteTokenizer(), tmp_path / name, progress=False)


def test_damaged_stores_are_refused_naming_the_file(tmp_path):
    built = _small_store(tmp_path)
    shard = built.folder / "train" / "00000.tokens"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])
    with pytest.raises(store.StoreError, match=r"00000.tokens has .* bytes, the manifest says .*truncated"):
        store.open_store(built.folder)
    shard.unlink()
    with pytest.raises(store.StoreError, match=r"00000.tokens is missing"):
        store.open_store(built.folder)
    shard.write_bytes(data)
    manifest = json.loads((built.folder / "manifest.json").read_text())
    (built.folder / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(store.StoreError, match="store format 99, newer than this lmzoo reads"):
        store.open_store(built.folder)
    with pytest.raises(store.StoreError, match="does not exist"):
        store.open_store(tmp_path / "nowhere")
    with pytest.raises(store.StoreError, match="already holds a complete store"):
        _small_store(tmp_path)


def test_bad_inputs_refused_before_any_work(tmp_path):
    built = _small_store(tmp_path)
    gpt2_like = tokenizers.CharTokenizer("abc")
    with pytest.raises(store.StoreError, match="written by another tokenizer"):
        built.check_tokenizer(gpt2_like)
    with pytest.raises(store.StoreError, match="cannot hold the tokenizer's 300 ids"):
        prepare.token_dtype_for(tokenizers.CharTokenizer("".join(chr(0x100 + i) for i in range(299))), "uint8")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2 has no field 'text'"):
        list(sources.file_documents(tmp_path / "bad.jsonl", "text", "file"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: no column 'text'"):
        list(sources.file_documents(tmp_path / "bad.parquet", "text", "file"))
    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"null.parquet: row 2 column 'text' is NoneType"):
        list(sources.file_documents(tmp_path / "null.parquet", "text", "file"))
    only_train = prepare.prepare(
        sources.FileCorpus((tmp_path / "bad.parquet",), "body", description="x"),
        tokenizers.ByteTokenizer(),
        tmp_path / "only_train",
        progress=False,
    )
    with pytest.raises(store.StoreError, match="has no 'validation' tokens"):
        only_train.split("validation")
    cli = subprocess.run(
        [sys.executable, "-m", "lmzoo.data.prepare", f"--source={tmp_path / 'bad.jsonl'}", f"--out={tmp_path / 'o'}"],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 2 and cli.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'bad.jsonl'}: line 2 has no field 'text' (it has ['body']); pass --text_field=NAME, the "
        "field that holds the text"
    ]


def test_mixture_rows_follow_the_weights_deterministically():
    web = TokenSplit([np.zeros(5000, np.int32)], [np.zeros(1, np.int64)], "web")
    code = TokenSplit([np.ones(3000, np.int32)], [np.zeros(1, np.int64)], "code")
    loader = pipeline.LMLoader([web, code], batch_size=64, seq_len=16, seed=1, weights=(0.7, 0.3))
    share = np.mean([loader.batch(step)["inputs"][:, 0].mean() for step in range(200)])
    assert abs(share - 0.3) < 0.02
    np.testing.assert_array_equal(loader.batch(7)["inputs"], loader.batch(7)["inputs"])
    halves = [
        pipeline.LMLoader([web, code], 64, 16, seed=1, weights=(0.7, 0.3), process_index=i, process_count=2).batch(7)[
            "inputs"
        ]
        for i in range(2)
    ]
    np.testing.assert_array_equal(np.concatenate(halves), loader.batch(7)["inputs"])
    assert "mixture: web 0.70 of rows (5,000 tokens), code 0.30 of rows (3,000 tokens)" == loader.dataset_size
    with pytest.raises(ValueError, match="must be > 0"):
        pipeline.LMLoader([web, code], 64, 16, seed=1, weights=(1.0, 0.0))


def test_gpt2_124m_recipe_trains_its_first_steps_from_a_store(tmp_path):
    if not GPT2.is_dir() or not SHAKESPEARE.exists():
        pytest.skip("needs ../shared/data")
    from lmzoo import config as config_lib
    from lmzoo.train import loop

    (tmp_path / "text.txt").write_text(SHAKESPEARE.read_text()[:200_000])
    tokenizer = tokenizers.build_tokenizer("gpt2", path=str(GPT2))
    source = sources.FileCorpus((tmp_path / "text.txt",), validation_fraction=0.1, description="shakespeare")
    built = prepare.prepare(source, tokenizer, tmp_path / "store", progress=False)
    config = config_lib.load_config_file(ROOT / "configs" / "gpt2_124m.py", "tiny")
    config.data.path = str(built.folder)
    loop.train_and_evaluate(config, str(tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if r.get("split") == "validation"][-1]
    assert final["step"] == 3 and 9.0 < final["loss"] < 11.5  # ~ln(50257) at the start
    saved = tokenizers.from_spec(json.loads((tmp_path / "run" / "tokenizer" / "spec.json").read_text()),
                                 str(tmp_path / "run" / "tokenizer"))  # fmt: skip
    built.check_tokenizer(saved)


def test_a_config_naming_raw_text_is_tokenized_once_and_again_when_the_text_changes(tmp_path, monkeypatch):
    from lmzoo import objectives
    from lmzoo.data import readers

    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path / "cache"))
    corpus = _corpus(tmp_path / "corpus")
    config = local_text_config(corpus)
    raw = objectives.build(config).read()
    tokenizer = tokenizers.ByteTokenizer()
    first = raw["train"].token_splits(tokenizer)[0]
    stores = list((tmp_path / "cache" / "stores").glob("*/manifest.json"))
    assert len(stores) == 1
    again = objectives.build(local_text_config(corpus)).read()["train"].token_splits(tokenizer)[0]
    assert list((tmp_path / "cache" / "stores").glob("*/manifest.json")) == stores
    np.testing.assert_array_equal(again.windows(np.arange(5), 9)[0], first.windows(np.arange(5), 9)[0])
    time.sleep(0.01)
    (corpus / "a.txt").write_text("Changed text.")
    changed = objectives.build(local_text_config(corpus)).read()["train"].token_splits(tokenizer)[0]
    assert len(list((tmp_path / "cache" / "stores").glob("*/manifest.json"))) == 2
    assert changed.document(0).tolist() == list(b"Changed text.") + [256]
    assert isinstance(raw["train"], readers.CorpusSplit)


def local_text_config(corpus: pathlib.Path):
    from lmzoo import testing

    config = testing.tiny_config()
    config.data.source, config.data.path = "local", str(corpus)
    return config


def test_store_source_and_mixture_configs_are_checked_before_any_work(tmp_path):
    from lmzoo import objectives
    from lmzoo.train import run as run_lib

    web, code = _small_store(tmp_path, "web"), _small_store(tmp_path, "code")
    config = local_text_config(tmp_path)
    config.data.source, config.data.path = "store", ""
    config.data.mixture = ((str(web.folder), 0.7), (str(code.folder), 0.0))
    with pytest.raises(ValueError, match=r"config.data.mixture=.*must be \(store folder, weight > 0\)"):
        run_lib.build(config, str(tmp_path / "run"))
    config.data.mixture = ((str(web.folder), 0.7), (str(tmp_path / "missing"), 0.3))
    with pytest.raises(store.StoreError, match="missing does not exist"):
        objectives.build(config).read()["train"].mixture(tokenizers.ByteTokenizer())
    config.data.mixture = ((str(web.folder), 0.7), (str(code.folder), 0.3))
    objective = objectives.build(config)
    loader = objective.train_loader(tokenizers.ByteTokenizer(), objective.read()["train"], Shard())
    assert loader.dataset_size.startswith("mixture: web 0.70 of rows")
    evaluated = sum(
        float(batch["weights"].sum())
        for batch in objective.eval_batches(tokenizers.ByteTokenizer(), objective.read()["validation"], Shard())
    )
    alone = [pipeline.eval_batches([s.split("validation")], 8, config.data.seq_len) for s in (web, code)]
    assert evaluated == sum(float(batch["weights"].sum()) for batches in alone for batch in batches) > 0


def test_resume_after_the_training_text_changed_warns(tmp_path, caplog):
    from lmzoo.train import loop

    corpus = _corpus(tmp_path / "corpus")
    config = local_text_config(corpus)
    loop.train_and_evaluate(config, str(tmp_path / "run"))
    assert json.loads((tmp_path / "run" / "data.json").read_text())["fingerprint"]
    (corpus / "a.txt").write_text("Other text now.")
    config = local_text_config(corpus)
    config.train.steps = 6
    with caplog.at_level("WARNING"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
    assert "the training data changed since step 4 was saved" in caplog.text


def test_prepare_reads_a_prepared_tfds_dataset(tmp_path, capsys):
    from lmzoo.data import tfds_text

    name = tfds_text.prepare_text_dataset(
        str(tmp_path / "tfds"), {"train": ["hello world", "abc"], "validation": ["xyz"]}
    )
    args = [f"--tfds={name}", f"--tfds_data_dir={tmp_path / 'tfds'}", f"--out={tmp_path / 'store'}", "--workers=1"]
    assert prepare.main(args) == 0
    assert "train 16 tokens in 2 documents, validation 4 tokens in 1 documents" in capsys.readouterr().out
    built = store.open_store(tmp_path / "store")
    assert built.split("validation").document(0).tolist() == list(b"xyz") + [256]


def _prose_corpus(folder: pathlib.Path) -> sources.FileCorpus:
    """Paragraphs of prose as documents (some of one sentence), from The Time Machine when present."""
    text = (ROOT.parent / "shared" / "data" / "timemachine" / "timemachine.txt").read_text()[:60_000]
    folder.mkdir()
    (folder / "prose.txt").write_text(text + "\n\nOne. Two? Three!\n\nAlone")
    return sources.FileCorpus((folder / "prose.txt",), unit="paragraph", validation_fraction=0.2, description="prose")


@pytest.mark.parametrize("kind", ["nsp", "sop"])
def test_sentence_pairs_from_a_store_equal_those_from_the_text(tmp_path, kind):
    """A store prepared with sentences (several shards, 2 workers, EOS appended) gives the sentence pairs the text's
    own sentences give, draw for draw."""
    source = _prose_corpus(tmp_path / "corpus")
    tokenizer = tokenizers.ByteTokenizer()
    built = prepare.prepare(
        source, tokenizer, tmp_path / "store", workers=2, shard_tokens=4000, chunk_documents=7, sentences=True
    )
    assert len(built.manifest["splits"]["train"]["shards"]) > 3 and built.manifest["eos"] == "appended"
    for split in ("train", "validation"):
        texts = [text for name, text in source.documents() if name == split]
        by_document = [
            [s for s in tokenizer.encode_batch(transforms.split_sentences(t, wrapped=True)) if s] for t in texts
        ]
        expected = transforms.SentencePairs(
            transforms.SentenceLists([d for d in by_document if d]), kind=kind, seed=3, size=300
        )
        index = built.split(split).sentences()
        assert index.counts.tolist() == [len(d) for d in by_document if d]
        got = transforms.SentencePairs(index, kind=kind, seed=3, size=300)
        assert [(list(a), list(b), label) for a, b, label in map(expected.__getitem__, range(300))] == [
            got[k] for k in range(300)
        ]
        first = next(d for d in by_document if d)  # a document is its sentences, then EOS
        assert built.split(split).document(0).tolist() == [i for s in first for i in s] + [tokenizer.eos_id]


def test_sentence_pair_objectives_refuse_a_store_without_sentences(tmp_path):
    source = _prose_corpus(tmp_path / "corpus")
    built = prepare.prepare(source, tokenizers.ByteTokenizer(), tmp_path / "store", progress=False)
    with pytest.raises(store.StoreError, match="has no sentence index: prepare the store with --sentences"):
        built.split("train").sentences()
