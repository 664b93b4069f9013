"""bench/device_suite.py runs end to end on the CPU (`--tiny`), so device minutes are never spent on a broken script:
every part gives its numbers or a recorded reason, a failing part is recorded and the suite goes on, and the budget
is shared out as documented."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import device_suite  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
PARTS = [part.name for part in device_suite.PARTS]
LLAMA_3_2_1B_PARAMS = 1_235_814_400  # meta-llama/Llama-3.2-1B's safetensors, the embedding tied to the head


def suite(out: pathlib.Path, *flags: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    """bench/device_suite.py --tiny --out OUT FLAGS in a process: (the process, its device_suite.json)."""
    command = [sys.executable, "bench/device_suite.py", "--tiny", f"--out={out}", *flags]
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    report = out / "device_suite.json"
    assert report.is_file(), f"no {report}; exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done, json.loads(report.read_text())


def positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.slow  # subprocesses: every part's process, train.py and pytest among them
def test_tiny_suite_gives_every_part_numbers_or_a_reason(tmp_path):
    done, report = suite(tmp_path, timeout=400)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    parts = report["parts"]
    assert list(parts) == PARTS
    for name, record in parts.items():
        if name == "gpt2_nanogpt":  # no checkout here: skipped, saying so
            assert record["status"] == "skipped" and "--nanogpt_dir" in record["reason"], record
        else:
            assert record["status"] == "ok", f"{name}: {record}"
    assert json.loads(json.dumps(report)) == report  # strict JSON: no NaN

    env = parts["env"]
    assert env["versions"]["jax"] and env["versions"]["python"] and env["device"] and env["device_count"] >= 1
    assert positive(env["peak_tflops"]) and "datasheet_tflops" in env

    tests = parts["gpu_tests"]
    assert tests["tests"] and sum(tests[k] for k in ("passed", "failed", "errors", "skipped")) == len(tests["tests"])
    assert tests["failed"] == tests["errors"] == 0

    assert parts["tokens"]["tokens"]["train"] > 0 and parts["tokens"]["tokens"]["validation"] > 0
    gpt2 = parts["gpt2_lmzoo"]
    assert positive(gpt2["tokens_per_s"]) and positive(gpt2["flops_per_token"]) and positive(gpt2["tflops"])
    assert [step for step, _ in gpt2["losses"]] == [1, 2, 3] and all(positive(loss) for _, loss in gpt2["losses"])
    assert positive(gpt2["mfu_measured_peak"]) and positive(gpt2["validation_loss"])

    for name in ("llama_1b", "bert_base", "t5_base"):
        record = parts[name]
        assert positive(record["tokens_per_s"]) and positive(record["mfu_measured_peak"]), f"{name}: {record}"
        assert positive(record["loss"]) and positive(record["params"]) and record["call_ms"], f"{name}: {record}"
    assert parts["llama_1b"]["variant_params"] == LLAMA_3_2_1B_PARAMS

    load = parts["load"]["platforms"]["cpu"]  # the toy checkpoint through hf: and ckpt:, against reading its files
    assert all(positive(load[k]) for k in ("read_s", "fill_s", "load_s", "restore_s", "peak_rss", "rss_target")), load
    assert load["rss_pass"] in (True, False) and load["time_pass"] in (True, False)
    assert report["summary"]["load_cpu"]["load_s"] == load["load_s"]

    calls = parts["steps_per_call"]
    assert (
        positive(calls["tokens_per_s"]["off"]) and positive(calls["tokens_per_s"]["on"]) and positive(calls["speedup"])
    )
    for name in ("env", "gpt2_lmzoo", "llama_1b", "bert_base", "t5_base", "steps_per_call"):
        assert "peak_memory" in parts[name], name  # None on the CPU, which keeps no memory statistics
    assert report["summary"]["statuses"] == {name: parts[name]["status"] for name in PARTS}
    log = (tmp_path / "device_suite.log").read_text()
    assert all(f"=== {name}: {parts[name]['status']} ===" in log for name in PARTS)


@pytest.mark.slow  # a subprocess
def test_failing_part_is_recorded_and_its_dependents_skipped(tmp_path):
    missing = tmp_path / "no_such_store"
    done, report = suite(tmp_path, "--parts=tokens,gpt2_lmzoo", f"--store={missing}", timeout=120)
    assert done.returncode == 1
    parts = report["parts"]
    assert parts["tokens"]["status"] == "error" and str(missing) in parts["tokens"]["error"]
    assert parts["gpt2_lmzoo"] == {"status": "skipped", "reason": "no token store: the tokens part did not make one"}
    assert parts["env"] == {"status": "skipped", "reason": "not in --parts"}
    assert "tokens: ERROR" in done.stdout


@pytest.mark.slow  # a subprocess
def test_part_that_needs_more_than_is_left_is_skipped(tmp_path):
    done, report = suite(tmp_path, "--parts=env", "--budget_s=1", timeout=60)
    assert done.returncode == 0
    assert report["parts"]["env"]["status"] == "skipped"
    assert report["parts"]["env"]["reason"].startswith("needs about 5 s; 1 s of the 1 s budget left")


def test_allot_shares_what_is_left():
    assert device_suite.allot(100, 10, 1.0, [(10, 1.0)]) == 50  # its share
    assert device_suite.allot(100, 10, 3.0, [(40, 1.0)]) == 60  # its share would leave the later part too little
    assert device_suite.allot(100, 30, 1.0, [(90, 9.0)]) == 30  # at least its need, even into the later parts'
    assert device_suite.allot(20, 30, 1.0, []) is None  # needs more than is left: skipped
    assert device_suite.allot(50, 10, 1.0, []) == 50  # the last part gets what is left
