"""GSM8K evaluation (lmzoo/evaluation/gsm8k.py, eval.py --gsm8k): the pass@k estimator against hand values, rows and
their errors, replies cut at EOS and at the next question, and a tiny byte-level GPT-2 run end to end: on real GSM8K
rows, on a row built from its own greedy reply (scored 1, and 0 with the answer off by one: the scoring is real), and
through eval.py (in process for the refusals, as a subprocess once)."""

import importlib.util
import json
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest
from absl import flags

from lmzoo import decoding, testing, tokenizers
from lmzoo.data import problems
from lmzoo.evaluation import gsm8k
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
GSM8K_TEST = pathlib.Path("/work/shared/data/gsm8k/test.jsonl")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
# Greedy and sampled replies of 8 tokens: prompts keep their last 24 of the tiny model's 32 positions.
SETTINGS = dict(max_new_tokens=8, batch_size=2)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A byte-level 1-layer GPT-2 (configs/default.py:tiny) trained 8 steps on random digits: it answers a prompt of
    digits with digits, so its greedy reply holds a number."""
    tmp = tmp_path_factory.mktemp("gsm8k")
    rng = random.Random(0)
    (tmp / "digits.txt").write_text("".join(rng.choice("0123456789") for _ in range(20_000)))
    config = testing.tiny_config(sample_tokens=0, steps=8, eval_every=8, checkpoint_every=8)
    config.data.source, config.data.path = "local", str(tmp / "digits.txt")
    config.optim.learning_rate, config.optim.warmup_steps, config.optim.decay_steps = 1e-2, 0, 8
    loop.train_and_evaluate(config, str(tmp / "run"))
    return tmp / "run"


@pytest.fixture(scope="module")
def loaded(workdir):
    return run_lib.load(str(workdir))


def test_pass_at_k_hand_values():
    assert gsm8k.pass_at_k(5, 2, 1) == pytest.approx(0.4)  # 1 - C(3,1)/C(5,1) = 1 - 3/5
    assert gsm8k.pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert gsm8k.pass_at_k(5, 0, 3) == 0.0
    assert gsm8k.pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every 3 of the 5 hold a correct one
    assert gsm8k.pass_at_k(5, 5, 1) == 1.0
    assert gsm8k.pass_at_k(200, 1, 100) == pytest.approx(0.5)  # exact binomials, no overflow
    for n, c, k in ((5, 6, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(ValueError, match="pass@k needs"):
            gsm8k.pass_at_k(n, c, k)


def test_read_rows_and_their_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n\n")
    assert gsm8k.read_rows(str(good)) == [{"question": "1+1?", "answer": "1+1=2\n#### 2"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match="line 2 has no field 'answer'"):
        gsm8k.read_rows(str(bad))
    bad.write_text(json.dumps({"question": "q", "answer": "no number"}) + "\n")
    with pytest.raises(ValueError, match="row 1's answer 'no number' states no final number"):
        gsm8k.read_rows(str(bad))
    with pytest.raises(FileNotFoundError):
        gsm8k.read_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"row 1's fields \['answer', 'question'\] \(KeyError: 'problem'\)"):
        problems.format_prompt("{problem}", {"question": "q", "answer": "#### 1"})


def test_a_reply_ends_at_eos_and_before_the_next_question():
    tokenizer = tokenizers.ByteTokenizer()
    ids = tokenizer.encode(" 6 * 7 = 42\nQuestion: and then?") + [tokenizer.eos_id] + tokenizer.encode("43")
    assert decoding.reply_text(tokenizer, ids, [1] * len(ids), (gsm8k.STOP,)) == " 6 * 7 = 42"
    ids = tokenizer.encode(" #### 42") + [tokenizer.eos_id] + tokenizer.encode("\nQuestion: 43")
    assert decoding.reply_text(tokenizer, ids, [1] * len(ids), (gsm8k.STOP,)) == " #### 42"
    assert (
        decoding.reply_text(tokenizer, ids, [1] * 4 + [0] * (len(ids) - 4), (gsm8k.STOP,)) == " ###"
    )  # the sampler's mask


def test_sampled_pass_at_k_needs_a_temperature(loaded):
    rows = [{"question": "1", "answer": "#### 1"}]
    with pytest.raises(ValueError, match="pass@4 draws 4 replies per problem: temperature must be > 0"):
        gsm8k.evaluate(loaded.model, loaded.params, loaded.tokenizer, rows, k_values=(1, 4), temperature=0.0)
    with pytest.raises(ValueError, match="each k must be >= 1"):
        gsm8k.evaluate(loaded.model, loaded.params, loaded.tokenizer, rows, k_values=(0,))


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} is not here")
def test_real_rows_greedy_and_pass_at_k(loaded):
    rows = gsm8k.read_rows(str(GSM8K_TEST))[:4]
    result = gsm8k.evaluate(
        loaded.model, loaded.params, loaded.tokenizer, rows, k_values=(2,), temperature=1.0, **SETTINGS
    )
    assert result["examples"] == 4 and result["samples_per_problem"] == 2
    for key in ("accuracy", "pass@1", "pass@2", "pass@1_sampled"):
        assert 0.0 <= result[key] <= 1.0
    assert result["pass@1"] == result["accuracy"]
    assert result["truncated_prompts"] == 4  # every GSM8K question is longer than 24 bytes
    assert [r["question"] for r in result["replies"]] == [r["question"] for r in rows[:3]]


def test_the_scoring_reads_the_models_own_reply(loaded):
    """The greedy reply to a prompt of digits holds a number N: a row answered "#### N" scores 1, "#### N+1" 0."""
    question, settings = "8461937", dict(template="{question}", **SETTINGS)
    first = gsm8k.evaluate(
        loaded.model, loaded.params, loaded.tokenizer, [{"question": question, "answer": "#### 0"}], **settings
    )
    reply = first["replies"][0]["reply"]
    numbers = re.findall(r"\d+", reply)
    assert numbers, f"the digit-trained model's greedy reply {reply!r} holds no number"
    number = int(numbers[-1])
    for answer, accuracy in ((f"#### {number}", 1.0), (f"#### {number + 1}", 0.0)):
        rows = [{"question": question, "answer": answer}]
        result = gsm8k.evaluate(loaded.model, loaded.params, loaded.tokenizer, rows, **settings)
        assert result["replies"][0]["reply"] == reply  # greedy: the same reply
        assert result["accuracy"] == accuracy and result["replies"][0]["correct"] == bool(accuracy)


# eval.py defines its flags on absl's FLAGS when loaded: loaded once per process as "eval_cli", as
# tests/evaluation/test_eval_cli.py loads it.
EVAL = sys.modules.get("eval_cli")
if EVAL is None:
    _spec = importlib.util.spec_from_file_location("eval_cli", ROOT / "eval.py")
    EVAL = sys.modules["eval_cli"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(EVAL)


def write_rows(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


ROWS = [{"question": q, "answer": f"#### {a}"} for q, a in (("12", 3), ("45", 9), ("78", 15))]


@pytest.mark.parametrize(
    "case",
    ["missing file", "row without answer", "k below 1", "greedy pass@4", "template field"],
)
def test_eval_py_refuses_bad_input_with_one_line(workdir, tmp_path, capsys, case):
    data = write_rows(tmp_path / "rows.jsonl", ROWS)
    args, fragment = {
        "missing file": ([f"--gsm8k={tmp_path / 'none.jsonl'}"], "--gsm8k="),
        "row without answer": (
            [f"--gsm8k={write_rows(tmp_path / 'bad.jsonl', [*ROWS, {'question': '1'}])}"],
            "line 4 has no field 'answer'",
        ),
        "k below 1": ([f"--gsm8k={data}", "--gsm8k_k=0,4"], "--gsm8k_k=0,4: each k must be >= 1"),
        "greedy pass@4": ([f"--gsm8k={data}", "--gsm8k_k=1,4", "--temperature=0"], "pass --temperature > 0"),
        "template field": ([f"--gsm8k={data}", "--gsm8k_template={problem}"], "KeyError: 'problem'"),
    }[case]
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["eval.py", f"--workdir={workdir}", *args])
    with pytest.raises(SystemExit) as exit_:
        EVAL.main(["eval.py"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err
    assert not (workdir / "eval_gsm8k.json").exists()


@pytest.mark.slow  # a subprocess
def test_eval_py_gsm8k_writes_its_result(workdir, tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", ROWS)
    cmd = [sys.executable, "eval.py", f"--workdir={workdir}", f"--gsm8k={data}", "--gsm8k_k=1,2", "--temperature=1"]
    cmd += ["--max_new_tokens=8", "--batch_size=2", "--gsm8k_examples=2", "--gsm8k_template={question}"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stderr
    line, header, values = result.stdout.splitlines()[:3]
    assert header.split() == ["accuracy", "pass@2", "examples", "seconds"] and values.split()[2] == "2"
    written = json.loads((workdir / "eval_gsm8k.json").read_text())
    assert written == json.loads(line)
    assert written["examples"] == 2 and written["samples_per_problem"] == 2 and written["template"] == "{question}"
    assert {"accuracy", "pass@1", "pass@2", "seconds", "step"} <= set(written)
    (workdir / "eval_gsm8k.json").unlink()
