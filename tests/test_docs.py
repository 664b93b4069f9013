"""Docs that cannot drift (issue 41).

1. The registries against README.md and docs/configs.md: every registered objective, model family, data source and
   tokenizer kind is in their lists, and nothing else is; docs/configs.md's table names every configs/*.py file
   with exactly the variants its `check_variants` knows; every field of the config's fixed sections is named in
   docs/configs.md, and every `section.field` the two files name exists; docs/evaluate.md's table has a row for
   every objective. (And the toy variants print no decay_steps note.)
2. Every shell command in README.md and docs/*.md that starts with `python train.py`, `python eval.py` or
   `python -m lmzoo` parses: train.py's flags and config go through `--dry_run`'s checks (in process, nothing read or
   written), eval.py's flags through its absl flags, a module's flags must appear in its `--help`. How a documented
   command is read (PLACEHOLDER RULES):
   - `...` as an argument stands for more flags and is dropped; `[--flag=X]` (optional) is checked as `--flag=X`;
   - a value written as an upper-case placeholder (`--step=N`, `--config.train.seed=N`) stands for any value: only
     the flag's name is checked;
   - a command quoted inside another (gcloud's `--command="cd ~/lmzoo && python train.py ..."`) ends before the
     outer command's closing quote;
   - a shell expansion inside a value (`hf:$MINILM`, `hf:$(python -c ...)`) is kept as literal text, and a
     whole-argument `$VAR` (flags in a variable) is dropped;
   - `--config=configs/my_run.py` is the file docs/configs.md's "Writing a config file" writes: its snippet;
   - without ../shared/data (a fresh clone), a command whose dry run fails on a missing file under it is skipped,
     as the other tests that read it are;
   - a module whose `--help` fails on a missing optional dependency (lm-eval: requirements-test.txt) is skipped;
   - INPUT RULE: the dry run's check of the data and tokenizer a command reads (`run.check_inputs`) may refuse inputs
     that are the user's or an earlier command's output: a refusal there passes where the command has a placeholder
     or the refusal names a path that is not on this machine (`../shared/data` is read from where the repository's
     sibling has it).

3. docs/RESULTS.md stays a file of tables a user can read (RESULTS RULES):
   - it holds at most 400 lines (investigations, methods and history go to docs/notes/, one file per topic);
   - a table is a run of lines starting with `|` whose second line is a delimiter row (`|---|...`); its window is
     the lines after the nearest heading or table above it, through its own last line. In its window every table has
     a command: a code line (indented 4 spaces outside a table, or inside a ``` fence) or an inline code span that
     runs `python`, `python3`, `pytest` or `bash` (the word, e.g. `python bench/x.py`, `venv-trl/bin/python ...`,
     `PYTHONPATH=... python3 ...`); a date (YYYY-MM-DD); and a machine: "AMD EPYC" or "Intel Xeon" (the 2-core CPU machines RESULTS'
     header describes) or "H100" / "H200" (a device row);
   - every relative link or image in RESULTS.md and in docs/notes/*.md resolves: its file or folder exists, and its
     `#anchor` is a heading of that markdown file under GitHub's rule (lower-cased, punctuation but `-` and `_` dropped,
     spaces to `-`, `-1`, `-2`, ... for repeats); and so does every link into RESULTS.md#ANCHOR from README.md,
     docs/*.md and docs/notes/*.md (headings other docs link to keep their names).
   The commands of docs/notes/*.md are checked as those of docs/*.md (2.).

And eval.py's reading of escapes in --generate (with --prompt_file on a trained run in
tests/evaluation/test_eval_cli.py).
"""

import ast
import functools
import importlib.util
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from absl import flags

from lmzoo import config as config_lib
from lmzoo import models, objectives
from lmzoo.data import sources
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIGS_MD = ROOT / "docs" / "configs.md"
EVALUATE_MD = ROOT / "docs" / "evaluate.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "notes").glob("*.md"))]
SHARED_DATA = ROOT.parent / "shared" / "data"


