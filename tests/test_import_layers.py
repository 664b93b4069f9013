"""The layering contract (docs/ARCHITECTURE.md): a module imports only from its own layer or below, and no
import, at module level or inside a function, closes a cycle. Read from the source, so it cannot grow back."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Bottom to top. A module belongs to the layer of the longest prefix matching its dotted name.
LAYERS = (
    (
        "foundation",
        ("lmzoo.sharding", "lmzoo.checkpoint", "lmzoo.workdir", "lmzoo.tokenizers", "lmzoo.decoding", "lmzoo.metrics"),
    ),
    ("data", ("lmzoo.data",)),
    ("building blocks", ("lmzoo.kernels", "lmzoo.layers")),
    ("models", ("lmzoo.models",)),
    (
        "conversion and rl maths",
        (
            "lmzoo.convert.mapping",
            "lmzoo.convert.gpt2",
            "lmzoo.convert.bert",
            "lmzoo.convert.seq2seq",
            "lmzoo.convert.llama",
            "lmzoo.convert.hf",
            "lmzoo.rl",
        ),
    ),
    ("weights and config", ("lmzoo.weights", "lmzoo.config")),
    ("trainers", ("lmzoo.trainers",)),
    ("objectives", ("lmzoo.objectives",)),
    ("evaluation", ("lmzoo.evaluation",)),
    ("run", ("lmzoo.train",)),
    # Command-line tools and public entry points inside the package: they load whole runs.
    ("entry points", ("lmzoo.convert.export", "lmzoo.evaluation.harness", "lmzoo.testing", "lmzoo")),
)
PACKAGES_WITHOUT_CODE = ("lmzoo.convert", "lmzoo.train", "lmzoo.trainers", "lmzoo.rl", "lmzoo.data")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted((ROOT / "lmzoo").rglob("*.py"))}


def layer_of(module: str) -> int:
    if module in PACKAGES_WITHOUT_CODE:
        return 0
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or (prefix != "lmzoo" and module.startswith(prefix + "."))
    ]
    assert matches, f"{module} is in no layer of tests/test_import_layers.py: add it to LAYERS"
    return max(matches)[1]


def imports_of(module: str) -> set[str]:
    """The lmzoo modules `module` imports anywhere in its file (`from lmzoo.x import y` counts lmzoo.x.y when
    that is a module, else lmzoo.x)."""
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lmzoo"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmzoo"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in MODULES else node.module)
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


def test_no_import_cycles():
    graph = {m: {t for t in imports_of(m) if t in MODULES and t not in PACKAGES_WITHOUT_CODE} for m in MODULES}
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
