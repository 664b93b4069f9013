"""`python eval.py --workdir=RUN` on the runs of docs/rlhf.md (issue 41): PPO, GRPO, RLOO and DPO runs are scored with
their frozen reference (and reward model) read again, as a resumed run reads them, and report what "Watching and
evaluating" promises; a DPO run whose `objective.sft` names a reward-model run is refused, as PPO refuses it.

One 2-step SFT run and one 2-step reward model on a slice of the real HH-RLHF file serve every case."""

import gzip
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from lmzoo import config as config_lib
from lmzoo.train import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
REAL_FILE = ROOT.parent / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz"

# (config file and variant, config.objective overrides; the reported keys of eval.py's JSON line besides
# "step", "split", "loss", "examples" and "evaluated_batches").
PPO_REPORT = ("score", "kl", "response_len")  # mean normalised score, KL to the SFT policy, reply length
METHODS = {
    "ppo": ("hh_ppo.py:tiny", {}, PPO_REPORT),
    "grpo": ("hh_ppo.py:tiny,grpo", {"samples_per_prompt": 2}, PPO_REPORT),
    "rloo": ("hh_ppo.py:tiny,rloo", {"samples_per_prompt": 2}, PPO_REPORT),
    "dpo": (
        "hh_dpo.py:tiny",
        {},
        ("rewards/accuracy", "rewards/margin", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"),
    ),
}


def tiny_config(spec: str, data: str, steps: int = 2):
    """configs/<spec> on `data`, `steps` steps, its in-loop evaluation over the whole held-out split (what eval.py
    scores, so the two can be compared)."""
    path, _, variant = spec.partition(":")
    config = config_lib.load_config_file(ROOT / "configs" / path, variant)
    config.data.path = data
    config.train.steps = config.optim.decay_steps = steps
    config.eval.max_batches = 1000
    return config


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """A 60-pair slice of the real file (6 held-out prompts), a 2-step SFT run and a 2-step reward model from it."""
    if not REAL_FILE.exists():
        pytest.skip("needs ../shared/data")
    root = tmp_path_factory.mktemp("eval_rl")
    data = root / "hh.jsonl"
    with gzip.open(REAL_FILE, "rt", encoding="utf-8") as f:
        data.write_text("".join(itertools.islice(f, 60)))
    loop.train_and_evaluate(tiny_config("hh_sft.py:tiny", str(data)), str(root / "sft"))
    rm = tiny_config("hh_rm.py:tiny", str(data))
    rm.init_from = f"ckpt:{root / 'sft'}"
    loop.train_and_evaluate(rm, str(root / "rm"))
    return {"root": root, "data": str(data), "sft": str(root / "sft"), "rm": str(root / "rm")}


def eval_py(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "eval.py", *flags], capture_output=True, text=True, cwd=ROOT, env=ENV)


@pytest.mark.parametrize("method", METHODS)
def test_eval_py_scores_an_alignment_run_against_its_frozen_models(stages, method):
    spec, objective, reported = METHODS[method]
    config = tiny_config(spec, stages["data"])
    config.objective.update(objective, sft=f"ckpt:{stages['sft']}")
    if method != "dpo":
        config.objective.reward_model = f"ckpt:{stages['rm']}"
    workdir = stages["root"] / method
    final = loop.train_and_evaluate(config, str(workdir))
    result = eval_py(f"--workdir={workdir}")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("{"))  # after the loading notes
    scores = json.loads(line)
    assert scores["step"] == 2 and scores["split"] == "validation"
    assert set(reported) | {"loss", "examples"} <= set(scores)
    # The step's in-loop evaluation scored the same held-out split: the frozen models read again give its numbers.
    for key in (*reported, "loss", "examples"):
        assert math.isfinite(scores[key]) and scores[key] == pytest.approx(final[key], rel=1e-5, abs=1e-6), key
    assert json.loads((workdir / "eval_validation.json").read_text()) == scores


def test_dpo_from_a_reward_model_run_is_refused_as_ppo_refuses_it(stages, tmp_path):
    command = [
        sys.executable, "train.py", "--config=configs/hh_dpo.py:tiny", f"--workdir={tmp_path / 'dpo'}",
        f"--config.data.path={stages['data']}", f"--config.objective.sft=ckpt:{stages['rm']}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: config.objective.sft='ckpt:{stages['rm']}' is a 'reward_model' run; point it at the sft "
        "(or causal_lm) run"
    )
    assert not (tmp_path / "dpo").exists()