def _load(name: str, path: pathlib.Path):
    """The script at `path` as module `name`, registered in sys.modules (absl names the module defining a flag)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAIN = _load("train_docs", ROOT / "train.py")  # defines its flags only when asked (define_flags)
# eval.py defines its flags on absl's FLAGS when loaded, so it is loaded once per process, as the module "eval_cli"
# (tests/evaluation/test_eval_cli.py runs it).
EVAL = sys.modules.get("eval_cli") or _load("eval_cli", ROOT / "eval.py")


def _text(path: pathlib.Path) -> str:
    return path.read_text(encoding="utf-8")


def _named(text: str) -> set[str]:
    """The names a passage lists: its backticked bare identifiers (`gpt2`, `causal_lm`; not `data.path` or `a b`)."""
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", text))


def _passage(text: str, start: str, end: str) -> str:
    assert text.count(start) == 1, f"the docs should hold {start!r} once, where this test reads a list"
    begin = text.index(start) + len(start)
    return text[begin : text.index(end, begin)]


# --- 1. registries ------------------------------------------------------------------------------------------------


def _data_sources() -> set[str]:
    """The config.data.source values: those source_from_config reads, and `store`, as its refusal lists them."""
    data = config_lib.base_config().data
    with data.unlocked():
        data.source = "no_such_source"
    with pytest.raises(ValueError, match="choose") as refusal:
        sources.source_from_config(data)
    return set(re.findall(r"'(\w+)'", str(refusal.value))) - {"no_such_source"}


def _lmzoo_objectives() -> set[str]:
    """The objectives lmzoo registers (tests register toy ones of their own in the same process:
    tests/train/test_trainers.py)."""
    return {name for name, cls in objectives.REGISTRY.items() if cls.__module__.startswith("lmzoo.")}


REGISTRIES = {
    "objectives": lambda: _lmzoo_objectives(),
    "families": lambda: set(models.REGISTRY),
    "data sources": _data_sources,
    "tokenizer kinds": lambda: set(config_lib.TOKENIZER_KINDS),
}

# (file, the text before the list, the text after it, registry)
LISTS = [
    (README, "`python train.py --objectives` lists each with its fields and defaults:", ". A config's", "objectives"),
    (CONFIGS_MD, "The objectives are", ". `tests/test_docs.py`", "objectives"),
    (README, "Model families:", ". Objectives are registered", "families"),
    (CONFIGS_MD, "the family, one of", "; and every field", "families"),
    (README, "Data sources (`config.data.source`):", "A config naming raw text", "data sources"),
    (CONFIGS_MD, "| `data.source` |", "\n", "data sources"),
    (README, "Tokenizers: ", "`char` and `word` take", "tokenizer kinds"),
    (CONFIGS_MD, "| `data.tokenizer` |", "\n", "tokenizer kinds"),
]


@pytest.mark.parametrize(
    "path, start, end, registry", LISTS, ids=[f"{p.name}-{r.replace(' ', '_')}" for p, _, _, r in LISTS]
)
def test_each_list_names_exactly_the_registered(path, start, end, registry):
    named, registered = _named(_passage(_text(path), start, end)), REGISTRIES[registry]()
    assert named == registered, (
        f"{path.name}'s list of {registry} after {start!r}: add {sorted(registered - named)}, "
        f"remove {sorted(named - registered)} (registered: {sorted(registered)})"
    )


def _known_variants(path: pathlib.Path) -> set[str]:
    """The words `check_variants` accepts in configs/NAME.py, as its refusal of an unknown word lists them."""
    with pytest.raises(ValueError, match="known variants: ") as refusal:
        config_lib.load_config_file(path, "no_such_variant")
    return set(str(refusal.value).split("known variants: ", 1)[1].split(", "))


def _variant_table() -> dict[str, str]:
    """docs/configs.md's table of config files: file name -> its variants cell."""
    rows = re.findall(r"^\| `(\w+\.py)` \| .*? \| (.*) \|$", _text(CONFIGS_MD), flags=re.M)
    assert rows, "docs/configs.md has no table of config files"
    return dict(rows)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.py")), ids=lambda p: p.name)
