"""The alignment stages through the one training loop on a slice of the real HH-RLHF file:
SFT -> reward model (initialised from the SFT checkpoint) -> PPO against both (frozen, read by path)."""

import gzip
import importlib.util
import itertools
import json
import pathlib

import numpy as np
import pytest

from lmzoo.data import comparisons
from lmzoo.train import loop, restore

ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL_FILE = "/work/shared/data/hh_rlhf/harmless-base_test.jsonl.gz"


def stage_config(name: str, data_path: str, **train):
    """configs/<name>.py:tiny on `data_path`, with config.train fields replaced."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    config.data.path = data_path
    config.train.update(train)
    return config


def _rows(workdir) -> list[dict]:
    return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """A 120-pair slice of the real file, a 2-step SFT run and a 2-step reward model from it."""
    root = tmp_path_factory.mktemp("alignment")
    data = root / "hh.jsonl"
    with gzip.open(REAL_FILE, "rt", encoding="utf-8") as f:
        data.write_text("".join(itertools.islice(f, 120)))
    sft, rm = root / "sft", root / "rm"
    loop.train_and_evaluate(stage_config("hh_sft", str(data), steps=2), str(sft))
    rm_config = stage_config("hh_rm", str(data), steps=2)
    rm_config.init_from = f"ckpt:{sft}"
    final = loop.train_and_evaluate(rm_config, str(rm))
    return {"data": str(data), "sft": str(sft), "rm": str(rm), "rm_final": final}


def test_sft_trains_on_replies_of_training_prompts_only(stages):
    run = restore.open_run(stages["sft"])
    heldout = {c.prompt for c in run.raw("validation")}
    assert heldout and not heldout & {c.prompt for c in run.raw("train")}
    batch = run.train_loader().batch(0)
    assert set(batch) >= {"inputs", "targets", "weights", "segment_ids", "positions"}
    assert 0 < batch["weights"].sum() < np.count_nonzero(batch["segment_ids"])  # prompts carry no loss
    run.checkpointer.close()
    validation = [r for r in _rows(stages["sft"]) if r["split"] == "validation"]
    assert validation and np.isfinite(validation[-1]["loss"])


def test_reward_model_starts_from_sft_and_reports_accuracy_next_to_length_baselines(stages):
    sft_params = restore.load(stages["sft"]).params
    run = restore.open_run(stages["rm"])
    _, state = restore.restore_step(run, 2)
    run.checkpointer.close()
    assert set(state.params) == {"backbone", "classifier"}
    assert state.params["backbone"]["wpe"]["embedding"].shape == sft_params["wpe"]["embedding"].shape
    final = stages["rm_final"]
    for key in ("pairwise_accuracy", "length_longer_accuracy", "length_shorter_accuracy"):
        assert 0.0 <= final[key] <= 1.0
    # Every pair is counted by exactly one length direction, up to ties (½ each).
    assert final["length_longer_accuracy"] + final["length_shorter_accuracy"] == pytest.approx(1.0)
    assert final["pairs"] == len(comparisons.read_splits(stages["data"], 0.1, 0)["validation"])
    assert final["pairwise_accuracy"] == pytest.approx(final["accuracy"])
