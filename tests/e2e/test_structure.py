"""The package's shape: no import circle among feeder's modules, type-only
imports included, read from the source."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

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
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    graph = import_graph()
    assert graph["feeder._a"] == {"feeder._b"} and graph["feeder._b"] == {"feeder._a"}
    assert find_cycle(graph) is not None


# The folders, lowest layer first: a module imports its own layer and the ones
# below, never one above (the pipeline picture read bottom-up: the sample's
# vocabulary, the transforms, decoding, storage, the public sources, the epoch
# plan, the engine, the worker-process engine, the Feeder, the tools). A module
# of a folder counts as its folder. feeder.work holds only the old module paths
# (see _moved.py).
LAYERS = [
    ("errors", ["feeder.errors"]),
    ("sample vocabulary", ["feeder.sample"]),
    ("ops", ["feeder.ops"]),
    ("decode", ["feeder.decode"]),
    ("storage", ["feeder.storage"]),
    ("sources", ["feeder.sources", "feeder.dataset_source", "feeder.shards", "feeder.synthetic"]),
    ("the epoch plan", ["feeder.order", "feeder.mixture"]),
    ("engine", ["feeder.engine"]),
    ("isolation", ["feeder.isolation"]),
    ("the Feeder", ["feeder._feeder", "feeder._keywords", "feeder._consumer", "feeder._dataset",
                    "feeder._moved", "feeder.work"]),
    # The tools: the core never imports them (feeder-pack, packer and command, included).
    ("tools and the package", ["feeder.bench", "feeder.doctor", "feeder.pack", "feeder.testing",
                               "feeder"]),
]


def layer_of(module: str) -> int | None:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            # the package itself only by its own name; the others as folders too
            if module == p or (p != "feeder" and module.startswith(p + ".")):
                if best is None or len(p) > best[1]:
                    best = (rank, len(p))
    return None if best is None else best[0]


def test_every_module_has_a_layer():
    assert [m for m in import_graph() if layer_of(m) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph()
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a in sorted(graph) for b in sorted(graph[a]) if layer_of(b) > layer_of(a)]
    assert upward == []


def test_the_layer_check_sees_an_upward_import():
    assert layer_of("feeder.decode.image") < layer_of("feeder.engine.stage") < layer_of("feeder._feeder")
    assert layer_of("feeder") == len(LAYERS) - 1 and layer_of("feeder.storage.tar") == 4
    assert layer_of("elsewhere") is None


def package_of(module: str) -> str:
    """The folder a module is in (``feeder.decode.jpeg`` -> ``feeder.decode``); a
    top-level module is its own."""
    parts = module.split(".")
    return ".".join(parts[:2])


def mutual_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every pair of packages that import each other, with one import each way."""
    edges: dict[tuple[str, str], str] = {}
    for a in sorted(graph):
        for b in sorted(graph[a]):
            pa, pb = package_of(a), package_of(b)
            if pa != pb and pa != "feeder":  # the package's __init__ re-exports its folders
                edges.setdefault((pa, pb), f"{a} -> {b}")
    return [f"{edges[pa, pb]} and {edges[pb, pa]}" for pa, pb in sorted(edges)
            if pa < pb and (pb, pa) in edges]


def test_no_two_packages_import_each_other():
    assert mutual_imports(import_graph()) == []


def test_the_mutual_import_check_sees_one():
    graph = {"feeder.ops.base": {"feeder.work.rng"}, "feeder.work.decode": {"feeder.ops"},
             "feeder.ops": set(), "feeder.work.rng": set()}
    assert mutual_imports(graph) == ["feeder.ops.base -> feeder.work.rng and "
                                     "feeder.work.decode -> feeder.ops"]
    assert mutual_imports({"feeder.ops.base": {"feeder.sample.rng"}, "feeder.sample.rng": set()}) == []


def test_the_pipeline_has_a_folder_per_part():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"engine", "isolation", "sample", "ops", "decode", "storage", "order"} <= folders
    # the former per-sample folder keeps nothing but the old module paths
    assert sorted(p.name for p in (ROOT / "work").iterdir() if p.name != "__pycache__") == ["__init__.py"]
    flat = sorted(p.name for p in ROOT.glob("_*.py") if p.name != "__init__.py")
    # beside the public modules, only the Feeder's own parts stay at the top
    assert flat == ["_consumer.py", "_dataset.py", "_feeder.py", "_keywords.py", "_moved.py"]