def test_configs_md_lists_each_config_file_with_exactly_its_variants(path):
    table = _variant_table()
    assert path.name in table, f"docs/configs.md's table of config files has no row for `{path.name}`"
    documented, known = _named(table[path.name]), _known_variants(path)
    assert documented == known, (
        f"docs/configs.md's row of `{path.name}`: add {sorted(known - documented)}, remove "
        f"{sorted(documented - known)} (check_variants knows {sorted(known)})"
    )


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.py")), ids=lambda p: p.name)
def test_toy_variants_end_their_schedule_with_the_run(path):
    """A `tiny` / `test` variant decays its learning rate over its own steps, so its run prints no note that
    optim.decay_steps and train.steps differ (lmzoo.train.loop.start_summary)."""
    for variant in sorted(_known_variants(path) & {"tiny", "test"}):
        config = config_lib.load_config_file(path, variant)
        assert config.optim.decay_steps == config.train.steps, (
            f"{path.name}:{variant}: optim.decay_steps={config.optim.decay_steps}, train.steps={config.train.steps}"
        )


def test_configs_md_table_names_no_missing_config_file():
    missing = sorted(name for name in _variant_table() if not (ROOT / "configs" / name).is_file())
    assert not missing, f"docs/configs.md's table names config files that do not exist: {missing}"


FREE_SECTIONS = ("model", "objective")  # their fields are the family's / the objective's


def _sections_table() -> dict[str, str]:
    """docs/configs.md's "Sections" table: each name of its first column -> the row's second column."""
    rows = re.findall(r"^\| (`[^|]*`) \| (.*) \|$", _passage(_text(CONFIGS_MD), "## Sections", "\n## "), flags=re.M)
    return {name: fields for names, fields in rows for name in re.findall(r"`(\w+)`", names)}


def test_configs_md_names_every_config_field():
    base, table, text = config_lib.base_config(), _sections_table(), _text(CONFIGS_MD)
    missing = [key for key in base if key not in table]
    for section in (k for k, v in base.items() if hasattr(v, "items") and k not in FREE_SECTIONS):
        for field in base[section]:
            in_row = f"`{field}`" in table.get(section, "")
            if not in_row and not re.search(rf"`(?:--)?(?:config\.)?{section}\.{field}\b", text):
                missing.append(f"{section}.{field}")
    assert not missing, f"docs/configs.md's Sections names no {missing}: document each (its row, or `section.field`)"


def _fields_of(section: str) -> set[str]:
    if section == "model":
        return {f for config_cls, _ in models.REGISTRY.values() for f in config_cls.__dataclass_fields__}
    if section == "objective":
        return {"name", *(f for name in _lmzoo_objectives() for f in objectives.defaults(name))}
    return set(config_lib.base_config()[section])


@pytest.mark.parametrize("path", [README, CONFIGS_MD], ids=lambda p: p.name)
def test_every_section_field_named_exists(path):
    """`[--][config.]SECTION.FIELD` in backticks names a field, except file names (`train.py`, `data.json`) and the
    misspelled keys of a line that shows their refusal ("unknown config key")."""
    sections = [k for k, v in config_lib.base_config().items() if hasattr(v, "items")]
    pattern = rf"`(?:--)?(?:config\.)?({'|'.join(sections)})\.(?!(?:py|md|json|jsonl|txt)\b)(\w+)"
    lines = [line for line in _text(path).splitlines() if "unknown config key" not in line]
    named = {(s, f) for line in lines for s, f in re.findall(pattern, line)}
    unknown = sorted(f"{s}.{f}" for s, f in named if f not in _fields_of(s))
    assert not unknown, f"{path.name} names config fields that do not exist: {unknown}"


