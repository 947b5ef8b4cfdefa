"""Shutdown: close() with every stage blocked, twice, from other
threads and from inside the pipeline; Ctrl-C while the training loop waits in
``next()`` and interpreter exit with a running feeder (both in subprocesses,
with real signals).

Interleavings are forced with events, or by polling the pipeline's own state
under a deadline; no test sleeps in the hope that threads have run.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.support import MemorySource, drain, feeder_threads
from tests.support.faults import (SIDE, Child, Gate, consume_in_thread, assert_exactly_once, delivered_hashes, distinct_jpegs,
                            feeder_factory, reference_hash, stage_waiting, wait_feeder_threads_within,
                            wait_no_feeder_threads, wait_until)
from feeder import FeederError, ops
from feeder.testing import pass_of, start_pass

CLOSE_BOUND_S = 1.0  # the documented promise: close() returns within about a second


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return distinct_jpegs(40, seed=300)


@pytest.fixture(scope="module")
def many_blobs() -> list[bytes]:
    """Three times what the pool of the downstream test can hold (about 19 batches of
    2 with its threads and queues): its sampler must come to wait for a buffer. With
    40 samples the pool and the batch the loop holds could take the whole source."""
    return distinct_jpegs(120, seed=301)


make = feeder_factory(batch_size=2, transforms=[ops.CenterCrop(SIDE)], wrap=MemorySource, seed=5)


def timed_close(f) -> float:
    t0 = time.monotonic()
    f.close()
    return time.monotonic() - t0


# -- close() with every stage blocked -------------------------------------------------------------

@pytest.mark.parametrize("augment_threads", [2, 0])
@pytest.mark.parametrize("ordered", [True, False])
def test_close_when_downstream_is_full(many_blobs, ordered, augment_threads):
    """The training loop stops reading: output queue full, transfer blocked putting, the
    sampler blocked waiting for a free buffer, the pools starved."""
    # Few reads in flight, and a source larger than the buffer pool can hold.
    f = make(many_blobs, queue_size=1, decode_threads=3, augment_threads=augment_threads, ordered=ordered,
             read_threads=2)
    try:
        it = iter(f)
        next(it)  # the pass starts at the first next(); then the loop stops reading
        run = pass_of(it)

        def backed_up():
            return (run.output.depth() == run.output.maxsize
                    and stage_waiting(run, "transfer", 2) and stage_waiting(run, "sampler", 2)
                    and stage_waiting(run, "decode", 1)
                    and (not augment_threads or stage_waiting(run, "augment", 1)))

        assert wait_until(backed_up, 10), f"pipeline never backed up:\n{f.stats()}"
        took = timed_close(f)
        assert took < CLOSE_BOUND_S, f"close() took {took:.2f} s"
        assert wait_no_feeder_threads(1.0) == []
        with pytest.raises(StopIteration):
            next(it)
    finally:
        f.close()


@pytest.mark.parametrize("augment_threads", [2, 0])
def test_close_when_upstream_is_full(blobs, augment_threads):
    """Threads stuck in a transform (augment threads, or decode threads running it
    inline): the queues and the sampler back up behind them, and the training loop
    waits in next()."""
    gate = Gate()
    f = make(blobs, [gate, ops.CenterCrop(SIDE)], decode_threads=2, augment_threads=augment_threads,
             read_threads=2)  # few reads in flight: the pool cannot hold the whole source
    try:
        it = iter(f)
        consumer, consumer_result = consume_in_thread(it)
        # The consumer's first next() starts the pass.
        assert wait_until(lambda: pass_of(it) is not None, 10), "the pass never started"
        run = pass_of(it)

        def backed_up():
            # Both threads that run the transforms (augment, or decode when inline)
            # are inside it; the sampler is blocked (queue full, or no free buffer:
            # the loop waits for the first batch, so the pool does not grow).
            return (len(gate.callers) >= 2 and stage_waiting(run, "sampler", 2)
                    and stage_waiting(run, "transfer", 1)
                    and f.stats().waiting_in_next == 1)

        assert wait_until(backed_up, 10), f"pipeline never backed up:\n{f.stats()}"
        took = timed_close(f)
        assert took < CLOSE_BOUND_S + 0.5, f"close() took {took:.2f} s"
        consumer.join(2.0)
        assert not consumer.is_alive() and consumer_result == ["stop"]
        # Everything but the threads inside the user's transform is gone already.
        assert wait_feeder_threads_within(gate.callers, 1.0) <= gate.callers
    finally:
        gate.release.set()
        f.close()
    assert wait_no_feeder_threads(5.0) == []


# -- close() twice, concurrently, from other threads, from inside ----------------------------------

def test_close_twice_and_after_exhaustion(blobs):
    f = make(blobs)
    batches, err = drain(f, timeout=20)
    assert err is None and len(batches) == 20
    assert timed_close(f) < CLOSE_BOUND_S
    assert timed_close(f) < CLOSE_BOUND_S
    assert f.closed
    with pytest.raises(FeederError, match="closed"):
        iter(f)
    with f:  # the context manager on a closed feeder closes again, quietly
        pass


def test_close_before_any_pass(blobs):
    f = make(blobs)
    assert not feeder_threads()
    f.close()
    f.close()
    with pytest.raises(FeederError, match="closed"):
        iter(f)


def test_close_from_many_threads_at_once(blobs):
    f = make(blobs, queue_size=1)
    it = iter(f)
    next(it)
    barrier = threading.Barrier(8, timeout=10)
    errors: list = []

    def closer():
        try:
            barrier.wait()
            f.close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=closer, name=f"test-closer-{i}", daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert f.closed and wait_no_feeder_threads(1.0) == []
    with pytest.raises(StopIteration):
        next(it)


def test_close_from_another_thread_wakes_the_waiting_consumer(blobs):
    gate = Gate()
    f = make(blobs, [gate, ops.CenterCrop(SIDE)], augment_threads=1)
    consumer, outcome = consume_in_thread(f)
    try:
        assert gate.entered.wait(10)
        assert wait_until(lambda: f.stats().waiting_in_next == 1, 10)
        closer = threading.Thread(target=f.close, name="test-closer", daemon=True)
        closer.start()
        consumer.join(CLOSE_BOUND_S + 1.0)
        assert not consumer.is_alive() and outcome == ["stop"]
        closer.join(CLOSE_BOUND_S + 1.0)
        assert not closer.is_alive()
    finally:
        gate.release.set()
        f.close()


def test_close_inside_the_training_loop(blobs):
    f = make(blobs, queue_size=2)
    it = iter(f)
    seen = 0
    for _ in it:
        seen += 1
        if seen == 2:
            f.close()
    assert seen == 2  # the loop ended right after close(), no stale batch after it
    assert wait_no_feeder_threads(1.0) == []


def test_close_called_from_inside_a_transform(blobs):
    """A transform (a feeder thread) closes its own feeder: no deadlock, the loop ends."""
    holder: dict = {}
    closed_by: list = []

    def closing(img, rng):
        if not closed_by:
            closed_by.append(threading.current_thread().name)
            holder["f"].close()
        return img

    f = make(blobs, [closing, ops.CenterCrop(SIDE)], decode_threads=2, augment_threads=2)
    holder["f"] = f
    batches, err = drain(f, timeout=20)
    assert err is None or isinstance(err, FeederError)
    assert f.closed and closed_by
    assert wait_no_feeder_threads(3.0) == []


def test_new_pass_after_abandoned_passes_is_exact(blobs):
    """Several passes abandoned mid-way (each stops the last); the next full pass is exact."""
    hashes = [reference_hash(b) for b in blobs]
    with make(blobs, queue_size=1, decode_threads=3, ordered=False) as f:
        for k in range(5):
            it = iter(f)
            for _ in range(k % 3 + 1):
                next(it)
        batches, err = drain(f, timeout=20)
        assert err is None
        assert_exactly_once(delivered_hashes(batches), hashes)
        assert f.stats().buffers <= f.num_buffers  # abandoned passes gave their buffers back


# -- Ctrl-C and interpreter exit, in subprocesses ---------------------------------------------------

SIGINT_BLOCKED = """
gate = threading.Event()
def stuck(img, rng):
    gate.wait(60)  # a transform that never finishes while the test runs
    return img
