"""What the library's own text says: no benchmark figures in the core's code,
comments and docstrings (they live once, on the results page, where they do not
drift), and no module path, in the code or the docs, that does not exist."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import sys
import types
import warnings

import pytest

import feeder

PACKAGE = pathlib.Path(feeder.__file__).parent
REPO = PACKAGE.parent
TOOLS = ("bench", "doctor")  # measuring tools: their figures are their output

# A measured figure: a time, a rate, a ratio or a share of a cost. A bound or a
# setting written with a unit ("more than 2x", a 20 ms wait) is not one: those
# few are listed below, by file and text.
FIGURE = re.compile(
    r"~?\b\d+(?:\.\d+)?\s?(?:ns|us|µs|ms)\b"  # a time below the second
    r"|\b\d+\.\d+\s?s\b|\b\d+ of its \d+ s\b"  # seconds, as measured
    r"|\b\d+(?:\.\d+)?\s?(?:img/s|images/s|samples/s|[KMG]i?B/s)"  # a rate
    r"|\b\d+\.\d+x\b|~?\b\d+x (?:faster|slower|cheaper|fewer|less|more)\b"  # a ratio
    r"|\b\d+(?:\.\d+)?\s?% (?:faster|slower|saved|of (?:the|its) (?:decode|time|cost))")
NOT_FIGURES = {
    ("feeder/engine/pool.py", "20 ms"),  # _BUSY_S, the wait before the pool grows
    ("feeder/decode/_jpeg.c", "5 ms"),  # CPython's switch interval
}


def core_files() -> list[pathlib.Path]:
    return [p for p in sorted(PACKAGE.rglob("*")) if p.suffix in (".py", ".c", ".h")
            and p.relative_to(PACKAGE).parts[0] not in TOOLS]


def figures(path: pathlib.Path, root: pathlib.Path = REPO) -> list[str]:
    """``file:line: figure`` for every figure in ``path`` not listed as a setting."""
    name = path.relative_to(root).as_posix()
    return [f"{name}:{n}: {m.group(0)}" for n, line in enumerate(path.read_text().splitlines(), 1)
            for m in FIGURE.finditer(line) if (name, m.group(0).lstrip("~")) not in NOT_FIGURES]


def test_the_core_holds_no_benchmark_figures():
    files = core_files()
    assert len(files) > 100
    found = [f for path in files for f in figures(path)]
    assert found == [], "figures belong on docs/results.md, next to their bench/results/ file"


def test_the_figure_check_sees_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("# about 1.5x faster than cv2.add\n"
                    "x = 1  # ~30 us per image, 6x faster, 12% of the decode\n"
                    "# 0.3 s for 10^5 entries; 80 img/s; 2 of its 3 s\n"
                    "# shrinks by more than 2x; 0x1F; 64 MiB; 60 s timeout; 5% of samples\n")
    assert figures(path, tmp_path) == [
        "m.py:1: 1.5x", "m.py:2: ~30 us", "m.py:2: 6x faster", "m.py:2: 12% of the decode",
        "m.py:3: 0.3 s", "m.py:3: 80 img/s", "m.py:3: 2 of its 3 s"]


# -- module paths ----------------------------------------------------------------------------

# A path of the package (feeder/engine/pool.py), or a dotted name starting at it
# (feeder.engine.pool, feeder.engine.pool.BufferPool). Dotted names that go on
# from an attribute of a Feeder (feeder.config.max_pixels: the object, not the
# package) are not module paths.
PATH_REF = re.compile(r"(?<![\w./-])(feeder/(?:[\w-]+/)*[\w-]+\.(?:py|c|h))\b")
DOTTED_REF = re.compile(r"(?<![\w./-])feeder(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIXES = ("md", "py", "c", "h", "txt", "json", "csv", "png", "yml")
# Where an earlier release's module path is named on purpose: the history, and
# the modules that keep those paths importing.
OLD_PATHS_NAMED = ("docs/changelog.md", "feeder/_moved.py", "feeder/work/__init__.py")
OLD_PATHS = {("feeder/__init__.py", "feeder._decode"),
             ("feeder/decode/__init__.py", "feeder.work.decode")}
PLACEHOLDERS = {"feeder.Name"}  # "a ``::: feeder.Name`` line" in the contributing guide


def text_files() -> list[pathlib.Path]:
    docs = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
    code = [p for p in sorted(PACKAGE.rglob("*")) if p.suffix in (".py", ".c", ".h")]
    return [p for p in docs + code if p.relative_to(REPO).as_posix() not in OLD_PATHS_NAMED]


def modules() -> set[str]:
    """Every module of the package, the C extension's included, by its dotted name."""
    found = set()
    for p in PACKAGE.rglob("*"):
        if p.suffix == ".py" or (p.suffix == ".c" and "PyInit_" in p.read_text()):
            parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.add(".".join(parts))
    return found


