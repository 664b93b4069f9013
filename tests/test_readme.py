"""The README's library snippet runs as written, and its layout section names the library as it is.

LAYOUT RULES (what `test_layout_names_every_library_file_and_nothing_gone` reads): the layout is the first fenced
code block after the `## Layout` heading (before the next `## ` heading).
- An entry starts at column 0; its indented lines below continue it.
- An entry's first word is a path from the repository root. `lmzoo/NAME/` names a package, and with it the package's
  `__init__.py` (the package itself); `lmzoo/NAME.py` names a module.
- Inside a package's entry, every word `FILE.py` (a `.py` name not preceded by `/`, `.` or `*`) names
  `lmzoo/NAME/FILE.py`, a file of that package; so a package's entry mentions no `.py` file of elsewhere. A package
  named by its line alone does not cover its files: each is named.
- An entry whose first word is not under `lmzoo/` lists top-level paths (`configs/ train.py ...`): each word of
  it ending in `/` or `.py` is a path from the root.
The test fails when a `.py` file under lmzoo/ (outside `__pycache__`) is named by no entry, or when a named path
does not exist.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_library_snippet_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python snippet"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["logits"].shape == (1, 5, 258)


def _layout_block(text: str) -> str:
    assert text.count("\n## Layout\n") == 1, "README.md should have one `## Layout` section"
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```[^\n]*\n(.*?)^```", section, flags=re.S | re.M)
    assert block, "README's `## Layout` section has no fenced code block"
    return block.group(1)


def _entries(block: str) -> list[tuple[str, str]]:
    """(first word, the rest of the entry with its continuation lines) of each entry of the layout block."""
    entries: list[list[str]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            assert entries, f"README's layout starts with an indented line: {line!r}"
            entries[-1][1] += " " + line.strip()
        else:
            first, _, rest = line.partition(" ")
            entries.append([first, rest.strip()])
    return [(first, rest) for first, rest in entries]


def layout_paths(text: str) -> set[str]:
    """The paths (from the repository root) README's layout names, read by LAYOUT RULES."""
    named = set()
    for first, rest in _entries(_layout_block(text)):
        if first.startswith("lmzoo/") and first.endswith("/"):
            named.add(first + "__init__.py")
            named.update(first + name for name in re.findall(r"(?<![\w/.*])(\w+\.py)\b", rest))
        elif first.startswith("lmzoo/"):
            named.add(first)
        else:
            named.update(w for w in [first, *rest.split()] if w.endswith(("/", ".py")))
    return named


def _library_files() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "lmzoo").rglob("*.py") if "__pycache__" not in p.parts}


def test_layout_names_every_library_file_and_nothing_gone():
    named = layout_paths(README.read_text(encoding="utf-8"))
    unnamed = sorted(_library_files() - named)
    gone = sorted(p for p in named if not (ROOT / p).exists())
    assert not unnamed, f"README's layout section names no {unnamed}: add each to its package's entry (LAYOUT RULES)"
    assert not gone, f"README's layout section names paths that do not exist: {gone}"


def test_layout_rules_read_an_example():
    """The rules on a made-up layout: a package's files, its `__init__.py`, a module, top-level paths; a `.py` word
    of a description that is not a file name (`configs/*.py`, `a/b.py`) is not read as one of the package."""
    block = (
        "## Layout\n\n```\n"
        "lmzoo/pkg/     one.py (what it does), two.py; configs/*.py\n"
        "               three.py, and x/y.py\n"
        "lmzoo/mod.py   lmzoo.load and more.py\n"
        "configs/ train.py bench/\n"
        "```\n\n## Next\n"
    )
    assert layout_paths("intro\n" + block) == {
        "lmzoo/pkg/__init__.py",
        "lmzoo/pkg/one.py",
        "lmzoo/pkg/two.py",
        "lmzoo/pkg/three.py",
        "lmzoo/mod.py",
        "configs/",
        "train.py",
        "bench/",
    }
