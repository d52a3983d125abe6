"""The layers of lit_qlora, kept as docs/architecture.md draws them: the imports of lit_qlora/ and eval/ (installed as
lit_qlora.eval), read from the source (every `import`, at a module's top or inside a function; a name from a
package's lazy face as an import of the module that defines it; importlib.import_module and __import__ of a literal
name), form no circle and never run back up a layer but for the few listed in UPWARD, each with why; no module is
over 450 lines; each package is shipped by pyproject.toml and its public names resolve; and every import of ours,
here, in the tests, benchmarks, scripts and tutorials, names something that exists (a moved name breaks a
function-level import only when it runs)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

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
    ("lit_qlora.base",),  # errors, hardware, quiet, switches, threads: import nothing of ours above them
    ("lit_qlora",),
    ("lit_qlora.memory", "lit_qlora.nf4"),
    ("lit_qlora.lora",),
    ("lit_qlora.model", "lit_qlora.parallel"),
    ("lit_qlora.checkpoint",),
    ("lit_qlora.data",),
    ("lit_qlora.export",),  # a fine-tune's files for other tools (HF, PEFT, GGUF), which training writes
    ("lit_qlora.deploy",),  # serves a fine-tune in the prompt format it trained in (data.inference)
    ("lit_qlora.train",),
    # the training methods beside SFT (dpo, grpo, kto) and their registry: train/'s run with their own data modules
    # and LightningModules (what they share, the reference policy and token log-probabilities, is train.policy's)
    ("lit_qlora.methods",),
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


def public_names_of(path: Path, package: str) -> dict[str, str]:
    """Public name -> the module that defines it, as a package's __init__ hands them to `lit_qlora.public_names`
    (`public_names(__name__, sft="Sample pack")`: `pack` is PACKAGE.sft's). Such a name is imported on first use,
    so `from PACKAGE import pack` really imports PACKAGE.sft; the package alone would hide that import's circles."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if not (isinstance(node, ast.Call) and call_name(node) == "public_names"):
            continue
        for keyword in node.keywords:
            # A name this test cannot read is an import it cannot see: fail here rather than pass a circle.
            if keyword.arg is None or (names := literal(keyword.value)) is None:
                raise ValueError(f"{path}:{node.lineno}: give public_names each module's names as one literal "
                                 "string (tests/test_architecture.py reads them from the source)")
            found |= {public: f"{package}.{keyword.arg}" for public in names.split()}
    return found


def call_name(node: ast.Call) -> str | None:
    """`f` of `f(...)` or of `x.f(...)`."""
    return getattr(node.func, "attr", getattr(node.func, "id", None))


def literal(node: ast.AST | None, kind: type = str) -> Any:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, kind) else None


def argument(node: ast.Call, position: int, keyword: str) -> ast.AST | None:
    if len(node.args) > position:
        return node.args[position]
    return next((k.value for k in node.keywords if k.arg == keyword), None)


def absolute(name: str, level: int, package: str) -> str:
    """An import's module with `level` leading dots made absolute from `package`, as Python resolves it."""
    if not level:
        return name
    up = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(up + ([name] if name else []))


def dynamic_import(node: ast.Call, name: str, package: str) -> tuple[str, list[str]] | None:
    """What a call imports, as (module, names from it), when it is importlib.import_module or __import__ with a
    literal module name, else None (our one name built at run time is public_names' own: public_names_of reads
    those)."""
    if call_name(node) == "import_module" and (target := literal(argument(node, 0, "name"))):
        level = len(target) - len(target.lstrip("."))
        if not level:
            return target, []
        # relative to its second argument: __package__ or __name__ as in this module, or a literal
        anchor = argument(node, 1, "package")
        base = {"__package__": package, "__name__": name}.get(getattr(anchor, "id", None), literal(anchor))
        return (absolute(target[level:], level, base), []) if base else None
    if call_name(node) == "__import__" and (target := literal(argument(node, 0, "name"))):
        # __import__(name, globals, locals, fromlist, level): relative to the caller's package (the globals any call
        # of ours would pass); each name of a fromlist is imported as `from name import ...` imports it (the import
        # machinery asks the package for it, so a lazy name's module loads too)
        level = literal(argument(node, 4, "level"), int) or 0
        fromlist = [literal(e) for e in getattr(argument(node, 3, "fromlist"), "elts", ())]
        return absolute(target, level, package), [n for n in fromlist if n]
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path],
               lazy: dict[str, dict[str, str]] | None = None) -> set[str]:
    """The modules of ours that `name` imports anywhere in its file: `from P import x` counts as P.x where that is a
    module, as the module that defines x where x is one of P's lazy public names (`lazy`: package -> public_names_of,
    read from `modules` when not given), else as P; relative imports resolved; importlib.import_module and
    __import__ with a literal name too (dynamic_import)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if lazy is None:
        lazy = lazy_faces(modules)
    found: set[str] = set()

    def ours(target: str) -> None:
        while target and target not in modules:  # lit_qlora.x.y.Name -> the module that defines it
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    def from_import(base: str, names: list[str]) -> None:
        # Importing P.x runs P's __init__ first; like every parent package's, that import goes uncounted (a package's
        # own modules would all make a circle with an __init__ that imports them).
        face = lazy.get(base, {})
        for imported in names:
            if imported == "*" and face:  # `import *` takes __all__: every lazy name's module
                ours(base)
                for module in face.values():
                    ours(module)
                continue
            # A lazy name that is also a module's name: which of the two Python hands back depends on whether that
            # module is already loaded, so both count.
            if f"{base}.{imported}" in modules:
                ours(f"{base}.{imported}")
            if imported in face:
                ours(face[imported])
            if f"{base}.{imported}" not in modules and imported not in face:
                ours(base)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                ours(alias.name)
        elif isinstance(node, ast.ImportFrom):
            from_import(absolute(node.module or "", node.level, package), [alias.name for alias in node.names])
        elif isinstance(node, ast.Call) and (dynamic := dynamic_import(node, name, package)):
            target, names = dynamic
            if names:
                from_import(target, names)
            else:
                ours(target)
    return found


def lazy_faces(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Each package -> its lazy public names (public_names_of), for the packages that have any."""
    faces = {name: public_names_of(path, name) for name, path in modules.items() if path.name == "__init__.py"}
    return {name: face for name, face in faces.items() if face}


