"""The package layout holds: no import circles, no import from a lower layer into a higher
one, no module over MAX_MODULE_LINES lines and no function over MAX_FUNCTION_LINES, and no
module of the engine's room (ENGINE_ROOM) imports an optional feature's package (FEATURES)
unless FEATURE_IMPORTS allows it.

Every import statement counts, including the lazy ones inside functions and the ones under
`TYPE_CHECKING`: a circle hidden behind a late import is still a circle in the design.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "kvstack"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# Lowest first. A module may import its own top-level package (or module) and anything in a
# lower layer, never a higher one. Names are the first component under `kvstack`.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(names.split()) for names in (
    "clock errors paths units version",
    "config sampling_params outputs argtypes",
    "kernels",
    "kv",
    "semantic scoring recurrent",
    "layers drafts structured samples",
    "models",
    "weights",
    "blend",
    "engine",
    "ui",
    "eval server bench cluster",
    "cli",
    "__init__ __main__",
))


# Optional features, each in its own package: the engine reaches them through its hook points
# (`engine/hooks.py`), registered in `engine/builder.py`.
FEATURES = ("blend", "drafts", "structured", "scoring", "samples")
# The packages that run a step: a feature's name has no business here but where listed below.
ENGINE_ROOM = frozenset({"kv", "layers", "models", "engine"})
# Module -> the features it may import. `engine.builder` is the registration point; `llm` and
# `async_llm` are front doors that take a feature's request parameters (`BlendParams`,
# `Chunk`). Shrink it, never grow it.
FEATURE_IMPORTS: dict[str, frozenset[str]] = {
    "kvstack.engine.builder": frozenset(FEATURES),
    "kvstack.engine.llm": frozenset({"blend"}),
    "kvstack.engine.async_llm": frozenset({"blend"}),
}


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    files = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        files[".".join(parts)] = path
    return files


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` names a module; `from mod import func` names `mod`.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    files = module_files(src)
    modules = set(files)
    return {name: imports_of(name, path, modules) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module} belongs to no layer; add {top!r} to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                bad.append(f"{module} -> {target}")
    return bad


def feature_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a feature's package by an engine-room module the allow-list does not name."""
    bad = []
    for module, targets in sorted(graph.items()):
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in ENGINE_ROOM:
            continue
        allowed = FEATURE_IMPORTS.get(module, frozenset())
        for target in sorted(targets):
            feature = target.split(".")[1] if "." in target else ""
            if feature in FEATURES and feature != parts[1] and feature not in allowed:
                bad.append(f"{module} -> {target}")
    return bad


def long_functions(src: Path = SRC) -> Iterator[str]:
    for name, path in module_files(src).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    yield f"{name}.{node.name} ({length} lines)"


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_upward_imports() -> None:
    bad = upward_imports(import_graph())
    assert not bad, "imports from a lower layer into a higher one:\n" + "\n".join(bad)


def test_features_are_named_only_where_registered() -> None:
    bad = feature_imports(import_graph())
    assert not bad, "a feature imported outside its package and the allow-list:\n" + \
        "\n".join(bad)


def test_the_feature_check_catches_a_stray_import() -> None:
    graph = {"kvstack.engine.scheduler": {"kvstack.blend.state"},
             "kvstack.engine.builder": {"kvstack.blend.blender"},
             "kvstack.server.blend_api": {"kvstack.blend.params"},
             "kvstack.blend.plan": {"kvstack.blend.state"}}
    assert feature_imports(graph) == ["kvstack.engine.scheduler -> kvstack.blend.state"]


def test_modules_and_functions_stay_small() -> None:
    long_modules = [f"{name} ({len(path.read_text().splitlines())} lines)"
                    for name, path in module_files().items()
                    if len(path.read_text().splitlines()) > MAX_MODULE_LINES]
    assert not long_modules, "modules over the limit: " + ", ".join(long_modules)
    long = list(long_functions())
    assert not long, "functions over the limit: " + ", ".join(long)


@pytest.fixture()
def toy_package(tmp_path: Path) -> Path:
    root = tmp_path / PACKAGE
    (root / "engine").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "errors.py").write_text("")
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "a.py").write_text("def f():\n    from kvstack.engine import b\n")
    (root / "engine" / "b.py").write_text("from kvstack.engine.a import f\nimport kvstack.errors\n")
    return tmp_path


def test_the_checks_catch_a_hidden_circle_and_an_upward_import(toy_package: Path) -> None:
    graph = import_graph(toy_package)
    assert circles(graph) == [["kvstack.engine.a", "kvstack.engine.b"]]
    (toy_package / PACKAGE / "errors.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvstack.engine import a\n")
    assert upward_imports(import_graph(toy_package)) == ["kvstack.errors -> kvstack.engine.a"]