def feeder_attributes() -> set[str]:
    """What ``feeder.x`` names on a Feeder: its class's names and those its
    ``__init__`` sets."""
    tree = ast.parse((PACKAGE / "_feeder.py").read_text())
    init = next(n for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "Feeder"
                for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    set_there = {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                 if isinstance(t, ast.Attribute)}
    return set(dir(feeder.Feeder)) | set_there


def missing_reference(ref: str, known: set[str], on_a_feeder: set[str]) -> str | None:
    """Why the dotted ``ref`` names nothing (None: it names a module or what one holds)."""
    segments = ref.split(".")
    if segments[-1] in FILE_SUFFIXES:
        return None
    if segments[1] in on_a_feeder and ".".join(segments[:2]) not in known:
        return None
    depth = max(k for k in range(1, len(segments) + 1) if ".".join(segments[:k]) in known)
    module = ".".join(segments[:depth])
    if (PACKAGE.parent / module.replace(".", "/")).with_suffix(".c").exists():
        return None  # the C extension: it may not be built here
    obj = importlib.import_module(module)
    for k, name in enumerate(segments[depth:], depth):
        here = ".".join(segments[:k])
        if not hasattr(obj, name):
            return f"{here} has no {name}"
        obj = getattr(obj, name)
        # An old path that still imports (feeder.work.sample is feeder.sample) names
        # the module by a name it no longer has.
        if isinstance(obj, types.ModuleType) and obj.__name__.startswith("feeder.") \
                and obj.__name__ != f"{here}.{name}":
            return f"{here}.{name} is {obj.__name__}"
    return None


def stale_references(path: pathlib.Path, known: set[str], on_a_feeder: set[str]) -> list[str]:
    name = path.relative_to(REPO).as_posix()
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for m in PATH_REF.finditer(line):
            if not (REPO / m.group(1)).exists():
                out.append(f"{name}:{n}: {m.group(1)} does not exist")
        for m in DOTTED_REF.finditer(line):
            ref = m.group(0)
            if (name, ref) in OLD_PATHS or ref in PLACEHOLDERS:
                continue
            why = missing_reference(ref, known, on_a_feeder)
            if why:
                out.append(f"{name}:{n}: {ref}: {why}")
    return out


def test_every_module_path_named_exists():
    known, on_a_feeder = modules(), feeder_attributes()
    files = text_files()
    assert len(files) > 100
    assert [s for p in files for s in stale_references(p, known, on_a_feeder)] == []


@pytest.mark.parametrize("text, found", [
    ("see feeder/engine/pool.py", []),
    ("see feeder/work/decode.py", ["x.md:1: feeder/work/decode.py does not exist"]),
    ("`feeder.engine.tune.Gate`", []),
    ("`feeder.engine.tune.Gates`", ["x.md:1: feeder.engine.tune.Gates: feeder.engine.tune has no Gates"]),
    ("`feeder._tune.Gate`", ["x.md:1: feeder._tune.Gate: feeder has no _tune"]),
    ("`feeder.config.max_pixels`, `feeder.last_batch.indices`, docs/api/feeder.md", []),
    ("`feeder.decode._jpeg.ENTROPY_LAYOUT`", []),
    ("`feeder.work.sample`", ["x.md:1: feeder.work.sample: feeder.work.sample is feeder.sample"]),
])
def test_the_module_path_check_sees_a_stale_one(tmp_path, monkeypatch, text, found):
    with warnings.catch_warnings():  # an old path imported, as an earlier test may have
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module("feeder.work.sample")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    path = tmp_path / "x.md"
    path.write_text(text + "\n")
    (tmp_path / "feeder" / "engine").mkdir(parents=True)
    (tmp_path / "feeder" / "engine" / "pool.py").write_text("")
    assert stale_references(path, modules(), feeder_attributes()) == found
