"""The package's shape: no import circle among feeder's modules, type-only
imports included, read from the source."""

from __future__ import annotations

import ast
import pathlib

import feeder

ROOT = pathlib.Path(feeder.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """feeder modules ``path`` imports, at any depth of its code (so imports under
    ``if TYPE_CHECKING:`` and inside functions count too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base)
                mod = f"{prefix}.{node.module}" if node.module else prefix
            else:
                mod = node.module or ""
            # "from . import ops" names a module; "from ._x import y" a member of ._x
            # (or a submodule of it).
            targets = [f"{mod}.{a.name}" for a in node.names]
            if node.module:
                targets.append(mod)
        else:
            continue
        for t in targets:
            if t in modules and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    # A package imports its own modules to re-export them; that is not a circle
    # unless one of those modules imports the package back.
    for pkg in ("feeder", "feeder.bench"):
        children = {m for m in graph[pkg] if m.startswith(pkg + ".")}
        graph[pkg] = graph[pkg] - children | {c for c in children if pkg in graph.get(c, ())}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_type_only_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "feeder"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import X\n")
    (pkg / "_b.py").write_text("from ._a import Y\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    graph = import_graph()
    assert graph["feeder._a"] == {"feeder._b"} and graph["feeder._b"] == {"feeder._a"}
    assert find_cycle(graph) is not None
