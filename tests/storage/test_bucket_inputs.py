"""User inputs read from a bucket (GCS and S3 servers of tests/storage/conftest.py, and a local folder): comparisons
(.jsonl.gz, what SFT, the reward model, DPO and PPO read), a few-shot task file, and eval.py --plot's event files
with its figures written back."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from lmzoo import storage, testing
from lmzoo.data import comparisons
from lmzoo.evaluation import fewshot, plots
from lmzoo.train import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]
HH = ROOT.parent / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz"


@pytest.mark.skipif(not HH.exists(), reason="../shared/data/hh_rlhf is not here")
def test_comparisons_read_from_a_bucket_equal_the_local_file(root):
    storage.upload(HH, f"{root}/data/hh.jsonl.gz")
    assert comparisons.read_splits(f"{root}/data/hh.jsonl.gz", 0.1) == comparisons.read_splits(str(HH), 0.1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        comparisons.read_comparisons(f"{root}/data/missing.jsonl")


def test_fewshot_task_read_from_a_bucket(root):
    rows = [
        {"context": "2 + 2 =", "choices": [" 4", " 5"], "gold": 0},
        {"context": "sky", "choices": ["a", "b"], "gold": 1},
    ]
    storage.write_text(f"{root}/tasks/t.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    examples = fewshot.read_task(f"{root}/tasks/t.jsonl")
    assert [(e.context, e.choices, e.gold) for e in examples] == [
        (r["context"], tuple(r["choices"]), r["gold"]) for r in rows
    ]
    storage.write_text(f"{root}/tasks/bad.jsonl", json.dumps(rows[0]) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        fewshot.read_task(f"{root}/tasks/bad.jsonl")


def test_plots_of_a_run_whose_events_are_in_a_bucket(root, tmp_path):
    local = tmp_path / "run"
    loop.train_and_evaluate(testing.tiny_config(log_every=1, steps=2), str(local))
    for event_file in (local / "tb").iterdir():
        storage.upload(event_file, f"{root}/run/tb/{event_file.name}")
    assert plots.read_events(f"{root}/run") == plots.read_events(str(local))
    written = plots.plot_metrics(f"{root}/run")
    assert written and all(path.startswith(f"{root}/run/plots/") for path in written)
    assert all(storage.read_bytes(path)[:4] == b"\x89PNG" for path in written)
    # and as a user asks for them (issue 55: eval.py refused a bucket workdir that docs/SCALING.md says it plots)
    command = [sys.executable, str(ROOT / "eval.py"), f"--workdir={root}/run", "--plot"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == written


def _text_corpus(folder: pathlib.Path) -> None:
    """Text in every form a source may take: .txt, .jsonl.gz and parquet, in subfolders."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "sub").mkdir(parents=True)
    text = (ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt").read_text()[:60_000]
    for i in range(6):
        (folder / f"{i}.txt").write_text(text[i * 5000 : (i + 1) * 5000])
    with gzip.open(folder / "sub" / "rows.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": text[k : k + 700]}) + "\n" for k in range(30_000, 40_000, 700))
    pq.write_table(
        pa.table({"text": [text[k : k + 900] for k in range(40_000, 50_000, 900)]}), folder / "sub" / "d.parquet"
    )


def test_prepare_from_a_bucket_source_equals_the_local_one(root, tmp_path):
    from lmzoo import tokenizers
    from lmzoo.data import prepare, sources

    _text_corpus(tmp_path / "corpus")
    for file in sorted((tmp_path / "corpus").rglob("*.*")):
        storage.upload(file, f"{root}/corpus/{file.relative_to(tmp_path / 'corpus')}")
    built = []
    for where in (str(tmp_path / "corpus"), f"{root}/corpus"):
        files = tuple(sources.text_files(where))
        assert [f.name for f in files] == [
            "0.txt",
            "1.txt",
            "2.txt",
            "3.txt",
            "4.txt",
            "5.txt",
            "d.parquet",
            "rows.jsonl.gz",
        ]
        source = sources.FileCorpus(files, validation_fraction=0.1, description=where)
        out = tmp_path / f"store{len(built)}"
        built.append(prepare.prepare(source, tokenizers.ByteTokenizer(), out, progress=False, chunk_documents=3))
    for split in ("train", "validation"):
        a, b = (store.split(split) for store in built)
        assert a.num_documents == b.num_documents > 0
        np.testing.assert_array_equal(
            a.windows(np.array([0]), a.num_tokens)[0], b.windows(np.array([0]), b.num_tokens)[0]
        )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sources.text_files(f"{root}/no-such-corpus")


@pytest.mark.slow  # subprocesses
def test_train_and_eval_read_raw_text_from_a_bucket(gcs_bucket, tmp_path):
    import os
    import subprocess
    import sys

    _text_corpus(tmp_path / "corpus")
    for file in sorted((tmp_path / "corpus").glob("*.txt")):
        storage.upload(file, f"{gcs_bucket}/corpus/{file.name}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), "LMZOO_CACHE": str(tmp_path / "cache")}
    run = [sys.executable, str(ROOT / "train.py"), "--config=configs/default.py:tiny", f"--workdir={tmp_path / 'run'}"]
    trained = subprocess.run(
        [*run, "--config.data.source=local", f"--config.data.path={gcs_bucket}/corpus"],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    evaluated = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), f"--workdir={tmp_path / 'run'}", f"--data={gcs_bucket}/corpus/0.txt"],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout.splitlines()[0])["data"] == f"{gcs_bucket}/corpus/0.txt"
    missing = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), f"--workdir={tmp_path / 'run'}", f"--data={gcs_bucket}/nothing.txt"],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1].endswith("nothing.txt: no such file")
