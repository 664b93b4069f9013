"""The zoo as a matrix (issue 41): every config file, trained a few steps in its toy variant, then every documented
command that applies to that kind of run. Each command exits 0, or refuses with one line (`error: ...`, exit status
2); none crashes.

The cases come from the registries, so a new config, objective or family is covered without editing this file:
- every configs/*.py file in its toy variant (`test` where it has one, else `tiny`: docs/configs.md), as the file
  sets it (its own few steps and shapes: the train step compiles to the program other tests of the toy variants
  compile, shared through the run's JAX cache), without the end-of-training sample and with one evaluation (of one
  batch) and one checkpoint, settings a resume may change;
- plus each other variant of the file, combined with the toy one, that gives a new (objective, family, model class,
  HF export type): `bert.py:tiny,roberta` (mlm), `hh_ppo.py:tiny,grpo`, `hh_ppo.py:tiny,value_model` (a value
  network), `llama.py:tiny,mistral` (MistralForCausalLM), `sst2.py:tiny,gpt` (a GPT-2 classifier)... Variants that
  exclude the toy one (`ptb_ngram.py:kn3`) or keep a larger model with it (`hh_rm.py:minilm`, the shape of a pretrained
  encoder) are full-size recipes and are left out;
- `test_every_objective_family_and_kind_has_a_case` fails when a registered objective, family or model kind has none.

What a case needs that another command makes is read from its config file's docstring, the command a user runs:
`--config.objective.X=ckpt:runs/NAME` and `--config.data.X=runs/NAME/...` name the run of the config file whose
documented command writes `--workdir=runs/NAME` (trained first, in its toy variant: the PPO chain, the distillation
teacher, the ELMo biLM); a token store (`data.source="store"` without a path) is made by the docstring's
`python -m lmzoo.data.prepare` command from a slice of Tiny Shakespeare; a data file under runs/ by the docstring's
`python scripts/...py --out=...` command.

Which command applies to which kind of run is derived from the code: eval.py scores every objective
(`evaluation.scorable`) and reports what docs/rlhf.md promises for PPO, GRPO, RLOO (score, KL, reply length) and DPO
(its metrics line), equal to the run's own evaluation at its last step (its frozen models read again); `--generate` and `--fewshot` apply to generative models (`models.kinds`: decoders, encoder-decoders,
a PPO policy's decoder), `--reconstruct` to objectives with the `reconstruction` evaluator, export to
`lmzoo.convert.export.EXPORTABLE` families (it may still refuse a config HF cannot express, in one line). Where a
command does not apply it must refuse in one line. Every run loads (`lmzoo.load`), resumes one step further (printing
"resumed from"), and refuses a resume that changes its learning rate in one line, without printing "resumed from".

Commands run in process (eval.py's main as tests/evaluation/test_eval_cli.py runs it, `lmzoo.load`,
`lmzoo.cli.export.export_workdir`, `lmzoo.train.loop.train_and_evaluate`), every run trained once per process and
shared by its commands; `test_entry_points_refuse_in_one_line` runs eval.py and the exporter as processes once. A
command runs once per code path (`Command.path`: e.g. `--generate` once per model, HF type and tokenizer; a resume once
per reader, trainer, frozen models and model), on the first case in CASES that takes it; the others print "as CASE".
A command that fails (KNOWN_BUGS) is an expected failure that must keep failing (strict). Run with -s to see each case's table of outcomes and times.
"""

import ast
import contextlib
import copy
import dataclasses
import functools
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import pytest
from absl import flags

import lmzoo
from lmzoo import config as config_lib
from lmzoo import evaluation, models, objectives
from lmzoo.cli import export as export_cli
from lmzoo.convert import export
from lmzoo.data import problems, readers
from lmzoo.models import kinds
from lmzoo.objectives import ppo
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
SMALL_TEXT = SHARED_DATA / "tinyshakespeare" / "input.txt"  # a token store for a config that trains on one
RLHF_MD = ROOT / "docs" / "rlhf.md"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
TOYS = ("test", "tiny")  # docs/configs.md: "A `tiny` (or `test`) variant is a few steps of a toy-sized model"