f = Feeder(Mem(BLOBS), 4, [stuck, ops.CenterCrop(32)], seed=0, decode_threads=2, augment_threads=1)
it = iter(f)
main = threading.main_thread()

def announce():
    # Say "waiting" only once the main thread is really blocked inside next().
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main.ident)
        names = set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        if {"__next__", "get"} <= names:
            say(event="waiting")
            return
        time.sleep(0.005)
    say(event="never-blocked")

threading.Thread(target=announce, daemon=True).start()
try:
    next(it)
    say(event="unexpected-batch")
except KeyboardInterrupt:
    caught = time.monotonic()
    left = live_feeder_threads(2.0, allowed={"feeder-augment"})
    say(event="interrupted", at=caught, stopped=pass_of(it).stopped(), left=left)
    raise
"""

SIGINT_RUNNING = """
f = Feeder(Mem(BLOBS), 4, [ops.RandomResizedCrop(24)], seed=0, decode_threads=2, augment_threads=1,
           queue_size=2)
n = 0
try:
    while True:
        for x, y in f:
            n += 1
            if n == 20:
                say(event="running")
except KeyboardInterrupt:
    say(event="interrupted", at=time.monotonic())
    raise
"""


def _expect_killed_by_sigint(child: Child, rc: int) -> None:
    # CPython exits through SIGINT itself after an uncaught KeyboardInterrupt.
    assert rc in (-signal.SIGINT, 128 + signal.SIGINT), f"rc={rc}; stderr:\n{child.stderr}"
    assert "KeyboardInterrupt" in child.stderr


def _interrupt(script: str, ready: str) -> tuple[dict, float, int, Child]:
    """Run ``script``; once it reports ``ready``, send SIGINT. Returns (report, sent, rc, child)."""
    child = Child(script)
    try:
        assert json.loads(child.expect_line(60)) == {"event": ready}
        sent = time.monotonic()
        os.kill(child.proc.pid, signal.SIGINT)
        report = json.loads(child.expect_line(15))
        rc = child.wait(20)
    finally:
        child.kill()
    return report, sent, rc, child


def test_sigint_while_waiting_in_next_propagates_promptly():
    report, sent, rc, child = _interrupt(SIGINT_BLOCKED, "waiting")
    assert report["event"] == "interrupted"
    delay = report["at"] - sent  # CLOCK_MONOTONIC is system-wide on Linux
    assert delay < 1.0, f"KeyboardInterrupt took {delay:.2f} s to reach the training loop"
    assert report["stopped"] is True  # the feeder stopped its pass
    # Every thread but the one inside the never-finishing transform has exited.
    assert set(report["left"]) <= {"feeder-augment"}, report["left"]
    _expect_killed_by_sigint(child, rc)


def test_sigint_while_iterating_a_busy_feeder():
    report, sent, rc, child = _interrupt(SIGINT_RUNNING, "running")
    assert report["event"] == "interrupted"
    assert report["at"] - sent < 1.0
    _expect_killed_by_sigint(child, rc)


EXIT_CASES = {
    # The training loop stops reading: every stage blocked on a full queue at exit.
    "pipeline-backed-up": """