def import_graph(sources=SOURCES) -> dict[str, set[str]]:
    modules = module_files(sources)
    lazy = lazy_faces(modules)
    return {name: imports_of(name, path, modules, lazy) for name, path in modules.items()}


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


def test_training_writes_its_exports_without_the_inference_commands(graph):
    """train/ and the methods write final/ through export/ (HF, PEFT, GGUF), never through deploy/ (generate, chat,
    serve): the commands a user serves with are not what training needs."""
    found = sorted(f"{a} -> {b}" for a, targets in graph.items() if a.startswith(("lit_qlora.train", "lit_qlora.methods"))
                   for b in targets if b.startswith("lit_qlora.deploy"))
    assert found == []
    assert any(b.startswith("lit_qlora.export") for b in graph["lit_qlora.train.final"])


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers.py (plain functions) and tests/conftest.py (fixtures): a test module
    that imported another would run that module's imports and fixtures, and tie the two together."""
    found = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.name}:{node.lineno} {name}" for name in names if name.split(".")[0].startswith("test_")]
    assert found == []


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


def test_the_checks_see_through_a_lazy_face_and_import_calls(tmp_path):
    """`from PACKAGE import name` imports the module that public_names says defines it, so a circle through the
    package's lazy face counts; so do importlib.import_module and __import__ of a literal name, relative ones too."""
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    (root / "high").mkdir()
    (root / "__init__.py").write_text("")
    (root / "high" / "__init__.py").write_text("")
    (root / "low" / "__init__.py").write_text("from lit_qlora import public_names\n\n"
                                             "__getattr__, __all__ = public_names(__name__, a='f', b='g G')\n")
    (root / "low" / "a.py").write_text("from pkg.low import g\n\ndef f():\n    pass\n")
    (root / "low" / "b.py").write_text("def g():\n    from . import f\n")
    (root / "low" / "d.py").write_text("import importlib\n\ndef late():\n    importlib.import_module('pkg.high.c')\n"
                                       "    return __import__('pkg.high.e')\n")
    (root / "low" / "r.py").write_text("from importlib import import_module\n\n"
                                       "import_module('..high.c', __package__)\n")
    (root / "high" / "c.py").write_text("X = 1\n")
    (root / "high" / "e.py").write_text("G = __import__('pkg.low', globals(), None, ['G']).G\n")
    (root / "high" / "g.py").write_text("from pkg.low import *\n")
    graph = import_graph(((root, "pkg"),))
    assert graph["pkg.low.a"] == {"pkg.low.b"} and graph["pkg.low.b"] == {"pkg.low.a"}  # not the package pkg.low
    assert circles(graph) == [["pkg.low.a", "pkg.low.b"]]
    assert graph["pkg.high.e"] == {"pkg.low.b"}  # a fromlist, through the lazy face
    assert graph["pkg.high.g"] == {"pkg.low", "pkg.low.a", "pkg.low.b"}  # `import *`: all of __all__
    layers = (("pkg",), ("pkg.low",), ("pkg.high",))
    assert wrong_way(graph, layers, {}) == [
        f"pkg.low.{a} -> pkg.high.{b} (back up: pkg.low is in layer 1, pkg.high in layer 2)"
        for a, b in (("d", "c"), ("d", "e"), ("r", "c"))]
    # names the checker cannot read would be imports it cannot see: it refuses them
    (root / "low" / "__init__.py").write_text("from lit_qlora import public_names\n\n"
                                             "__getattr__, __all__ = public_names(__name__, **NAMES)\n")
    with pytest.raises(ValueError, match="one literal string"):
        import_graph(((root, "pkg"),))


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


def test_the_package_root_holds_at_most_15_entries():
    """Each concern has a home: lit_qlora/ lists packages and a few base modules, not a growing pile of files."""
    entries = sorted(p.name for p in (REPO / "lit_qlora").iterdir()
                     if p.name not in ("__init__.py", "__pycache__") and not p.name.endswith(".egg-info"))
    assert len(entries) <= 15, entries


def test_settings_travel_as_objects_not_long_parameter_lists():
    """A run's ~20 settings travel as one run spec (lit_qlora.train.spec): no function of ours takes 15 parameters or
    more (a Triton kernel's launch arguments may; one such function at most)."""
    long = [f"{path.relative_to(REPO)}:{node.name}" for path in module_files().values()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and len(node.args.posonlyargs) + len(node.args.args) + len(node.args.kwonlyargs) >= 15]
    assert len(long) <= 1, long
