"""The layering contract (docs/ARCHITECTURE.md): a module imports only from its own layer or below, no import closes
a cycle, and an objective imports no other objective. Every import counts: at module level or inside a function,
absolute or relative. Read from the source, so it cannot grow back."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Bottom to top. A module belongs to the layer of the longest prefix matching its dotted name.
LAYERS = (
    (
        "foundation",
        (
            "lmzoo.storage",
            "lmzoo.sharding",
            "lmzoo.checkpoint",
            "lmzoo.workdir",
            "lmzoo.tokenizers",
            "lmzoo.decoding",
            "lmzoo.metrics",
        ),
    ),
    ("data", ("lmzoo.data",)),
    ("building blocks", ("lmzoo.kernels", "lmzoo.layers")),
    ("models", ("lmzoo.models",)),
    (
        "conversion and rl maths",
        ("lmzoo.convert", "lmzoo.rl"),
    ),
    ("weights and config", ("lmzoo.weights", "lmzoo.config")),
    ("trainers", ("lmzoo.trainers",)),
    # What several objectives share: the protocol and its recipes, losses, the task of each model kind, masking.
    (
        "objective floor",
        ("lmzoo.objectives.base", "lmzoo.objectives.losses", "lmzoo.objectives.tasks", "lmzoo.objectives.masking"),
    ),
    ("objectives", ("lmzoo.objectives",)),
    ("test fixtures", ("lmzoo.testing",)),
    ("evaluation", ("lmzoo.evaluation",)),
    ("run", ("lmzoo.train",)),
    # Command-line tools, and `lmzoo.load`: they read whole runs.
    ("entry points", ("lmzoo.cli", "lmzoo")),
)
# Objectives are walled from each other: each imports only the floor below it, and the registry
# (lmzoo/objectives/__init__.py) imports them all.
WALLED = "lmzoo.objectives"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted((ROOT / "lmzoo").rglob("*.py"))}


def has_code(module: str) -> bool:
    """False for a package whose __init__.py holds only its docstring: importing it imports nothing."""
    body = ast.parse(MODULES[module].read_text()).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body)


def layer_of(module: str) -> int:
    if not has_code(module):
        return 0
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or (prefix != "lmzoo" and module.startswith(prefix + "."))
    ]
    assert matches, f"{module} is in no layer of tests/test_import_layers.py: add it to LAYERS"
    return max(matches)[1]


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The dotted name a `from ... import` names, relative ones (`from . import x`, `from ..y import z`) resolved
    against the package of `module`."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> set[str]:
    """The lmzoo modules `module` imports anywhere in its file (`from lmzoo.x import y` counts lmzoo.x.y when
    that is a module, else lmzoo.x)."""
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lmzoo"))
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.split(".")[0] != "lmzoo":
                continue
            for alias in node.names:
                name = f"{source}.{alias.name}"
                found.add(name if name in MODULES else source)
    found.discard(module)
    return found


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for target in sorted(imports_of(module))
        if target in MODULES and layer_of(target) > layer_of(module)
    ]
    assert not upward, "imports that point up a layer:\n  " + "\n  ".join(upward)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(WALLED + ".")))
def test_objectives_import_no_other_objective(module):
    if LAYERS[layer_of(module)][0] != "objectives":
        return
    sideways = [
        target
        for target in sorted(imports_of(module))
        if target.startswith(WALLED + ".") and LAYERS[layer_of(target)][0] == "objectives"
    ]
    assert not sideways, f"objective {module} imports other objectives {sideways}: move what they share to the floor"


def test_no_import_cycles():
    graph = {m: {t for t in imports_of(m) if t in MODULES and has_code(t)} for m in MODULES}
    visiting, done, cycles = [], set(), []

    def visit(node):
        if node in done:
            return
        if node in visiting:
            cycles.append(" -> ".join(visiting[visiting.index(node) :] + [node]))
            return
        visiting.append(node)
        for target in sorted(graph[node]):
            visit(target)
        visiting.pop()
        done.add(node)

    for module in sorted(graph):
        visit(module)
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_the_contract_catches_an_upward_import(tmp_path, monkeypatch):
    """A model importing an objective is reported (the check itself works)."""
    fake = tmp_path / "gpt2.py"
    fake.write_text("from lmzoo.objectives import causal_lm\n")
    monkeypatch.setitem(MODULES, "lmzoo.models.gpt2", fake)
    with pytest.raises(AssertionError, match="imports lmzoo.objectives.causal_lm"):
        test_imports_point_down("lmzoo.models.gpt2")


def test_the_contract_catches_an_objective_importing_another(tmp_path, monkeypatch):
    fake = tmp_path / "dpo.py"
    fake.write_text("from lmzoo.objectives import base, sft\n")
    monkeypatch.setitem(MODULES, "lmzoo.objectives.dpo", fake)
    with pytest.raises(AssertionError, match=r"imports other objectives \['lmzoo.objectives.sft'\]"):
        test_objectives_import_no_other_objective("lmzoo.objectives.dpo")


def test_the_contract_reads_relative_imports(tmp_path, monkeypatch):
    """A relative import up a layer (a layer module importing a model's file as `from ..models import gpt2`) is
    reported as the absolute one would be."""
    fake = tmp_path / "attention.py"
    fake.write_text("from ..models import gpt2\nfrom . import linears\n")
    monkeypatch.setitem(MODULES, "lmzoo.layers.attention", fake)
    assert imports_of("lmzoo.layers.attention") == {"lmzoo.models.gpt2", "lmzoo.layers.linears"}
    with pytest.raises(AssertionError, match="imports lmzoo.models.gpt2"):
        test_imports_point_down("lmzoo.layers.attention")
