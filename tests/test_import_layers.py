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
            "lmzoo.serving",  # the generation engine: its device loop is decoding.sample's
            "lmzoo.metrics",
            # A tree's layer layout (scanned or per layer) and a leaf placed in its sharding: what converted weights
            # and a checkpoint restored into the other scan_layers share. It imports nothing of lmzoo.
            "lmzoo.convert.mapping",
        ),
    ),
    ("data", ("lmzoo.data",)),
    ("building blocks", ("lmzoo.kernels", "lmzoo.layers")),
    ("models", ("lmzoo.models",)),
    # LoRA's one room: its config, the tree transform, a task through adapters, merge on read, PEFT's files.
    (
        "conversion, lora and rl maths",
        ("lmzoo.convert", "lmzoo.lora", "lmzoo.rl"),
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


# File input and output happens in these layers only (through lmzoo.storage where the path is a user's); every other
# layer, and train.py and eval.py, reads and writes through them, so a user path works wherever it is (local, gs://,
# s3://). docs/ARCHITECTURE.md, "One path layer".
FILE_LAYERS = ("foundation", "data", "conversion, lora and rl maths", "weights and config")
_OS_FILE_CALLS = {
    "listdir", "scandir", "makedirs", "mkdir", "remove", "unlink", "rename", "replace", "stat", "rmdir", "walk",
    "access", "chmod", "open", "fdopen",
}  # fmt: skip
_PATH_QUERIES = {"exists", "isfile", "isdir", "getsize", "getmtime"}
# pathlib's and epath's input and output methods (building a path is fine; reading or writing through it is not).
_PATH_METHODS = {
    "read_text", "read_bytes", "write_text", "write_bytes", "open", "exists", "is_file", "is_dir", "iterdir", "glob",
    "rglob", "mkdir", "unlink", "rmdir", "touch", "stat", "rename", "chmod",
}  # fmt: skip


def _file_call(call: ast.Call) -> str | None:
    """The name of a file-system call (open, os and os.path file functions, shutil, np.memmap/load, gzip.open, glob, a
    path object's input and output methods), or None."""
    function = call.func
    if isinstance(function, ast.Name):
        return "open" if function.id == "open" else None
    if not isinstance(function, ast.Attribute):
        return None
    owner = ast.unparse(function.value)
    if (owner, function.attr) in (("gzip", "open"), ("np", "memmap"), ("np", "load"), ("io", "open")):
        return f"{owner}.{function.attr}"
    if owner in ("shutil", "glob") or (owner == "os" and function.attr in _OS_FILE_CALLS):
        return f"{owner}.{function.attr}"
    if owner == "os.path":
        return f"os.path.{function.attr}" if function.attr in _PATH_QUERIES else None
    if function.attr in _PATH_METHODS and _is_path(function.value):
        return f".{function.attr}()"
    return None


_PATH_CONSTRUCTORS = ("pathlib.Path", "Path", "epath.Path", "storage.path", "pathlib.PurePath")
_PATH_NAMES = ("path", "file", "folder", "directory", "dir", "out", "root", "workdir")


def _is_path(node: ast.expr) -> bool:
    """Whether an expression is a path object: made by a path constructor, joined with `/`, or a name that says so."""
    if isinstance(node, ast.Call):
        return ast.unparse(node.func) in _PATH_CONSTRUCTORS
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, ast.Div)
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return name.lower().endswith(_PATH_NAMES)
    return False


def _file_calls(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    calls = [
        (node.lineno, name)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and (name := _file_call(node))
    ]
    return [f"{path.relative_to(root)}:{line}: {name}" for line, name in sorted(calls)]


def test_only_the_storage_data_and_conversion_layers_touch_files():
    allowed = {index for index, (name, _) in enumerate(LAYERS) if name in FILE_LAYERS}
    outside = [MODULES[m] for m in MODULES if layer_of(m) not in allowed] + [ROOT / "train.py", ROOT / "eval.py"]
    found = [call for path in outside for call in _file_calls(path)]
    assert not found, "file calls outside the file layers (read and write through lmzoo.storage):\n" + "\n".join(found)


def test_the_file_call_check_sees_each_form(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import os, pathlib, shutil\nopen('x')\npathlib.Path('x').read_text()\nos.path.exists('x')\n"
        "shutil.copy('a', 'b')\nos.replace('a', 'b')\nnp.memmap('x')\nos.getpid()\nos.path.join('a', 'b')\n"
        "pathlib.Path('a') / 'b'\nstorage.exists('x')\nstate.replace(x=1)\nstage.write_text('a', 'b')\n"
        "folder.mkdir()\n(out / 'x').write_bytes(b'')\n"
    )
    names = [line.split(": ", 1)[1] for line in _file_calls(planted, tmp_path)]
    assert names == [
        "open", ".read_text()", "os.path.exists", "shutil.copy", "os.replace", "np.memmap", ".mkdir()", ".write_bytes()"
    ]  # fmt: skip
