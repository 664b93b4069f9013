"""Problems with checkable answers, the data of RL with verifiable rewards: the rows of a .jsonl(.gz) file whose
first row has a "question" field (GSM8K's form: {"question", "answer"} with the answer's last line `#### 72`) or
rows generated in memory ("synthetic:addition?digits=3&n=4000": `digits`-digit sums, answer the bare number).

Each row becomes a `Problem`: the prompt the policy continues (`config.data.prompt_template` formatted with the
row's fields) and the row itself, which the reward functions read beside the completion (`lmzoo.rl.rewards`)."""

import dataclasses
import re
import urllib.parse

import numpy as np

from lmzoo import storage
from lmzoo.data import sources

SYNTHETIC = "synthetic:"
QUESTION = "question"
SYNTHETIC_TASKS = ("addition",)
_CALCULATION = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations inside worked solutions


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str  # the row formatted by the prompt template
    fields: dict  # the row: "question", "answer", and whatever else the file gives


def holds_problems(raw) -> bool:
    """Whether a split's raw examples are `Problem`s."""
    return bool(raw) and isinstance(raw[0], Problem)


def is_problem_file(path: str) -> bool:
    """A synthetic task, or a .jsonl(.gz) whose first row is an object with a string "question"."""
    if path.startswith(SYNTHETIC):
        return True
    if not storage.path(path).name.endswith((".jsonl", ".jsonl.gz")) or not storage.exists(path):
        return False
    row = sources.first_json_row(path)
    return isinstance(row, dict) and isinstance(row.get(QUESTION), str)


def solution(row: dict) -> str:
    """The worked solution a model is fine-tuned to write: the row's "solution" if it has one (a demonstration that
    may be wrong, "synthetic:...&noise="), else its answer; without GSM8K's calculator annotations."""
    return _CALCULATION.sub("", str(row.get("solution", row.get("answer", ""))))


def format_prompt(template: str, row: dict, index: int = 0) -> str:
    """`template` formatted with the row's fields; an error names the row (`index`, from 0) and the fields it has."""
    try:
        return template.format(**row)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"template {template!r} cannot be formatted with row {index + 1}'s fields {sorted(row)} "
            f"({type(e).__name__}: {e}); name fields as {{question}}"
        ) from None


def synthetic_rows(spec: str) -> list[dict]:
    """The rows of "synthetic:TASK?key=value&...": "addition" (digits, default 2; n rows, default 2000; seed,
    default 0; noise, in percent, default 0): {"question": "12+345", "answer": "357"}, the operands' lengths drawn from
    1..digits; with noise, that share of the rows also carries a wrong "solution" (the sum off by 1 to 9), the
    demonstration SFT learns from, while rewards check "answer": demonstrations with errors, as real ones have."""
    task, _, query = spec.removeprefix(SYNTHETIC).partition("?")
    if task not in SYNTHETIC_TASKS:
        raise ValueError(f"config.data.path={spec!r}: unknown synthetic task {task!r}; choose one of {SYNTHETIC_TASKS}")
    options = {"digits": 2, "n": 2000, "seed": 0, "noise": 0}
    for key, values in urllib.parse.parse_qs(query, strict_parsing=bool(query)).items():
        if key not in options:
            raise ValueError(f"config.data.path={spec!r}: unknown option {key!r}; options: {sorted(options)}")
        try:
            options[key] = int(values[-1])
        except ValueError:
            raise ValueError(f"config.data.path={spec!r}: {key}={values[-1]!r} is not an integer") from None
    if options["digits"] < 1 or options["n"] < 2 or not 0 <= options["noise"] <= 100:
        raise ValueError(f"config.data.path={spec!r}: digits must be >= 1, n >= 2 and noise in 0..100")
    rng = np.random.default_rng(options["seed"])
    rows = []
    for _ in range(options["n"]):
        a, b = (int(rng.integers(0, 10 ** int(rng.integers(1, options["digits"] + 1)))) for _ in range(2))
        row = {QUESTION: f"{a}+{b}", "answer": str(a + b)}
        if options["noise"] and rng.random() * 100 < options["noise"]:
            row["solution"] = str(a + b + int(rng.choice([-1, 1])) * int(rng.integers(1, 10)))
        rows.append(row)
    return rows


def read_rows(path: str) -> list[dict]:
    """The rows of a problems file (local or in a bucket) or synthetic task (see the module docstring), in order;
    every row needs a string "question" and "answer" (errors name the file and line)."""
    if path.startswith(SYNTHETIC):
        return synthetic_rows(path)
    if not storage.exists(path):
        raise FileNotFoundError(f"problems file {path!r} does not exist")
    fix = 'rows are {"question": str, "answer": str} (GSM8K\'s form, the answer ending in "#### N")'
    return sources.read_jsonl(storage.path(path), (QUESTION, "answer"), fix)


def read_problems(path: str, template: str) -> list[Problem]:
    """`read_rows`, each with its prompt: `template` formatted with the row's fields."""
    return [Problem(format_prompt(template, row, i), row) for i, row in enumerate(read_rows(path))]