def _load_module(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# eval.py defines its flags on absl's FLAGS when loaded, so it is loaded once per process as the module "eval_cli"
# (tests/test_docs.py and tests/evaluation/test_eval_cli.py run it too).
EVAL = sys.modules.get("eval_cli") or _load_module("eval_cli", ROOT / "eval.py")


# --- the cases ------------------------------------------------------------------------------------------------------


def _known_variants(path: pathlib.Path) -> list[str]:
    """The words `check_variants` accepts in configs/NAME.py, in its order (its refusal of an unknown word lists them)."""
    try:
        config_lib.load_config_file(path, "no_such_variant")
    except ValueError as e:
        if "known variants: " in str(e):
            return str(e).split("known variants: ", 1)[1].split(", ")
        raise
    return []  # a file without variants


def _docstring_commands(path: pathlib.Path) -> list[str]:
    """The shell commands of a config file's docstring (lines continued by a trailing backslash joined)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    commands = []
    for line in re.sub(r"\\\n\s*", " ", doc).splitlines():
        if line.strip().startswith("python "):
            commands.append(line.strip())
    return commands


@dataclasses.dataclass(frozen=True)
class Case:
    file: str  # configs/<file>
    variant: str  # the words after ":"
    objective: str
    family: str
    model_class: str
    kind: str | None  # the generating model's kind (`kinds.generative`): a PPO policy's is its decoder's
    hf_type: str | None  # the HF model_type export writes (None: the family has no HF counterpart)

    @property
    def id(self) -> str:
        return f"{self.file.removesuffix('.py')}:{self.variant}" if self.variant else self.file.removesuffix(".py")

    def config(self):
        return config_lib.load_config_file(ROOT / "configs" / self.file, self.variant or None)


def _generating_kind(model) -> str | None:
    inner = getattr(model, "decoder", None)
    if kinds.kind_of(model) is None and kinds.kind_of(inner) == kinds.DECODER:
        return kinds.DECODER  # what `kinds.generative` gives a wrapper (the PPO policy under its value head)
    return kinds.kind_of(model)


def _case(file: str, variant: str) -> Case:
    config = config_lib.load_config_file(ROOT / "configs" / file, variant or None)
    model = objectives.build(config).model()
    hf_type = None
    if config.model_name in export.EXPORTABLE:
        hf_type = export.hf_model_type(config.model_name, models.make_config(config.model_name, config.model.to_dict()))
    return Case(
        file,
        variant,
        config.objective.name,
        config.model_name,
        type(model).__name__,
        _generating_kind(model),
        hf_type,
    )


def _cases() -> list[Case]:
    cases = []
    for path in sorted((ROOT / "configs").glob("*.py")):
        known = _known_variants(path)
        toy = next((t for t in TOYS if t in known), "")
        seen, toy_width = set(), None
        for extra in ["", *(v for v in known if v != toy)]:
            variant = ",".join(w for w in (toy, extra) if w)
            try:
                case = _case(path.name, variant)
            except ValueError as e:
                if "choose one of" in str(e):  # a variant that excludes the toy one: a full-size recipe
                    continue
                raise
            width = case.config().model.get("emb_dim", 0)
            toy_width = width if toy_width is None else toy_width
            if width > toy_width:  # a variant that keeps its own model size (a pretrained shape): not a toy
                continue
            signature = (case.objective, case.family, case.model_class, case.hf_type)
            if signature not in seen:
                seen.add(signature)
                cases.append(case)
    return cases


CASES = _cases()


def _providers() -> dict[str, tuple[str, str]]:
    """runs/NAME -> (config file, its documented variant) of the docstring command that writes it."""
    found = {}
    for path in sorted((ROOT / "configs").glob("*.py")):
        for command in _docstring_commands(path):
            config = re.search(r"--config=configs/(\w+\.py)(?::(\S+))?", command)
            workdir = re.search(r"--workdir=(runs/\S+)", command)
            if config and workdir:
                found.setdefault(workdir.group(1), (config.group(1), config.group(2) or ""))
    return found


def _documented_command(case: Case) -> str | None:
    """The train.py command of the case's docstring that names its extra variant, else the file's first."""
    commands = [
        c for c in _docstring_commands(ROOT / "configs" / case.file) if f"--config=configs/{case.file}" in c
    ] or [c for c in _docstring_commands(ROOT / "configs" / case.file) if c.startswith("python train.py")]
    words = set(case.variant.split(",")) - set(TOYS)
    for command in commands:
        named = re.search(rf"--config=configs/{re.escape(case.file)}:(\S+)", command)
        if named and words & set(named.group(1).split(",")):
            return command
    return commands[0] if commands else None


def _inputs_from_runs(case: Case) -> dict[str, tuple[str, str]]:
    """{config key: (runs/NAME, the value)} of the documented command's `--config.objective.*` and
    `--config.data.*` values that name another run (`ckpt:runs/NAME` or a file under runs/NAME/)."""
    command = _documented_command(case)
    if command is None:
        return {}
    providers, needs = _providers(), {}
    for key, value in re.findall(r"--config\.((?:objective|data)\.[\w.]+)=(\S+)", command):
        for workdir in providers:
            if value in (f"ckpt:{workdir}", workdir) or value.startswith(f"{workdir}/"):
                needs[key] = (workdir, value)
    return needs


def _provider_case(workdir: str) -> Case:
    file, variant = _providers()[workdir]
    same_file = [c for c in CASES if c.file == file]
    words = set(variant.split(",")) - {""}
    return next((c for c in same_file if words <= set(c.variant.split(","))), same_file[0])


# --- training the cases, once per process ---------------------------------------------------------------------------


def _set(config, key: str, value) -> None:
    *sections, field = key.split(".")
    node = config
    for section in sections:
        node = node[section]
    node[field] = value


def _slug(case: Case) -> str:
    return case.id.replace(":", "_").replace(",", "_")


class Runs:
    """Trains each case once (what it reads from other runs first) into a folder of its own; `workdir(case)`."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.trained: dict[str, pathlib.Path] = {}
        self.configs: dict[str, object] = {}
        self.seconds: dict[str, float] = {}

    def documented(self, case: Case):
        """The case's config as documented, with the inputs other commands make: other runs, a token store, a
        script's data file."""
        config = case.config()
        for key, (workdir, value) in _inputs_from_runs(case).items():
            provider = self.workdir(_provider_case(workdir))
            _set(config, key, value.replace(workdir, str(provider), 1))
            if key.startswith("data.tokenizer"):  # the run's ids are the provider's (the same size where documented)
                config.model.vocab_size = run_lib.load_saved(str(provider)).model.vocab_size
        if config.init_from.startswith("ckpt:runs/"):  # a base the config file names: the run its docstring writes
            config.init_from = f"ckpt:{self.workdir(_provider_case(config.init_from.removeprefix('ckpt:')))}"
        if config.data.source == "store" and not config.data.path:
            config.data.path = self._store(case)
        path = config.data.get("path")
        generated = path and path.startswith(problems.SYNTHETIC)  # made in memory (lmzoo.data.problems)
        if path and not generated and not pathlib.Path(path).is_absolute() and not (ROOT / path).exists():
            config.data.path = self._scripted(case, path)
        return config

    def configured(self, case: Case):
        """The config the case trains with (a copy): the documented one, with no end-of-training sample (the
        `generate` command samples), one evaluation and checkpoint."""
        if case.id not in self.configs:
            config = self.documented(case)
            config.train.sample_tokens = 0
            # settings a resume may change: one evaluation (of one batch, as eval.py's) and one checkpoint, at the end
            config.eval.max_batches = 1
            config.train.eval_every = config.train.checkpoint_every = config.train.steps
            self.configs[case.id] = config
        return copy.deepcopy(self.configs[case.id])

    def workdir(self, case: Case) -> pathlib.Path:
        if case.id not in self.trained:
            began, workdir = time.perf_counter(), self.root / _slug(case)
            with contextlib.redirect_stdout(io.StringIO()):
                loop.train_and_evaluate(self.configured(case), str(workdir))
            self.trained[case.id], self.seconds[case.id] = workdir, time.perf_counter() - began
        return self.trained[case.id]

    def _store(self, case: Case) -> str:
        """The store the docstring's `python -m lmzoo.data.prepare` command makes, from a slice of a small text."""
        from lmzoo.data import prepare

        out = self.root / f"{_slug(case)}-store"
        if out.exists():
            return str(out)
        command = next(c for c in _docstring_commands(ROOT / "configs" / case.file) if "lmzoo.data.prepare" in c)
        kept = [a for a in shlex.split(command)[3:] if a.split("=")[0] in ("--tokenizer", "--tokenizer_path")]
        kept = [
            f"--tokenizer_path={ROOT / a.split('=', 1)[1]}" if a.startswith("--tokenizer_path=") else a for a in kept
        ]
        text = self.root / f"{_slug(case)}-text.txt"
        text.write_text(SMALL_TEXT.read_text(encoding="utf-8")[:100_000], encoding="utf-8")
        argv = [f"--source={text}", f"--out={out}", *kept, "--validation_fraction=0.1", "--workers=1"]
        with contextlib.redirect_stdout(io.StringIO()):
            assert prepare.main(argv) == 0, f"python -m lmzoo.data.prepare {' '.join(argv)} failed"
        return str(out)

    def _scripted(self, case: Case, path: str) -> str:
        """A data file under runs/ made by the docstring's `python scripts/S.py --out=DIR` command, into a folder here."""
        for command in _docstring_commands(ROOT / "configs" / case.file):
            out = re.search(r"--out=(\S+)", command)
            if command.startswith("python scripts/") and out and path.startswith(out.group(1) + "/"):
                folder = self.root / f"{_slug(case)}-data"
                if not folder.exists():
                    argv = [sys.executable, *shlex.split(command)[1:]]
                    argv = [f"--out={folder}" if a.startswith("--out=") else a for a in argv]
                    subprocess.run(argv, check=True, capture_output=True, cwd=ROOT, env=ENV, timeout=120)
                return str(folder / path.removeprefix(out.group(1) + "/"))
        raise AssertionError(f"{case.id}: config.data.path={path!r} does not exist and no documented command makes it")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not SHARED_DATA.is_dir():
        pytest.skip("needs ../shared/data")
    return Runs(tmp_path_factory.mktemp("matrix"))


# --- the commands ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    status: str  # "ok", "refused" (exit status 2, one `error:` line) or "crashed"
    detail: str  # the refusal, or what went wrong
    out: str  # stdout
    seconds: float
    value: object = None


def _outcome(call: Callable[[], object], *, one_line: bool = True) -> Outcome:
    """Runs `call` as an entry point runs it (`run_lib.user_errors`: a user error is `error: ...` and exit status 2).
    one_line=False: the refusal may list its reasons on the lines after its `error:` line (a refused resume names
    each changed field on a line of its own)."""
    out, err, began = io.StringIO(), io.StringIO(), time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), run_lib.user_errors():
            value = call()
    except SystemExit as e:
        error = err.getvalue()
        refusal = error[error.rfind("error: ") :].strip() if "error: " in error else ""
        if e.code == 2 and refusal and (not one_line or "\n" not in refusal) and "Traceback" not in error:
            return Outcome("refused", refusal, out.getvalue(), time.perf_counter() - began)
        detail = f"exit status {e.code}; stderr ends: {error[-1500:]}"
        return Outcome("crashed", detail, out.getvalue(), time.perf_counter() - began)
    except BaseException:
        tail = "".join(traceback.format_exc().splitlines(keepends=True)[-12:])
        return Outcome("crashed", tail, out.getvalue(), time.perf_counter() - began)
    return Outcome("ok", "", out.getvalue(), time.perf_counter() - began, value)