def test_evaluate_md_has_a_row_for_each_objective():
    rows = re.findall(r"^\| (`[^|]*`) \| ", _passage(_text(EVALUATE_MD), "| objective |", "\n\n"), flags=re.M)
    named, registered = set().union(*(_named(r) for r in rows)), _lmzoo_objectives()
    assert named == registered, (
        f"docs/evaluate.md's table of what eval.py reports: add rows for {sorted(registered - named)}, "
        f"remove {sorted(named - registered)}"
    )


# --- 2. documented commands -----------------------------------------------------------------------------------------

PREFIXES = ("python train.py", "python eval.py", "python -m lmzoo")


def _commands(prefixes: tuple[str, ...]) -> list[tuple[str, str]]:
    """(where, command) of every documented command that starts with one of `prefixes`: lines of code blocks
    (continued by a trailing backslash) and inline code spans."""
    found = []
    for path in DOCS:
        text = _text(path)
        lines = text.splitlines()
        for number, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith(prefixes):
                command, index = stripped, number
                while command.endswith("\\") and index + 1 < len(lines):
                    index += 1
                    command = command[:-1] + " " + lines[index].strip()
                found.append((f"{path.name}:{number + 1}", command))
        for span in re.finditer(r"`(python [^`]*)`", text):  # inline, possibly wrapped onto the next line
            if span.group(1).startswith(prefixes):
                number = text.count("\n", 0, span.start()) + 1
                found.append((f"{path.name}:{number}", " ".join(span.group(1).split())))
    return found


COMMANDS = _commands(PREFIXES)
BENCH_COMMANDS = _commands(("python bench/",))


def _without_substitutions(command: str) -> str:
    """`$( ... )` (balanced) replaced by SUBSTITUTED, so that shlex reads the value around it as one word."""
    while "$(" in command:
        start = command.index("$(")
        depth, end = 0, start + 1
        for end in range(start + 1, len(command)):
            depth += {"(": 1, ")": -1}.get(command[end], 0)
            if depth == 0:
                break
        command = command[:start] + "SUBSTITUTED" + command[end + 1 :]
    return command


def _arguments(command: str) -> tuple[list[str], list[str]]:
    """(the command's words, its flags with a placeholder value) after PLACEHOLDER RULES, its comment dropped."""
    optional_read = re.sub(r"\[(-[^\]]*)\]", r"\1", _without_substitutions(command))
    try:
        words = shlex.split(optional_read, comments=True)
    except ValueError:  # "No closing quotation": the outer command's
        words = shlex.split(optional_read.removesuffix('"'), comments=True)
    words = [w for w in words if w != "..." and not re.fullmatch(r"\$\w+", w)]
    placeholders = [w for w in words if re.fullmatch(r"--[\w.]+=[A-Z][A-Z0-9_]*", w)]
    return [w for w in words if w not in placeholders], placeholders


def _my_run_config(tmp_path: pathlib.Path) -> pathlib.Path:
    """configs/my_run.py as docs/configs.md's "Writing a config file" writes it."""
    snippet = _passage(_text(CONFIGS_MD), "## Writing a config file", "`model_section(name, **fields)`")
    code = "\n".join(line[4:] for line in snippet.splitlines() if line.startswith("    "))
    assert "def get_config" in code, "docs/configs.md's 'Writing a config file' has no config snippet"
    path = tmp_path / "my_run.py"
    path.write_text(code + "\n")
    return path