def test_a_module_by_its_old_name_is_the_module_at_its_new_place():
    import importlib

    sys.modules.pop("feeder._decode", None)
    with pytest.warns(DeprecationWarning, match=r"feeder\._decode is now feeder\.decode"):
        old = importlib.import_module("feeder._decode")
    new = importlib.import_module("feeder.decode")
    assert old is new  # so patching feeder._decode.x patches what feeder runs
    sys.modules.pop("feeder._sampler", None)
    with pytest.warns(DeprecationWarning, match="feeder.engine.sampler"):
        from feeder._sampler import pass_order
    from feeder.engine.sampler import pass_order as moved
    assert pass_order is moved
    sys.modules.pop("feeder.engine.group", None)
    with pytest.warns(DeprecationWarning, match="feeder.order.group"):
        import feeder.engine.group as group
    assert group is importlib.import_module("feeder.order.group")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("feeder._no_such_module")


# The core (the tools apart) is held to sizes a reader takes in at once, with no
# module excepted.
NOT_YET_SPLIT: set[str] = set()
TOOLS = ("bench", "doctor")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def long_parts(path: pathlib.Path) -> list[str]:
    """What in ``path`` is past the bounds: the module's line count, and each
    function (methods and nested functions included) longer than allowed."""
    text = path.read_text()
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{path.name}: {lines} lines")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_the_core_modules_stay_small():
    core = [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] not in TOOLS]
    assert len(core) > 100
    over = {str(p.relative_to(ROOT)): long_parts(p) for p in core}
    assert {name for name, parts in over.items() if parts} == NOT_YET_SPLIT, \
        {name: parts for name, parts in over.items() if parts}


def test_the_size_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x = {k}" for k in range(MAX_FUNCTION_LINES))
    path = tmp_path / "long.py"
    path.write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_parts(path) == [f"long.py:5 long: {MAX_FUNCTION_LINES + 1} lines"]
    path.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_parts(path) == [f"long.py: {MAX_MODULE_LINES + 1} lines"]


@pytest.mark.parametrize("old, new", [
    ("feeder.work.decode", "feeder.decode"), ("feeder.work.region", "feeder.decode.region"),
    ("feeder.work.verified", "feeder.decode.verified"),
    ("feeder.work.extension", "feeder.decode.extension"), ("feeder.work.sample", "feeder.sample"),
    ("feeder.work.rng", "feeder.sample.rng"), ("feeder.work.augment", "feeder.ops.chain"),
    ("feeder._sample", "feeder.sample"), ("feeder._augment", "feeder.ops.chain"),
])
def test_a_module_of_a_folder_that_still_exists_is_found_at_its_new_place(old, new):
    import importlib

    assert importlib.import_module(old) is importlib.import_module(new)
    package, _, name = old.rpartition(".")
    exec(f"from {package} import {name} as found", globals(), space := {})
    assert space["found"] is importlib.import_module(new)


def test_the_extension_by_its_old_name_is_the_extension():
    import importlib

    from feeder.decode import extension
    if extension.jpeg is None:
        pytest.skip(f"the extension is not in use: {extension.missing}")
    assert importlib.import_module("feeder.work._jpeg") is extension.jpeg
    assert importlib.import_module("feeder._jpeg") is extension.jpeg


def test_patching_by_an_old_module_path_patches_what_feeder_runs(monkeypatch):
    import feeder.decode.jpeg
    import feeder.sample.rng

    marker = object()
    monkeypatch.setattr("feeder.work.rng.SampleRNG", marker)
    assert feeder.sample.rng.SampleRNG is marker
    monkeypatch.setattr("feeder.work.decode.jpeg.MAX_SCANS", 7)
    assert feeder.decode.jpeg.MAX_SCANS == 7


# Each component is handed its own typed option record (feeder.engine.config's
# RECORDS), never the whole table as an untyped "cfg"/"config": where a
# component does need the table (a pass, an engine, the worker rebuilding it),
# the parameter says Config.
CONFIG_NAMES = ("cfg", "config")


def untyped_config_parameters(path: pathlib.Path) -> list[str]:
    """Every parameter of a function in ``path`` named ``cfg`` or ``config`` whose
    annotation is missing or ``Any``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            if arg.arg not in CONFIG_NAMES:
                continue
            note = arg.annotation
            text = "" if note is None else ast.unparse(note).strip("'\"")
            if text in ("", "Any", "typing.Any"):
                found.append((node.lineno, f"{path.name}:{node.lineno} {node.name}({arg.arg}: "
                                           f"{text or '(none)'})"))
    return [line for _, line in sorted(found, key=lambda row: row[0])]


def test_no_core_function_takes_an_untyped_configuration():
    core = [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] not in TOOLS]
    assert [f for p in core for f in untyped_config_parameters(p)] == []


def test_the_configuration_check_sees_an_untyped_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import Any\n\n\nclass A:\n    def f(self, cfg: Any, x: Any) -> None: ...\n\n\n"
                    "def g(config, *, cfg: 'Any' = None): ...\n\n\n"
                    "def h(cfg: Config, config: ThreadOptions): ...\n")
    assert untyped_config_parameters(path) == ["m.py:5 f(cfg: Any)", "m.py:8 g(config: (none))",
                                               "m.py:8 g(cfg: Any)"]