f = Feeder(Mem(BLOBS), 2, [ops.CenterCrop(32)], seed=0, queue_size=1, decode_threads=3)
it = iter(f)
next(it)
say(event="exiting")
""",
    # A worker is stuck in user code forever (not even a timeout): exit must not wait for it.
    "thread-stuck-in-user-code": """
forever = threading.Event()
def stuck(img, rng):
    forever.wait()
    return img
f = Feeder(Mem(BLOBS), 2, [stuck, ops.CenterCrop(32)], seed=0, decode_threads=2, augment_threads=1)
it = iter(f)
start_pass(it)  # the pass starts (as a first next() would, without waiting for a batch)
deadline = time.monotonic() + 30
while not any(t.name.startswith("feeder-augment") and t.is_alive() for t in threading.enumerate()):
    time.sleep(0.01)
say(event="exiting")
""",
    # An exception escapes the training loop mid-epoch: traceback, exit status 1, no hang.
    "uncaught-exception": """
f = Feeder(Mem(BLOBS), 2, [ops.CenterCrop(32)], seed=0, queue_size=1)
for i, _ in enumerate(f):
    if i == 3:
        say(event="exiting")
        raise RuntimeError("loss is nan")
""",
    # sys.exit() from inside a with-block mid-epoch.
    "sys-exit-in-with": """
