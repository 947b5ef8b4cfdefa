"""Measuring a loader the same way whichever it is: wall time, CPU time, first batch, memory.

Every measured run happens in a fresh child process (see :mod:`feeder.bench.runner`),
so that each loader starts cold, DataLoader's worker processes are its own
children, and memory can be summed over exactly that process tree. The parent
keeps only a sampler thread reading ``/proc``; it never loads images itself.

Memory is PSS (proportional set size) from ``/proc/<pid>/smaps_rollup``: a page
shared by N processes counts 1/N in each, so the sum over a DataLoader's main
process and its forked workers is the memory the machine really spends, not
N times torch's shared libraries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# PSS is sampled this often (seconds). Reading smaps_rollup walks the page
# tables of a process and takes its memory-map lock. Measured: sampling a
# feeder run at 20 Hz cut its throughput by 3-5% (1355-1414 against
# 1431-1461 img/s unsampled, alternating, 3 epochs of 2000 images); at 4 Hz the
# cost is a fifth of that, and a loader's memory plateaus within its first
# second, so the peak of runs lasting several seconds is still caught.
_SAMPLE_INTERVAL_S = 0.25


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads'), from /proc; empty when it is gone."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants alive now."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(_children(p))
    return tree


def pss_bytes(pid: int) -> int | None:
    """PSS of one process in bytes, or None when it cannot be read (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # kernels before 4.14 lack smaps_rollup; psutil sums smaps instead
        import psutil

        return int(psutil.Process(pid).memory_full_info().pss)
    except Exception:  # noqa: BLE001 - psutil missing, process gone, or no permission
        return None


def tree_pss_bytes(pid: int) -> int | None:
    """PSS summed over ``pid`` and its descendants, or None when unreadable."""
    values = [pss_bytes(p) for p in process_tree(pid)]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def resident_bytes(buffer: Any) -> int | None:
    """Resident bytes of this process's mapping that holds ``buffer``'s first byte
    (a writable buffer: an mmap, or a memoryview of one), from ``/proc/self/smaps``;
    None when no mapping holds it (or there is no ``/proc``)."""
    import numpy as np

    addr = np.frombuffer(buffer, np.uint8).ctypes.data
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= addr < end
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    return None


class PeakPSS:
    """Samples the PSS of a process tree in a background thread and keeps the peak.

    Args:
        pid: Root of the tree (the child process running a loader).
        interval_s: Seconds between samples.
    """

    def __init__(self, pid: int, interval_s: float = _SAMPLE_INTERVAL_S) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-pss", daemon=True)

    def __enter__(self) -> "PeakPSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            value = tree_pss_bytes(self.pid)
            if value is not None:
                self.samples += 1
                if self.peak is None or value > self.peak:
                    self.peak = value
            self._stop.wait(self.interval_s)


@dataclass
class RunResult:
    """What one measured child run reports.

    Attributes:
        spec: The run's specification (loader kind and settings).
        ok: The run finished and reported.
        images: Samples delivered over all epochs.
        wall_s: Seconds from building the loader to the last batch of the last epoch.
        cpu_s: CPU seconds (user + system) of the process and its reaped children
            over the same span.
        first_batch_s: Seconds from building the loader to the first batch.
        peak_pss: Peak PSS of the process tree in bytes (None where /proc is unreadable).
        extra: Anything else the run reported (stats of a feeder, ceiling parts).
        error: The child's stderr tail when it failed.
    """

    spec: dict[str, Any]
    ok: bool = False
    images: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    first_batch_s: float = 0.0
    peak_pss: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def images_per_s(self) -> float:
        return self.images / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_per_image_s(self) -> float:
        return self.cpu_s / self.images if self.images else 0.0


def run_child(spec: dict[str, Any], timeout_s: float = 900.0, memory: bool = True) -> RunResult:
    """Run one measurement in a fresh ``python -m feeder.bench.runner`` process.

    Args:
        spec: What to run (see :func:`feeder.bench.runner.execute`).
        timeout_s: Kill the child after this many seconds.
        memory: Sample the PSS of the child's process tree. Each sample takes the
            child's memory-map lock, so a run timing short steps goes without.

    Returns:
        The child's report, with the peak PSS of its process tree filled in.
        A failed or timed-out child gives ``ok=False`` and its stderr in ``error``.
    """
    result = RunResult(spec=spec)
    with tempfile.TemporaryDirectory(prefix="feeder-bench-") as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "feeder.bench.runner", json.dumps(spec), report]
        # spec["env"]: variables for this child only (FEEDER_NO_JPEG_EXT=1: the simplejpeg path).
        env = {**os.environ, **{str(k): str(v) for k, v in spec.get("env", {}).items()}}
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        try:
            with PeakPSS(proc.pid) if memory else contextlib.nullcontext() as pss:
                _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            result.error = f"timed out after {timeout_s:.0f} s"
            return result
        except BaseException:  # Ctrl-C (or any error here): no child measures on alone
            proc.kill()
            proc.wait()
            raise
        result.peak_pss = pss.peak if memory else None
        if proc.returncode != 0 or not os.path.exists(report):
            tail = err.decode(errors="replace")[-2000:]
            result.error = f"exit status {proc.returncode}: {tail}"
            # One line (the child's last, which names the error); the whole tail is in
            # result.error, and in the log at debug level (-v).
            last = next((x for x in reversed(tail.strip().splitlines()) if x.strip()), "no output")
            log.warning("bench run %s failed: exit status %s: %s", spec.get("name"), proc.returncode,
                        last.strip())
            log.debug("bench run %s stderr: %s", spec.get("name"), tail)
            return result
        with open(report) as f:
            data = json.load(f)
    result.ok = True
    result.images = int(data["images"])
    result.wall_s = float(data["wall_s"])
    result.cpu_s = float(data["cpu_s"])
    result.first_batch_s = float(data.get("first_batch_s", 0.0))
    result.extra = data.get("extra", {})
    return result


def _live_children_cpu() -> float:
    """CPU seconds of this process's live child processes (not yet reaped), from /proc."""
    me = str(os.getpid())
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # Fields after the parenthesised command name: state ppid ... utime(12) stime(13).
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[1] == me:
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and all its children.

    Children already reaped are in ``RUSAGE_CHILDREN``; live ones (DataLoader's
    persistent workers) are read from /proc, so neither kind is missed.
    """
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + _live_children_cpu()


def now() -> float:
    """Monotonic seconds, the one clock every wall-time figure uses."""
    return time.perf_counter()