def _train_dry_run(argv: list[str], placeholders: list[str], tmp_path: pathlib.Path) -> None:
    """What `python train.py ARGV --dry_run` checks, in process: train.py's own steps before app.run, its flags on a
    FlagValues of their own, then `dry_run`. `placeholders`: overrides whose keys only are checked."""
    if argv == ["--objectives"]:
        assert objectives.describe()
        return
    argv = [f"--config={_my_run_config(tmp_path)}" if a == "--config=configs/my_run.py" else a for a in argv]
    argv = config_lib.resolve_config_path(argv)
    config_lib.check_overrides([*argv, *placeholders], default=str(ROOT / "configs" / "default.py"))
    flag_values = flags.FlagValues()
    TRAIN.define_flags(flag_values, ["train.py", *argv])
    flag_values(["train.py", *argv])
    TRAIN.dry_run(flag_values.config, flag_values.workdir or TRAIN.default_workdir(argv))


def _eval_parse(argv: list[str], placeholders: list[str]) -> None:
    unknown = [p for p in placeholders if p[2:].split("=")[0] not in flags.FLAGS]
    assert not unknown, f"eval.py has no flag {unknown}"
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["eval.py", *argv])
        assert flags.FLAGS.workdir, "eval.py needs --workdir"
    finally:
        flags.FLAGS.unparse_flags()


@functools.cache
def _module_help(words: tuple[str, ...]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", *words, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    missing = re.search(r"ModuleNotFoundError: No module named '(\w+)", result.stderr)
    if missing and not missing.group(1).startswith("lmzoo"):
        pytest.skip(f"python -m {' '.join(words)} needs {missing.group(1)} (an optional dependency)")
    assert result.returncode == 0, f"python -m {' '.join(words)} --help failed:\n{result.stderr[-2000:]}"
    return result.stdout


def _module_flags(argv: list[str]) -> None:
    """`python -m MODULE [SUBCOMMAND] --flags`: the module runs --help, which lists every flag the doc uses."""
    positional = tuple(a for a in argv[: next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))])
    listed = set(re.findall(r"--[\w-]+", _module_help(positional)))
    used = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    assert used <= listed, f"python -m {' '.join(positional)} has no flag {sorted(used - listed)}"


class _AbsentInput(Exception):
    """A dry run's refusal of a command's inputs (`run.check_inputs`) that are not on this machine (INPUT RULE)."""


def _inputs_checked_where_present(monkeypatch, placeholders: list[str]) -> None:
    """The dry run's `run.check_inputs` under INPUT RULE: its refusal of data or a tokenizer that the command stands
    for by a placeholder, or that names a path absent here, becomes _AbsentInput."""
    check_inputs = run_lib.check_inputs

    def checked(objective, **kwargs):
        try:
            return check_inputs(objective, **kwargs)
        except (ValueError, OSError) as error:
            named = re.findall(r"[^\s'\"(),;:]*/[^\s'\"(),;:]*", str(error))
            if placeholders or any(not pathlib.Path(path).exists() for path in named):
                raise _AbsentInput(error) from None
            raise

    monkeypatch.setattr(run_lib, "check_inputs", checked)