with Feeder(Mem(BLOBS), 2, [ops.CenterCrop(32)], seed=0, queue_size=1) as f:
    for i, _ in enumerate(f):
        if i == 3:
            say(event="exiting")
            sys.exit(0)
""",
    # Several feeders alive at once, each mid-epoch.
    "several-feeders": """
fs = [Feeder(Mem(BLOBS), 2, [ops.CenterCrop(32)], seed=k, queue_size=1) for k in range(3)]
its = [iter(f) for f in fs]
for it in its:
    next(it)
say(event="exiting")
""",
}


@pytest.mark.parametrize("case", sorted(EXIT_CASES))
def test_interpreter_exit_with_a_running_feeder(case):
    child = Child(EXIT_CASES[case])
    try:
        assert json.loads(child.expect_line(60)) == {"event": "exiting"}
        rc = child.wait(20)  # a hang fails here
    finally:
        child.kill()
    expected = 1 if case == "uncaught-exception" else 0
    assert rc == expected, f"rc={rc}; stderr:\n{child.stderr}"
    if case == "uncaught-exception":
        assert "loss is nan" in child.stderr
    assert "Traceback" not in child.stderr or case == "uncaught-exception", child.stderr


# -- the aspect-ratio header scan stops with the feeder -----------------------------------

SLOW_SCAN = """
class Slow(Mem):
    # Every read waits on a gate: the header scan is mid-way while the test acts.
    def __init__(self, blobs):
        super().__init__(blobs)
        self.gate = threading.Event()
        self.started = 0
        self.lock = threading.Lock()
        self.eight = threading.Event()
    def read(self, i):
        with self.lock:
            self.started += 1
            if self.started >= 8:
                self.eight.set()
        self.gate.wait(60)
        return super().read(i)

src = Slow(BLOBS)
f = Feeder(src, 4, [ops.CenterCrop(32)], seed=0, group_by_aspect_ratio=True, decode_threads=2,
           augment_threads=0)
it = iter(f)
start_pass(it)  # the pass starts: its sampler scans the headers (as a first next() would)
assert src.eight.wait(30), "the scan never started"
"""

SCAN_CLOSED = SLOW_SCAN + """
started = src.started
f.close()
src.gate.set()  # the reads in progress end; the scan must start no other
left = live_feeder_threads(10.0)
say(event="closed", started=started, after=src.started, left=left)
"""

SCAN_EXIT = SLOW_SCAN + """
say(event="exiting")
"""


def test_close_stops_the_header_scan():
    child = Child(SCAN_CLOSED)
    try:
        report = json.loads(child.expect_line(60))
        rc = child.wait(20)
    finally:
        child.kill()
    assert rc == 0, child.stderr
    assert report["left"] == [], report  # the scan's threads have exited
    assert report["after"] == report["started"], report  # no read after close()


def test_interpreter_exit_does_not_wait_for_the_header_scan():
    child = Child(SCAN_EXIT)
    try:
        assert json.loads(child.expect_line(60)) == {"event": "exiting"}
        rc = child.wait(20)  # a scan whose reads wait 60 s each: a hang fails here
    finally:
        child.kill()
    assert rc == 0, child.stderr
