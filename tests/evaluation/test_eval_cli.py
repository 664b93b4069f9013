"""eval.py on a tiny trained run, in process: partial results in their own file, --generate without scoring, its
escapes and --prompt_file, --fewshot with its prompts dumped, --plot, and the error for an objective it cannot score."""

import importlib.util
import json
import pathlib
import sys

import pytest
from absl import flags

from lmzoo import evaluation, testing
from lmzoo.objectives import base
from lmzoo.train import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT = "the quick brown fox jumps over the lazy dog.\n" * 60  # a newline in the vocabulary, for --generate's \n


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval_cli")
    corpus = tmp / "corpus.txt"
    corpus.write_text(TEXT)
    config = testing.tiny_config(sample_tokens=0)
    config.data.source, config.data.path = "local", str(corpus)
    config.data.tokenizer = {"kind": "char"}
    loop.train_and_evaluate(config, str(tmp / "run"))
    return tmp / "run"


def run_eval(capsys, *args: str) -> str:
    """Runs eval.py's main with `args` (flags reset to their defaults first); returns what it printed."""
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["eval.py", *args])
    EVAL.main(["eval.py"])
    return capsys.readouterr().out


# eval.py defines its flags on absl's FLAGS when loaded, so it is loaded once per process, as the module "eval_cli"
# (tests/test_docs.py parses the documented eval.py commands with it).
EVAL = sys.modules.get("eval_cli")
if EVAL is None:
    _spec = importlib.util.spec_from_file_location("eval_cli", ROOT / "eval.py")
    EVAL = sys.modules["eval_cli"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(EVAL)


def test_partial_evaluation_writes_its_own_file_and_says_how_much(workdir, capsys):
    out = run_eval(capsys, f"--workdir={workdir}", "--max_batches=1")
    line = json.loads(out.splitlines()[0])
    assert line["max_batches"] == 1 and line["evaluated_batches"] == 1 and line["tokens"] > 0
    assert line["bits_per_byte"] == pytest.approx(line["bits_per_char"])  # ASCII text: one byte per character
    assert (workdir / "eval_validation_max1batches.json").exists() and not (workdir / "eval_validation.json").exists()
    assert any(row.split() == ["evaluated_batches", "1"] for row in out.splitlines()[1:])  # the table


def test_generate_does_not_score_the_split(workdir, capsys):
    out = run_eval(capsys, f"--workdir={workdir}", "--generate=the ", "--max_new_tokens=5", "--temperature=0")
    assert out.startswith("the ") and not list(workdir.glob("eval_validation.json"))


def test_generate_reads_newline_escapes_and_a_prompt_file(workdir, tmp_path, capsys):
    greedy = ("--max_new_tokens=5", "--temperature=0")
    escaped = run_eval(capsys, f"--workdir={workdir}", r"--generate=the fox.\nthe ", *greedy)
    assert escaped.startswith("the fox.\nthe ") and "\\n" not in escaped  # a newline, not backslash-n
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the fox.\nthe ")
    from_file = run_eval(capsys, f"--workdir={workdir}", f"--prompt_file={prompt}", *greedy)
    assert from_file == escaped  # the same prompt, the same greedy continuation
    with pytest.raises(SystemExit):
        run_eval(capsys, f"--workdir={workdir}", "--generate=the ", f"--prompt_file={prompt}")
    assert "--generate and --prompt_file both give the prompt" in capsys.readouterr().err


def test_fewshot_and_dumped_prompts(workdir, tmp_path, capsys):
    task = tmp_path / "task.jsonl"
    task.write_text(
        "".join(
            json.dumps({"context": c, "choices": [" fox", " dog"], "gold": g}) + "\n"
            for c, g in (("the quick brown", 0), ("the lazy", 1), ("over the lazy", 1))
        )
    )
    dump = tmp_path / "prompts.jsonl"
    out = run_eval(
        capsys,
        f"--workdir={workdir}",
        f"--fewshot={task}",
        f"--fewshot_train={task}",
        "--fewshot_k=0,2",
        "--fewshot_separator=. ",
        f"--dump_prompts={dump}",
    )
    line = json.loads(out.splitlines()[0])
    assert [r["k"] for r in line["fewshot"]] == [0, 2] and all(r["examples"] == 3 for r in line["fewshot"])
    assert line["majority"]["accuracy"] == pytest.approx(2 / 3)
    prompts = [json.loads(x) for x in dump.read_text().splitlines()]
    assert len(prompts) == 6 and prompts[0]["prompt"] == "the quick brown" and prompts[3]["prompt"].count(". ") == 2
    assert (workdir / "eval_fewshot_task.json").exists()


def test_plot_draws_the_event_files_one_png_per_metric_group(workdir, capsys):
    out = run_eval(capsys, f"--workdir={workdir}", "--plot")
    written = {pathlib.Path(p).name for p in out.split()}
    assert written == {"loss.png", "accuracy.png", "schedule.png", "throughput.png", "gradients.png"}
    assert all((workdir / "plots" / name).read_bytes()[:4] == b"\x89PNG" for name in written)


def test_an_objective_without_registered_evaluators_is_refused_by_name():
    class Unscorable(base.Objective):
        name = "unscorable"
        evaluators = ("loss", "mystery")

    with pytest.raises(ValueError, match=r"'mystery'.*objectives it can score: \[.*'causal_lm'"):
        evaluation.check_scorable(Unscorable)