@pytest.mark.parametrize("where, command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_parses(where, command, tmp_path, monkeypatch):
    # A relative --workdir or config path resolves where no run lives, and ../shared/data as from the repository.
    (tmp_path / "repo").mkdir()
    if SHARED_DATA.is_dir():
        (tmp_path / "shared").symlink_to(SHARED_DATA.parent)
    monkeypatch.chdir(tmp_path / "repo")
    words, placeholders = _arguments(command)
    assert words[0] == "python", command
    _inputs_checked_where_present(monkeypatch, placeholders)
    try:
        if words[1] == "train.py":
            _train_dry_run(words[2:], placeholders, tmp_path)
        elif words[1] == "eval.py":
            _eval_parse(words[2:], placeholders)
        else:
            _module_flags(words[2:] + placeholders)
    except _AbsentInput:
        pass  # what it reads is the user's, or an earlier command's output
    except (ValueError, OSError, flags.Error) as error:
        if "shared/data" in str(error) and not SHARED_DATA.is_dir():
            pytest.skip(f"needs ../shared/data: {error}")
        raise AssertionError(f"{where}: `{command}` does not parse: {error}") from None


def test_test_requirements_are_installed_with_the_runtime_ones_in_one_call():
    """Issue 55: requirements-test.txt installed after requirements.txt upgrades botocore past aiobotocore's pin (pip
    check reports it); in one call, as .ci/run installs them, pip resolves both files together."""
    assert "pip install -q -r requirements.txt -r requirements-test.txt" in (ROOT / ".ci" / "run").read_text()
    for doc in DOCS:
        for command in re.findall(r"pip install[^`;&|#\n]*", doc.read_text()):
            if "requirements-test.txt" in command:
                assert "-r requirements.txt" in command, f"{doc.name}: `{command}` installs the test requirements alone"


@pytest.mark.parametrize("script", [["train.py"], ["eval.py"], ["-m", "lmzoo.cli.convert"]], ids=" ".join)
def test_help_prints_the_docstring_as_written_and_exits_0(script):
    """`--help` prints the docstring as it is written (absl %-formats it, so a `%` in it changes the text: issue 55,
    eval.py's "above 5% a note" was printed as "above 5'eval.py' note"), and exits 0."""
    path = ROOT / (script[0] if script[0].endswith(".py") else "lmzoo/cli/convert.py")
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    result = subprocess.run([sys.executable, *script, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert doc.strip() in result.stdout


def test_commands_are_found():
    where = {w.split(":")[0] for w, _ in COMMANDS}
    assert {"README.md", "configs.md", "evaluate.md", "quickstart.md", "rlhf.md"} <= where
    assert len(COMMANDS) > 50


# --- eval.py --generate: escapes and --prompt_file ------------------------------------------------------------------


def test_generate_reads_escapes():
    assert EVAL.read_escapes(r"ROMEO:\nJULIET:\tyes\\no \d") == "ROMEO:\nJULIET:\tyes\\no \\d"
    assert EVAL.read_escapes("no escapes") == "no escapes"


def _loop_values(tree: ast.AST) -> dict[str, list[str]]:
    """name -> the strings a `for name in ("a", "b"):` loop of the module gives it."""
    values: dict[str, list[str]] = {}
    for loop in ast.walk(tree):
        if (
            isinstance(loop, ast.For)
            and isinstance(loop.target, ast.Name)
            and isinstance(loop.iter, ast.Tuple | ast.List)
        ):
            items = [e.value for e in loop.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(items) == len(loop.iter.elts):
                values.setdefault(loop.target.id, []).extend(items)
    return values


def _strings(node: ast.AST, loops: dict[str, list[str]]) -> list[str]:
    """The strings a flag name's expression can be: a constant, or an f-string of constants and loop variables
    (`f"--{side}_env"` in `for side in ("a", "b")`); none for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if not isinstance(node, ast.JoinedStr):
        return []
    names = [""]
    for part in node.values:
        if isinstance(part, ast.Constant):
            names = [n + part.value for n in names]
        elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) and part.value.id in loops:
            names = [n + v for n in names for v in loops[part.value.id]]
        else:
            return []
    return names


def _defined_flags(script: pathlib.Path) -> set[str]:
    """The --flags a script defines, read from its source and bench/common.py's (the parsers benchmarks share):
    argparse's `add_argument("--name", ...)` and absl's `DEFINE_*("name", ...)`, the name a constant or an f-string
    over a loop's constants."""
    flags_found = set()
    for source in (script, ROOT / "bench" / "common.py"):
        tree = ast.parse(source.read_text())
        loops = _loop_values(tree)
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.args):
                continue
            for name in _strings(call.args[0], loops):
                if call.func.attr == "add_argument" and name.startswith("--"):
                    flags_found.add(name)
                elif call.func.attr.startswith("DEFINE_"):
                    flags_found.add(f"--{name}")
    return flags_found


@pytest.mark.parametrize("where, command", BENCH_COMMANDS, ids=[where for where, _ in BENCH_COMMANDS])
def test_documented_bench_command_names_its_script_and_flags(where, command):
    """`python bench/NAME.py --flags` in the docs: the script exists and defines every flag used (benchmarks are run
    by hand, so nothing else would notice a renamed flag)."""
    words, placeholders = _arguments(command)
    script = ROOT / words[1]
    assert script.is_file(), f"{where}: no {words[1]}"
    used = {w.split("=", 1)[0] for w in [*words[2:], *placeholders] if w.startswith("--")}
    missing = used - _defined_flags(script)
    assert not missing, f"{where}: {words[1]} has no flag {sorted(missing)}"


# --- 3. docs/RESULTS.md: tables with their command, machine and date; links that resolve ---------------------------

RESULTS = ROOT / "docs" / "RESULTS.md"
NOTES = sorted((ROOT / "docs" / "notes").glob("*.md"))
RESULTS_MAX_LINES = 400
TABLE_DELIMITER = re.compile(r"^\|(?:\s*:?-+:?\s*\|)+\s*$")
COMMAND = re.compile(r"(?<![\w.-])(?:python3?|pytest|bash)(?![\w.-])")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
MACHINE = re.compile(r"AMD\s+EPYC|Intel\s+Xeon|\bH100\b|\bH200\b")


def _code_lines(lines: list[str]) -> set[int]:
    """Indices of code lines: inside a ``` fence, or indented 4 spaces (not a table row)."""
    code, fenced = set(), False
    for index, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            code.add(index)
        elif fenced or (line.startswith("    ") and line.strip()):
            code.add(index)
    return code


def _results_tables(lines: list[str]) -> list[tuple[int, int, int]]:
    """(window start, table start, table end) of each table of RESULTS, as RESULTS RULES define them (0-based, end
    inclusive)."""
    code, tables, boundary, index = _code_lines(lines), [], 0, 0
    while index < len(lines):
        line = lines[index]
        if index not in code and line.startswith("#"):
            boundary = index + 1
        elif (
            index not in code
            and line.startswith("|")
            and index + 1 < len(lines)
            and TABLE_DELIMITER.match(lines[index + 1].strip())
        ):
            end = index + 1
            while end + 1 < len(lines) and lines[end + 1].startswith("|"):
                end += 1
            tables.append((boundary, index, end))
            boundary, index = end + 1, end
        index += 1
    return tables


def _has_command(lines: list[str], code: set[int], start: int, end: int) -> bool:
    for index in range(start, end + 1):
        if index in code and not lines[index].lstrip().startswith("```") and COMMAND.search(lines[index]):
            return True
    spans = re.findall(r"`([^`]+)`", "\n".join(lines[start : end + 1]))
    return any(COMMAND.search(span) for span in spans)


def test_results_md_is_at_most_400_lines():
    count = len(_text(RESULTS).splitlines())
    assert count <= RESULTS_MAX_LINES, (
        f"docs/RESULTS.md has {count} lines (at most {RESULTS_MAX_LINES}): move investigations, methods and earlier "
        "runs into docs/notes/ (one file per topic, linked from the table), keep the tables"
    )


def test_each_results_table_has_its_command_machine_and_date():
    lines = _text(RESULTS).splitlines()
    code, tables, problems = _code_lines(lines), _results_tables(lines), []
    assert len(tables) >= 25, f"docs/RESULTS.md: only {len(tables)} tables found; is the table rule still right?"
    for start, first, end in tables:
        window = "\n".join(lines[start : end + 1])
        missing = [
            what
            for what, ok in (
                ("a command (python/pytest/bash in a code line or span)", _has_command(lines, code, start, end)),
                ("a date (YYYY-MM-DD)", DATE.search(window)),
                ("a machine (AMD EPYC, Intel Xeon, H100 or H200)", MACHINE.search(window)),
            )
            if not ok
        ]
        if missing:
            problems.append(f"RESULTS.md:{first + 1} ({lines[first][:60]}...): no {', no '.join(missing)}")
    assert not problems, "tables of docs/RESULTS.md lack, above them or in them:\n" + "\n".join(problems)


def test_results_table_rule_on_an_example():
    """The window of a table ends at the table above it: a command above that table does not count for the next."""
    lines = [
        "## A",
        "    python train.py   # AMD EPYC, 2026-11-27",
        "",
        "| a | b |",
        "|---|---|",
        "| 1 | 2 |",
        "",
        "AMD EPYC, 2026-11-27, no command.",
        "",
        "| c | d |",
        "| --- | :-: |",
        "| 3 | `python bench/x.py` on the H200 |",
    ]
    tables = _results_tables(lines)
    assert tables == [(1, 3, 5), (6, 9, 11)]
    code = _code_lines(lines)
    assert _has_command(lines, code, *tables[0][::2]) and _has_command(lines, code, *tables[1][::2])
    assert not _has_command(lines[:9] + ["| c |", "|---|", "| 3 |"], code, 6, 11)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def _anchors(path: pathlib.Path) -> frozenset[str]:
    lines = _text(path).splitlines()
    code, seen, anchors = _code_lines(lines), {}, set()
    for index, line in enumerate(lines):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading and index not in code:
            slug = _slug(heading.group(1))
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return frozenset(anchors)


def _links(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, target) of each markdown link and image of `path` outside code, that is not a URL."""
    lines = _text(path).splitlines()
    code, found = _code_lines(lines), []
    for index, line in enumerate(lines):
        if index in code:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"[a-z]+:", target):
                found.append((index + 1, target))
    return found


def _unresolved(path: pathlib.Path, target: str) -> str | None:
    """Why `target`, a link of the file at `path`, does not resolve; None when it does."""
    file_part, _, anchor = target.partition("#")
    linked = (path.parent / file_part).resolve() if file_part else path
    if not linked.exists():
        return f"no {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked}"
    if anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
        return f"no heading #{anchor} in {linked.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("path", [RESULTS, *NOTES], ids=lambda p: p.name)
def test_results_and_notes_links_resolve(path):
    broken = [
        f"{path.name}:{line} ({target}): {why}" for line, target in _links(path) if (why := _unresolved(path, target))
    ]
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_results_md_links_into_docs_notes():
    """RESULTS points into docs/notes/ (the investigations moved there), and each such link is to a file."""
    into_notes = [t for _, t in _links(RESULTS) if t.startswith("notes/") and t.partition("#")[0] != "notes/"]
    assert len(into_notes) >= 10, f"docs/RESULTS.md links into docs/notes/ only {len(into_notes)} times"
    assert all((RESULTS.parent / t.partition("#")[0]).is_file() for t in into_notes)


@pytest.mark.parametrize("path", [README, *sorted((ROOT / "docs").glob("*.md")), *NOTES], ids=lambda p: p.name)
def test_links_into_results_md_resolve(path):
    broken = [
        f"{path.name}:{line} ({target}): {why}"
        for line, target in _links(path)
        if target.partition("#")[0].endswith("RESULTS.md") and (why := _unresolved(path, target))
    ]
    assert not broken, "links into docs/RESULTS.md that do not resolve:\n" + "\n".join(broken)


def test_slugs_follow_github():
    assert _slug("Object storage: stores, checkpoints and start-up in a bucket (`bench/storage_bench.py`)") == (
        "object-storage-stores-checkpoints-and-start-up-in-a-bucket-benchstorage_benchpy"
    )
    assert _slug("Alignment: SFT -> reward model -> PPO on HH-RLHF") == "alignment-sft---reward-model---ppo-on-hh-rlhf"


def test_defined_flags_reads_flags_made_in_a_loop():
    """bench/step_ab.py defines --a, --b, --a_env, ... as f-strings in `for side in ("a", "b")`."""
    assert {"--a", "--b", "--a_env", "--b_env", "--a_tree", "--b_tree", "--rounds"} <= _defined_flags(
        ROOT / "bench" / "step_ab.py"
    )
