"""What the library's own text says: no benchmark figures in the core's code,
comments and docstrings (they live once, on the results page, where they do not
drift)."""

from __future__ import annotations

import pathlib
import re

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
