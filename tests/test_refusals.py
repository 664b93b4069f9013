"""The weak inputs of issue 41's sweep, run as a user runs them: each is refused with one `error:` line naming the fix
that works, exit status 2, no traceback, and a refused resume prints no "resumed from" first.

One 2-step run on a token store serves the train.py and eval.py cases; the prepare cases need no run."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from lmzoo import config as config_lib
from lmzoo import tokenizers
from lmzoo.data import prepare, sources

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
PARAGRAPHS = "\n\n".join(f"def step_{i}(state):\n    return state + {i} * {i % 7}" for i in range(400))


def run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python <argv>` from the repository, as a user runs it (killed after `timeout` seconds)."""
    command = [sys.executable, *argv]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=timeout)


def error_line(result: subprocess.CompletedProcess) -> str:
    """The `error:` line of a refusal (exit status 2, no traceback), the last line of stderr but for the changes a
    config-change refusal lists after it."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "\nerror: " in "\n" + result.stderr, result.stderr
    return result.stderr[result.stderr.find("error: ") :].splitlines()[0]


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def prepare_store(folder: pathlib.Path, tokenizer: tokenizers.Tokenizer) -> None:
    (folder.parent / "corpus.txt").write_text(PARAGRAPHS)
    source = sources.FileCorpus((folder.parent / "corpus.txt",), unit="paragraph", validation_fraction=0.1)
    prepare.prepare(source, tokenizer, folder, progress=False)


def train_flags(store: pathlib.Path, workdir: pathlib.Path) -> list[str]:
    return [
        "train.py", "--config=configs/default.py:tiny", "--config.train.steps=2", "--config.data.source=store",
        f"--config.data.path={store}", f"--workdir={workdir}",
    ]  # fmt: skip


def train_on_a_store(tmp: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(store, workdir) of a 2-step run of configs/default.py:tiny on a byte-level store."""
    store, workdir = tmp / "store", tmp / "run"
    prepare_store(store, tokenizers.ByteTokenizer())
    trained = run(*train_flags(store, workdir))
    assert trained.returncode == 0, trained.stderr
    return store, workdir


@pytest.fixture(scope="module")
def store_run(tmp_path_factory):
    return train_on_a_store(tmp_path_factory.mktemp("refusals"))


def test_a_resume_refused_for_a_changed_config_prints_no_resumed_from(store_run):
    store, workdir = store_run
    before = snapshot(workdir)
    result = run(*train_flags(store, workdir), "--config.optim.learning_rate=0.5")
    assert "holds checkpoints up to step 2 of a run whose config differs" in error_line(result)
    assert "  optim.learning_rate: " in result.stderr
    assert "; to resume, drop the override(s) --config.optim.learning_rate (config.json" in result.stderr
    assert "resumed from" not in result.stdout + result.stderr
    assert snapshot(workdir) == before


def test_a_refused_resume_advises_dropping_only_the_overrides_it_was_given(tmp_path):
    """Issue 55: a change that comes from the config file, not from an override, is not "dropped"."""
    (tmp_path / "config.json").write_text(config_lib.base_config().to_json_best_effort())
    config = config_lib.base_config()
    config.optim.learning_rate, config.optim.warmup_steps = 0.5, 7

    def refusal(command_line) -> str:
        with pytest.raises(ValueError) as raised:
            config_lib.check_resume(config, 10, tmp_path, command_line)
        return str(raised.value).splitlines()[-1]

    assert refusal(()) == (
        f"To train with these settings, pass a new --workdir (e.g. --workdir={tmp_path}_2); to resume, set "
        "optim.learning_rate, optim.warmup_steps back to the run's value(s) (config.json in the workdir holds the "
        "run's config)."
    )
    assert "to resume, drop the override(s) --config.optim.learning_rate and set optim.warmup_steps back" in refusal(
        {"optim.learning_rate"}
    )


def test_a_resume_on_a_store_of_another_tokenizer_names_data_path(tmp_path):
    store, workdir = train_on_a_store(tmp_path)
    shutil.rmtree(store)  # and prepared again, at the same path, with another tokenizer
    prepare_store(store, tokenizers.CharTokenizer("".join(sorted(set(PARAGRAPHS)))))
    before = snapshot(workdir)
    result = run(*train_flags(store, workdir), "--config.train.steps=4")
    line = error_line(result)
    assert f"store {store} was written by another tokenizer" in line and "point config.data.path" in line, line
    assert f"prepare it again at {store}" in line and "config.data.tokenizer" not in line, line
    assert "resumed from" not in result.stdout + result.stderr
    assert snapshot(workdir) == before


def test_generating_more_than_eval_py_bounds_is_refused_before_any_work(store_run):
    _, workdir = store_run
    result = run("eval.py", f"--workdir={workdir}", "--generate=def ", "--max_new_tokens=100000000", timeout=60)
    assert error_line(result) == (
        "error: --max_new_tokens=100000000: ask for 1 to 100,000 new tokens (eval.py's bound, so that a mistyped "
        "count does not sample for hours)"
    )


def test_top_k_above_the_vocabulary_names_its_size(store_run):
    _, workdir = store_run
    result = run("eval.py", f"--workdir={workdir}", "--generate=def ", "--top_k=100000")
    vocab = tokenizers.ByteTokenizer().vocab_size
    assert error_line(result) == (
        f"error: --top_k=100000: the run's vocabulary has {vocab} tokens; pass at most {vocab} (0 keeps every token)"
    )


def test_prepare_on_rows_without_the_field_names_the_flag_and_leaves_no_folder(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"body": "first"}\n{"body": "second"}\n')
    out = tmp_path / "store"
    command = ["-m", "lmzoo.data.prepare", f"--source={tmp_path / 'rows.jsonl'}", f"--out={out}", "--workers=1"]
    assert error_line(run(*command)) == (
        f"error: {tmp_path / 'rows.jsonl'}: line 1 has no field 'text' (it has ['body']); pass --text_field=NAME, "
        "the field that holds the text"
    )
    assert not out.exists()  # so the corrected command finds no partial store of another source in its way
    corrected = run(*command, "--text_field=body")
    assert corrected.returncode == 0, corrected.stderr


def test_prepare_under_a_file_size_limit_is_one_line(tmp_path):
    limit = 16 << 10  # bytes; the first shard's tokens (~37 KB) pass it
    (tmp_path / "corpus.txt").write_text(PARAGRAPHS)
    out = tmp_path / "store"
    command = [
        "-m", "lmzoo.data.prepare", f"--source={tmp_path / 'corpus.txt'}", f"--out={out}", "--workers=1",
        "--document_unit=paragraph", "--chunk_documents=16",
    ]  # fmt: skip

    def limited(*flags: str) -> subprocess.CompletedProcess:
        """`python <command> <flags>` under `ulimit -f` (bash counts it in KiB), as a user's shell would run it."""
        shell = ["bash", "-c", f'ulimit -f {limit >> 10} && exec "$@"', "bash", sys.executable, *command, *flags]
        return subprocess.run(shell, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)

    line = error_line(limited())
    assert line.startswith(f"error: a file-size limit of {limit:,} bytes (ulimit -f) stopped writing store {out};")
    assert "raise the limit (ulimit -f unlimited) and run the same command to resume" in line, line
    assert not out.exists()
    # The other fix it names: shards small enough to fit.
    smaller = limited("--shard_tokens=2000")
    assert smaller.returncode == 0, smaller.stderr
