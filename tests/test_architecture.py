"""The layers of lit_qlora, kept as docs/architecture.md draws them: the imports of lit_qlora/ and eval/ (installed as
lit_qlora.eval), read from the source (every `import`, at a module's top or inside a function), form no circle and
never run back up a layer but for the few listed in UPWARD, each with why; no module is over 450 lines; each package
is shipped by pyproject.toml and its public names resolve; and every import of ours, here, in the tests, benchmarks,
scripts and tutorials, names something that exists (a moved name breaks a function-level import only when it runs)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
SOURCES = ((REPO / "lit_qlora", "lit_qlora"), (REPO / "eval", "lit_qlora.eval"))

# Lowest first. A module may import its own unit and the units of lower layers, never a unit of its own layer or of a
# higher one. A unit is a package (with all below it) or a module; "lit_qlora" is the package root alone (its
# __init__: process settings that must precede torch, and `public_names`). A new top-level module or package gets a
# place here (and in docs/architecture.md) before its first import passes.
LAYERS = (
    ("lit_qlora.errors", "lit_qlora.hardware", "lit_qlora.quiet", "lit_qlora.threads"),  # import nothing of ours
    ("lit_qlora", "lit_qlora.guards"),
    ("lit_qlora.memory", "lit_qlora.nf4"),
    ("lit_qlora.lora",),
    ("lit_qlora.model", "lit_qlora.parallel"),
    ("lit_qlora.checkpoint",),
    ("lit_qlora.data",),
    ("lit_qlora.deploy",),  # serves a fine-tune in the prompt format it trained in (data.inference)
    ("lit_qlora.train",),
    ("lit_qlora.preference",),  # litqlora dpo: train/'s run with its own data module and LightningModule
    ("lit_qlora.estimate", "lit_qlora.eval"),  # estimate --method dpo traces the preference step
    ("lit_qlora.cli",),
)

# Imports that run back up (importer module -> imported module): why each cannot point down. At most two.
UPWARD: dict[tuple[str, str], str] = {}

MAX_LINES = 450


def module_files(sources=SOURCES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under each source root (a package by its __init__)."""
    found = {}
    for root, package in sources:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports anywhere in its file: `from P import x` counts as P.x where that is a
    module, else as P; relative imports resolved; importlib.import_module with a literal name too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def ours(target: str) -> None:
        while target and target not in modules:  # lit_qlora.x.y.Name -> the module that defines it
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                ours(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                ours(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            ours(node.args[0].value)
    return found


def import_graph(sources=SOURCES) -> dict[str, set[str]]:
    modules = module_files(sources)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit_of(module: str, layers=LAYERS) -> str | None:
    """The declared unit a module belongs to: the longest unit that is it or a package above it (the root only as
    itself)."""
    units = [u for layer in layers for u in layer]
    matches = [u for u in units if module == u or (u != "lit_qlora" and module.startswith(u + "."))]
    return max(matches, key=len) if matches else None


def layer_of(unit: str, layers=LAYERS) -> int:
    return next(i for i, layer in enumerate(layers) if unit in layer)


def wrong_way(graph: dict[str, set[str]], layers=LAYERS, allowed=UPWARD) -> list[str]:
    """Each import from a unit to another of its own layer or a higher one, unless allowed."""
    found = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = unit_of(importer, layers), unit_of(target, layers)
            if a == b or (importer, target) in allowed:
                continue
            if layer_of(b, layers) >= layer_of(a, layers):
                way = "sideways" if layer_of(b, layers) == layer_of(a, layers) else "back up"
                found.append(f"{importer} -> {target} ({way}: {a} is in layer {layer_of(a, layers)}, "
                             f"{b} in layer {layer_of(b, layers)})")
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_module_has_a_layer(graph):
    assert [m for m in graph if unit_of(m) is None] == [], "give each new top-level module or package a place in LAYERS"


def test_no_import_circle(graph):
    assert circles(graph) == [], "move what both sides need into a module below them both"


def test_no_import_runs_back_up_but_the_listed_ones(graph):
    assert len(UPWARD) <= 2
    assert all(why.strip() for why in UPWARD.values())
    assert wrong_way(graph) == [], "an import may point only down the layers (docs/architecture.md)"
    listed_and_present = [pair for pair in UPWARD if pair[1] in graph.get(pair[0], ())]
    assert listed_and_present == list(UPWARD), "an UPWARD entry whose import is gone: drop it"


def test_the_checks_catch_a_circle_and_an_import_back_up(tmp_path):
    """Hidden in a function, a circle still counts; so does a low package importing a high one."""
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    (root / "high").mkdir()
    for init in (root / "__init__.py", root / "low" / "__init__.py", root / "high" / "__init__.py"):
        init.write_text("")
    (root / "low" / "a.py").write_text("def f():\n    from pkg.low.b import g\n")
    (root / "low" / "b.py").write_text("from pkg.low import a\n\ndef g():\n    from pkg.high import c\n")
    (root / "high" / "c.py").write_text("X = 1\n")
    (root / "high" / "d.py").write_text("from ..low.a import f\n")
    graph = import_graph(((root, "pkg"),))
    assert circles(graph) == [["pkg.low.a", "pkg.low.b"]]
    layers = (("pkg",), ("pkg.low",), ("pkg.high",))
    assert graph["pkg.high.d"] == {"pkg.low.a"}  # a relative import, resolved
    assert wrong_way(graph, layers, {}) == ["pkg.low.b -> pkg.high.c (back up: pkg.low is in layer 1, pkg.high in "
                                            "layer 2)"]
    assert wrong_way(graph, layers, {("pkg.low.b", "pkg.high.c"): "a reason"}) == []


def test_no_module_over_450_lines():
    long = {str(path.relative_to(REPO)): n for path in module_files().values()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concern (at most {MAX_LINES} lines a module)"


def test_pyproject_ships_every_package():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert packages - listed == set()


def test_each_package_public_name_resolves():
    """The names a package's __init__ lists (its public API; for model, lora, checkpoint and memory also the old
    module paths, e.g. `from lit_qlora.lora import apply_lora`) import."""
    missing = []
    for name, path in module_files().items():
        if path.name != "__init__.py":
            continue
        package = importlib.import_module(name)
        missing += [f"{name}.{attr}" for attr in getattr(package, "__all__", ()) if not hasattr(package, attr)]
    assert missing == []


def imported_names(sources=SOURCES, extra=("tests", "benchmarks", "scripts")) -> set[tuple[str, str, str]]:
    """(file, module, name) of every `from lit_qlora... import name` (and `import lit_qlora...`, name "") in our
    sources, tests, benchmarks and scripts, at a module's top or inside a function, and in the tutorials' code."""
    found = set()
    files = [path for root, _ in sources for path in root.rglob("*.py")]
    # (benchmarks/_work holds the peers' virtual environments: not ours, and ignored by git)
    files += [path for folder in extra for path in (REPO / folder).rglob("*.py") if "_work" not in path.parts]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("lit_qlora"):
                found |= {(where, node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {(where, alias.name, "") for alias in node.names if alias.name.startswith("lit_qlora")}
    for path in sorted((REPO / "tutorials").glob("*.md")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if (match := re.match(r"\s*from (lit_qlora[\w.]*) import ([\w, ]+)$", line)):
                found |= {(f"tutorials/{path.name}:{number}", match[1], name.strip()) for name in match[2].split(",")}
    return found


def test_every_import_of_ours_resolves():
    """A moved name breaks a function-level import only when that function runs: each import of ours names a module,
    or a name its module has."""
    broken = []
    for where, module, name in sorted(imported_names()):
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            broken.append(f"{where}: {module} ({e})")
            continue
        if name and not hasattr(imported, name) and not is_module(f"{module}.{name}"):
            broken.append(f"{where}: {module}.{name}")
    assert broken == []


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent is a module, not a package
        return False
