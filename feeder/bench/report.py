"""Output of the benchmarks: tables on stdout, CSV and JSON files, optional plots,
progress on stderr, and the description of the machine that produced them."""

from __future__ import annotations

import csv
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

Column = tuple[str, str, str]  # (row key, header, format)

_quiet = False


def set_quiet(quiet: bool) -> None:
    """Silence :func:`progress` (tables are still printed)."""
    global _quiet
    _quiet = quiet


def progress(message: str) -> None:
    """One progress line on stderr, so stdout holds only the tables."""
    if not _quiet:
        print(f"[feeder-bench] {message}", file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float:
    """Median of the values, NaN when there are none."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else float("nan")


def _fmt(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column], title: str = "") -> str:
    """A plain-text table; missing values show as ``-``."""
    header = [h for _, h, _ in columns]
    body = [[_fmt(r.get(k), f) for k, _, f in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(header)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines) + "\n"


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return str(getattr(mod, "__version__", "unknown"))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, GPU, library versions and the date: what a figure depends on."""
    from ..engine.threads import available_cores

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "available_cores": available_cores(),
        "memory_bytes": _memory_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "feeder_commit": _git_commit(),
    }
    for name in ("feeder", "torch", "numpy", "cv2", "simplejpeg", "PIL", "psutil", "matplotlib"):
        info[f"{name}_version"] = _version(name)
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken CUDA install must not stop a CPU benchmark
        info["gpu"] = None
    return info


def describe_machine(info: dict[str, Any]) -> str:
    """One line naming the machine, for table titles and the README."""
    mem = info.get("memory_bytes")
    mem_s = f", {mem / 2**30:.0f} GiB" if mem else ""
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ", no GPU"
    return (f"{info['cpu_model']}, {info['available_cores']} cores{mem_s}{gpu}; Python "
            f"{info['python']}, torch {info['torch_version']}, numpy {info['numpy_version']}, "
            f"cv2 {info['cv2_version']}, simplejpeg {info['simplejpeg_version']}, "
            f"PIL {info['PIL_version']}; {info['date_utc']}")


def _csv_value(v: Any) -> Any:
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    return v


def write_csv(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """Rows as CSV; the columns are the union of the rows' keys, in first-seen order."""
    keys: list[str] = []
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in keys})


def write_outputs(out_dir: str, name: str, rows: Sequence[dict[str, Any]], meta: dict[str, Any],
                  extra_tables: dict[str, Sequence[dict[str, Any]]] | None = None,
                  machine: dict[str, Any] | None = None) -> list[str]:
    """Write ``<name>.csv`` (+ one CSV per extra table), ``<name>.json`` and ``machine.json``.

    ``machine``: the machine the figures were measured on, when not this one (a
    report recomputed from saved measurements).

    Returns:
        The paths written.
    """
    os.makedirs(out_dir, exist_ok=True)
    machine = machine or machine_info()
    paths = []
    csv_path = os.path.join(out_dir, f"{name}.csv")
    write_csv(csv_path, rows)
    paths.append(csv_path)
    for table, trows in (extra_tables or {}).items():
        p = os.path.join(out_dir, f"{name}_{table}.csv")
        write_csv(p, trows)
        paths.append(p)
    doc = {"command": " ".join(["feeder-bench", *sys.argv[1:]]), "machine": machine, "meta": meta,
           "rows": list(rows), **{k: list(v) for k, v in (extra_tables or {}).items()}}
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    paths.append(json_path)
    machine_path = os.path.join(out_dir, "machine.json")
    with open(machine_path, "w") as f:
        json.dump(machine, f, indent=2)
    paths.append(machine_path)
    progress("wrote " + ", ".join(paths))
    return paths


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib not installed: no plot (pip install 'feeder[bench]')")
        return None
    return plt
