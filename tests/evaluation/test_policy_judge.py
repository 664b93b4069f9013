"""scripts/preference_compare.py end to end on the tiny configs and a slice of the real HH-RLHF file: SFT, a reward
model, PPO, RLOO, GRPO and DPO through the run layer, every checkpoint judged by `lmzoo.evaluation.alignment`."""

import gzip
import importlib.util
import itertools
import pathlib

import numpy as np
import pytest

from lmzoo.evaluation import alignment

ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL_FILE = ROOT.parent / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz"
METHODS = ("ppo", "rloo", "grpo", "dpo")


def test_win_rate_counts_ties_half():
    assert alignment.win_rate(np.array([1.0, 0.0, 2.0, 5.0]), np.array([0.0, 0.0, 3.0, 5.0])) == pytest.approx(0.5)
    assert alignment.win_rate(np.array([1.0, 1.0]), np.array([0.0, 0.0])) == 1.0


def load_script():
    spec = importlib.util.spec_from_file_location("preference_compare", ROOT / "scripts" / "preference_compare.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The script's main on 40 pairs: 2 SFT and 2 reward-model steps, 8 policy updates of GRPO (the `ppo` objective's
    checkpoints) and DPO (a bare decoder's); PPO and RLOO train as GRPO does, and cost the test's time only."""
    root = tmp_path_factory.mktemp("compare")
    data = root / "hh.jsonl"
    with gzip.open(REAL_FILE, "rt", encoding="utf-8") as f:
        data.write_text("".join(itertools.islice(f, 40)))
    out = root / "out"
    argv = ["--tiny", "--out", str(out), "--data", str(data), "--sft_steps", "2", "--rm_steps", "2"]
    rows = load_script().main(
        argv + ["--methods", "grpo,dpo", "--updates", "8", "--checkpoints", "1", "--eval_batches", "1"]
    )
    return out, rows


def test_the_sft_policy_against_itself_has_zero_kl_and_wins_half(compared):
    _, rows = compared
    sft = [r for r in rows if r["method"] == "sft"]
    assert len(sft) == 1 and sft[0]["updates"] == 0
    assert sft[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the same decoder on the same samples
    assert sft[0]["win_rate"] == 0.5  # the same key gives the same replies: every pair a tie
    assert sft[0]["samples"] > 0 and sft[0]["samples"] % 2 == 0  # held-out prompts x 2 samples


def test_every_method_is_judged_at_its_checkpoint_and_reported(compared):
    out, rows = compared
    assert [(r["method"], r["updates"]) for r in rows[1:]] == [("grpo", 8), ("dpo", 8)]
    for row in rows:
        assert np.isfinite([row["score"], row["kl"], row["win_rate"]]).all()
        assert 0.0 <= row["win_rate"] <= 1.0
    dpo = next(r for r in rows if r["method"] == "dpo")
    assert abs(dpo["kl"]) > 1e-4  # the judge scored the trained policy, not the reference
    table = (out / "results.md").read_text()
    for method in ("sft", "grpo", "dpo"):
        assert f"\n| {method} | " in table
    assert (out / "score_vs_kl.png").read_bytes()[:4] == b"\x89PNG"


def test_the_table_has_a_row_for_every_method():
    script = load_script()
    rows = [{"method": m, "updates": 8, "score": 0.1, "kl": 0.2, "win_rate": 0.5, "response_len": 3.0} for m in METHODS]
    runs = {
        m: {"steps": 8, "per_step": 1, "unit": "4 pairs", "wall": {"seconds": 1.0, "load": [0.5, 0.6]}} for m in METHODS
    }
    lines = script.table([{**rows[0], "method": "sft", "updates": 0}] + rows, runs)
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| sft", *(f"| {m}" for m in METHODS)]
    assert set(script.METHODS) == set(METHODS)
