"""Passes run in helper threads with a bound on every wait, and the feeder
threads a test may leave behind."""

from __future__ import annotations

import threading
import time

import numpy as np

JOIN_TIMEOUT_S = 30.0  # bound on any wait for a whole pass in a test


def feeder_threads() -> list[threading.Thread]:
    """Threads of feeder passes (not the process-wide reaper, which idles on its queue)."""
    return [t for t in threading.enumerate()
            if t.name.startswith("feeder-") and t.name != "feeder-reaper"]


def wait_no_feeder_threads(timeout: float = 2.0) -> list[str]:
    """Join feeder threads for up to ``timeout`` s; return the names still alive."""
    deadline = time.monotonic() + timeout
    # Report the very list that ended the wait: a second look could see a thread
    # started after it (by a garbage-collected feeder) that was never waited for.
    alive = feeder_threads()
    while alive and time.monotonic() < deadline:
        for t in alive:
            t.join(timeout=0.02)
        alive = feeder_threads()
    return [t.name for t in alive]


def drain(iterable, timeout: float = JOIN_TIMEOUT_S, limit: int | None = None):
    """Iterate ``iterable`` in a helper thread; fail the test if it does not finish in time.

    Returns (batches, error): batches as a list of (images, labels) numpy pairs.
    """
    return collect(iterable, timeout, limit, keep=numpy_pair)


def numpy_pair(batch) -> tuple[np.ndarray, np.ndarray]:
    """An (images, labels) batch as numpy copies (a CPU uint8 batch is a view of a
    pool buffer that the next batch reuses)."""
    x, y = batch
    return x.cpu().numpy().copy(), y.cpu().numpy().copy()


def collect(feeder, timeout: float = JOIN_TIMEOUT_S, limit: int | None = None, keep=None):
    """Every batch of one pass (up to ``limit``) as returned (dict or pair), in a
    helper thread; fail the test if the pass does not end within ``timeout``.

    Args:
        keep: What to keep of each batch (say, a copy); the batch itself by default.

    Returns:
        (batches, the exception that ended the pass or None).
    """
    out: list = []
    err: list = []

    def run():
        try:
            for batch in feeder:
                out.append(batch if keep is None else keep(batch))
                if limit is not None and len(out) >= limit:
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            err.append(exc)

    t = threading.Thread(target=run, name="test-collect", daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the pass did not finish within {timeout} s (hang)"
    return out, (err[0] if err else None)


def collected(feeder, **kw) -> list:
    """:func:`collect`'s batches; the error that ended the pass, if any, is raised."""
    out, err = collect(feeder, **kw)
    if err is not None:
        raise err
    return out


def labels_of(batches) -> list[int]:
    return [int(v) for _, y in batches for v in y]


def reaped() -> None:
    """Wait until the reaper thread has run every clean-up queued so far (it runs
    them in order): a dropped batch's buffer, a collected feeder's close."""
    from feeder.engine import reaper as _reaper

    _reaper.ensure_running()  # a process where no feeder has run yet has none
    done = threading.Event()
    _reaper.defer(done.set)
    assert done.wait(JOIN_TIMEOUT_S)


def run_in_thread(fn, timeout: float = JOIN_TIMEOUT_S):
    """Run ``fn`` in a helper thread; fail the test if it does not return in time."""
    out: list = []

    def target():
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(("err", exc))

    t = threading.Thread(target=target, name="test-helper", daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} did not return within {timeout} s (deadlock or hang)"
    kind, value = out[0]
    if kind == "err":
        raise value
    return value