def _eval_py(workdir: pathlib.Path, *args: str) -> Callable[[], None]:
    def call():
        flags.FLAGS.unparse_flags()
        try:
            flags.FLAGS(["eval.py", f"--workdir={workdir}", *args])
            EVAL.main(["eval.py"])
        finally:
            flags.FLAGS.unparse_flags()

    return call


def _json_line(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


@functools.cache
def _dpo_metrics() -> tuple[str, ...]:
    """The metrics docs/rlhf.md lists for DPO ("Metrics: `loss`, ... `logps/rejected`.")."""
    text = RLHF_MD.read_text(encoding="utf-8")
    start = text.index("\nMetrics: ")
    return tuple(re.findall(r"`([\w/]+)`", text[start : text.index(". ", start)]))


def promised_metrics(objective: str) -> tuple[str, ...]:
    """What eval.py reports by docs/rlhf.md ("Watching and evaluating": "the mean normalised score, the KL to the
    SFT policy, and the reply length") for the policy-gradient objectives, and DPO's metrics."""
    if issubclass(objectives.get(objective), ppo.PPO):
        return ("score", "kl", "response_len")
    if objective == "dpo":
        return _dpo_metrics()
    return ("loss",)


FEWSHOT = [
    {"context": "the king", "choices": [" is", " was"], "gold": 0},
    {"context": "and the", "choices": [" lord", " king"], "gold": 1},
    {"context": "a man", "choices": [" of", " and"], "gold": 0},
]


def _fewshot_files(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    task, train = folder / "task.jsonl", folder / "train.jsonl"
    if not task.exists():
        lines = "".join(json.dumps(e) + "\n" for e in FEWSHOT)
        task.write_text(lines)
        train.write_text(lines)
    return task, train


def _tokenizer_kind(case: Case) -> str:
    config = case.config()
    return "store" if config.data.source == "store" else config.data.tokenizer.kind


@dataclasses.dataclass(frozen=True)
class Command:
    """A documented command: whether it applies to a case (then it must exit 0; else exit 0 or refuse in one line),
    and what makes two cases run the same code path (it runs on the first case of each, in CASES order)."""

    applies: Callable[[Case], bool]
    path: Callable[[Case], tuple]
    one_line: bool = True


def _generative(case: Case) -> bool:
    return case.kind in (kinds.DECODER, kinds.ENCODER_DECODER)


def _owner(case: Case, attribute: str) -> str:
    """The class of the case's objective that defines `attribute` (its own trainer, its frozen models...)."""
    return next(k.__name__ for k in objectives.get(case.objective).__mro__ if attribute in vars(k))


def _scored(case: Case) -> tuple:
    """What eval.py's scoring of a run depends on: the objective (its evaluators) and the model."""
    return (case.objective, case.family, case.model_class)


def _model(case: Case) -> tuple:
    """What sampling, scoring continuations and export depend on: the model (its class and the choices of its config,
    the str and bool fields: positions, norms, biases...; not its sizes), its HF form and the tokenizer."""
    config = case.config()
    choices = tuple(sorted((k, v) for k, v in config.model.items() if isinstance(v, str | bool)))
    return (case.family, case.model_class, choices, case.hf_type, _tokenizer_kind(case))


def _objective_and_model(case: Case) -> tuple:
    """What reading a run's params (load, export) and reconstruction (beam search) depend on: the objective (which
    params it trains) and the model."""
    return (case.objective, *_model(case))


def _restored(case: Case) -> tuple:
    """What a resume depends on: how the objective reads its data, trains and reads frozen models, and the model."""
    reader = next(n for n, v in vars(readers).items() if v is objectives.get(case.objective).reader)
    return (reader, _owner(case, "trainer"), _owner(case, "frozen_roles"), case.family, case.model_class)


COMMANDS = {
    "eval": Command(lambda c: evaluation.scorable(objectives.get(c.objective)), _scored),
    "generate": Command(_generative, _model),
    "fewshot": Command(_generative, _model),
    "reconstruct": Command(lambda c: "reconstruction" in objectives.get(c.objective).evaluators, _objective_and_model),
    "load": Command(lambda c: True, _objective_and_model),
    # an exportable family may still refuse a config HF cannot express (docs/convert.md): in one line
    "export": Command(lambda c: False, _objective_and_model),
    "resume_refused": Command(lambda c: False, lambda c: (_owner(c, "frozen_roles"), c.kind), one_line=False),
    # a counted model reads each training sentence once: extending its run is refused (in one line)
    "resume": Command(lambda c: c.kind != kinds.COUNTED, _restored),
}


def _first_of_each_path() -> dict[str, dict[tuple, str]]:
    """command -> {code path: the id of the first case that takes it}."""
    first = {name: {} for name in COMMANDS}
    for case in CASES:
        for name, command in COMMANDS.items():
            first[name].setdefault(command.path(case), case.id)
    return first


FIRST = _first_of_each_path()


def _calls(case: Case, workdir: pathlib.Path, runs: Runs, steps: int) -> dict[str, Callable]:
    task, train = _fewshot_files(runs.root)

    def resume(**changed):
        def call():
            config = runs.configured(case)
            config.train.steps = steps + 1
            for key, value in changed.items():
                _set(config, key, value)
            return loop.train_and_evaluate(config, str(workdir))

        return call

    fewshot = [f"--fewshot={task}", f"--fewshot_train={train}", "--fewshot_k=0,1", "--fewshot_template={context} it"]
    return {
        "eval": _eval_py(workdir, "--max_batches=1"),
        "generate": _eval_py(workdir, "--generate=the ", "--max_new_tokens=4", "--num_samples=2"),
        "fewshot": _eval_py(workdir, *fewshot, "--batch_size=4"),
        "reconstruct": _eval_py(workdir, "--reconstruct=2", "--beam_size=2", "--max_batches=1", "--show=1"),
        "load": lambda: lmzoo.load(str(workdir)),
        "export": lambda: export_cli.export_workdir(str(workdir), str(runs.root / f"{workdir.name}-hf")),
        "resume_refused": resume(**{"optim.learning_rate": 0.123}),
        "resume": resume(),
    }


# Bugs this matrix found that are not fixed yet: (case id, command) -> the bug. A listed command must still fail
# (strict), so a fixed bug fails the test until it is removed from here.
KNOWN_BUGS: dict[tuple[str, str], str] = {}


def _final_validation(workdir: pathlib.Path, steps: int) -> dict:
    """The run's own evaluation at its last step: metrics.jsonl's validation row of that step."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(rows) if r["split"] == "validation" and r["step"] == steps)


def _check(case: Case, name: str, outcome: Outcome, steps: int, workdir: pathlib.Path) -> str | None:
    """What is wrong with a command's outcome, or None."""
    if outcome.status == "crashed":
        return f"crashed:\n{outcome.detail}"
    if COMMANDS[name].applies(case) and outcome.status != "ok":
        return f"applies to this run but refused: {outcome.detail}"
    if outcome.status == "refused":
        if "resumed from" in outcome.out:
            return f"printed 'resumed from' before its refusal: {outcome.detail}"
        if name == "export" and case.hf_type is not None and "HF" not in outcome.detail:
            return f"refused an exportable family without naming what HF lacks: {outcome.detail}"
        return None
    if name == "export" and case.hf_type is None:
        return f"exported family {case.family!r}, which has no HF counterpart (lmzoo.convert.export.EXPORTABLE)"
    try:
        if name == "eval":
            scores = _json_line(outcome.out)
            assert scores["step"] == steps and scores["split"] == "validation", scores
            missing = [k for k in promised_metrics(case.objective) if k not in scores]
            assert not missing, f"it reports no {missing} for objective {case.objective!r}: {sorted(scores)}"
            assert all(math.isfinite(scores[k]) for k in promised_metrics(case.objective)), scores
            # The run evaluated the same batch at its last step: the frozen models read again give its numbers.
            final = _final_validation(workdir, steps)
            for key in ("loss", *promised_metrics(case.objective)):
                assert scores[key] == pytest.approx(final[key], rel=1e-5, abs=1e-6), (key, scores[key], final[key])
        elif name == "generate":
            samples = outcome.out.split("--- sample ")[1:]
            assert len(samples) == 2 and all("\nthe " in s for s in samples), outcome.out
        elif name == "fewshot":
            assert [r["k"] for r in _json_line(outcome.out)["fewshot"]] == [0, 1], outcome.out
        elif name == "reconstruct":
            assert "bleu" in _json_line(outcome.out), outcome.out
        elif name == "load":
            assert outcome.value.step == steps and outcome.value.config.objective.name == case.objective
        elif name == "export":
            folder = pathlib.Path(outcome.value["path"])
            assert outcome.value["step"] == steps, outcome.value
            assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file(), outcome.value
        elif name == "resume_refused":
            return "a resume that changes optim.learning_rate was not refused"
        elif name == "resume":
            assert "resumed from" in outcome.out, outcome.out[-2000:]
    except AssertionError as e:
        return f"exited 0 but {e}"
    return None


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_documented_command_on_a_trained_run(case, runs):
    problems, rows = [], []
    workdir = runs.workdir(case)
    steps = max(int(name) for name in os.listdir(workdir / "checkpoints") if name.isdigit())
    for name, call in _calls(case, workdir, runs, steps).items():
        first = FIRST[name][COMMANDS[name].path(case)]
        if first != case.id:
            rows.append(f"  {name:15s} as {first}")
            continue
        outcome = _outcome(call, one_line=COMMANDS[name].one_line)
        problem = _check(case, name, outcome, steps, workdir)
        rows.append(f"  {name:15s} {outcome.status:8s} {outcome.seconds:5.1f}s {outcome.detail[:110]!r}")
        bug = KNOWN_BUGS.get((case.id, name))
        if bug and problem is None:
            problems.append(f"{name}: passes now; remove it from KNOWN_BUGS ({bug})")
        elif problem and not bug:
            problems.append(f"{name} {problem}")
    trained = runs.seconds.get(case.id, 0.0)
    print(
        f"\n{case.id} ({case.objective}, {case.family}, {case.model_class}): trained in {trained:.1f}s", *rows, sep="\n"
    )
    assert not problems, f"{case.id}:\n" + "\n".join(problems)
    bugs = [bug for key, bug in KNOWN_BUGS.items() if key[0] == case.id]
    if bugs:
        pytest.xfail("; ".join(bugs))


def test_every_objective_family_and_kind_has_a_case():
    """A registered objective or family (lmzoo's own, not one a test registers) without a config that trains it
    fails here: add a config file (with a `tiny` variant) or a variant for it."""
    registered = {n for n, o in objectives.REGISTRY.items() if o.__module__.startswith("lmzoo.")}
    covered = {c.objective for c in CASES}
    assert registered <= covered, f"objectives without a case: {sorted(registered - covered)}"
    assert set(models.REGISTRY) <= {c.family for c in CASES}, sorted(set(models.REGISTRY) - {c.family for c in CASES})
    declared = {v for k, v in vars(kinds).items() if k.isupper() and isinstance(v, str)}
    assert declared <= {c.kind for c in CASES}, sorted(declared - {c.kind for c in CASES})
    assert {c.file for c in CASES} == {p.name for p in (ROOT / "configs").glob("*.py")}
    for name, command in COMMANDS.items():  # every command runs somewhere where it applies
        assert any(command.applies(c) for c in CASES) or name in ("export", "resume_refused"), name


@pytest.mark.slow  # subprocesses
def test_entry_points_refuse_in_one_line(runs, tmp_path):
    """`python eval.py --generate` on a run that cannot generate and `python -m lmzoo.cli.export` on a family HF has no
    counterpart for: exit status 2 and one `error:` line, no traceback."""
    case = next(c for c in CASES if not _generative(c) and c.hf_type is None)
    workdir = runs.workdir(case)
    for argv in (
        ["eval.py", f"--workdir={workdir}", "--generate=the", "--max_new_tokens=2"],
        ["-m", "lmzoo.cli.export", f"--workdir={workdir}", f"--out={tmp_path / 'hf'}"],
    ):
        result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and "Traceback" not in result.stderr, (argv, result.stderr[-3000:])
        assert lines[-1].startswith("error: ") and "resumed from" not in result.stdout, (argv, result.stderr[-3000:])


def test_the_chain_inputs_come_from_documented_commands():
    """The cases that read another run get it from their docstring's command (so the matrix trains the chain)."""
    needs = {c.id: sorted(_inputs_from_runs(c)) for c in CASES}
    assert needs["hh_ppo:tiny"] == ["objective.reward_model", "objective.sft"]
    assert needs["distilbert:tiny"] == ["objective.teacher"]
    assert needs["sst2_elmo:tiny"] == ["data.tokenizer.path", "objective.bilm"]
    assert needs["default:tiny"] == needs["t5:test"] == []
