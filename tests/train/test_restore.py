"""A checkpoint restores and scores with only its workdir: no training data, from any directory."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np

import lmzoo
from lmzoo import testing
from lmzoo.data import pipeline
from lmzoo.data.store import TokenSplit
from lmzoo.objectives import losses
from lmzoo.train import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN_TEXT = "the quick brown fox jumps over the lazy dog. " * 60
NEW_TEXT = "a lazy brown dog jumps over the quick fox. " * 8


def test_eval_and_load_from_the_workdir_alone(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TRAIN_TEXT)
    config = testing.tiny_config(sample_tokens=0)
    config.data.source, config.data.path = "local", str(corpus)
    config.data.tokenizer = {"kind": "char"}
    workdir = tmp_path / "run"
    loop.train_and_evaluate(config, str(workdir))
    corpus.unlink()  # the training data is gone
    new_file = tmp_path / "new.txt"
    new_file.write_text(NEW_TEXT)

    result = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), f"--workdir={workdir}", f"--data={new_file}"],
        capture_output=True,
        text=True,
        cwd="/",
        check=False,
    )
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.splitlines()[0])
    assert line["split"] == "data" and line["data"] == str(new_file) and line["step"] == 4
    assert (workdir / "eval_data_new.txt.json").exists()

    loaded = lmzoo.load(str(workdir))
    assert (
        loaded.step == 4
        and loaded.config.data.path == str(corpus)
        and loaded.tokenizer.decode(loaded.tokenizer.encode("fox")) == "fox"
    )
    stream = TokenSplit.from_documents(loaded.tokenizer.encode_batch([NEW_TEXT]), loaded.tokenizer.eos_id)
    total, count = 0.0, 0.0
    for batch in pipeline.eval_batches([stream], batch_size=64, seq_len=config.data.seq_len):
        logits = loaded.model.apply(
            {"params": loaded.params}, batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"]
        )
        s, c = jax.device_get(losses.cross_entropy(logits, batch["targets"], batch["weights"]))
        total, count = total + float(s), count + float(c)
    np.testing.assert_allclose(line["loss"], total / count, rtol=1e-5)
    assert line["tokens"] == count
