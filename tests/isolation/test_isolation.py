"""The isolated engine (``isolation="process"``): the same batches as the thread engine,
errors and skips across the process boundary, stats, passes, shutdown, a killed worker.

Every test runs with the worker forked and spawned (``start_method``). A spawned
worker takes about a second to start, so tests share module-scoped feeders where
they can. Sources and transforms live at module level: a spawned worker imports
them from this module.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import pickle
import re
import signal
import threading
import time

import cv2
import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, REPO_DIR, MemorySource, encode_jpeg, encode_png, feeder_threads, reaped
from tests.support.faults import Child, wait_until
from tests.support.fields import DictSource
from feeder import ConfigError, Feeder, FeederError, FeederTimeoutError, SampleError, ops
from feeder.errors import StageError
from feeder.synthetic import make_detection_sample, make_image
from feeder.testing import engine_of, pass_of, start_pass, worker_process_of

N = 48
BATCH = 8


def _blobs(n: int = N) -> list[bytes]:
    return [encode_jpeg(make_image(40 + 4 * (i % 5), 48, seed=i)) for i in range(n)]


BLOBS = _blobs()
TRANSFORMS = [ops.RandomResizedCrop(24), ops.RandomHorizontalFlip()]


def shared_threads() -> set[threading.Thread]:
    """The receiving threads of this module's shared feeders (alive as long as they are)."""
    return {engine_of(f).receiver for f in _SHARED if not f.closed}


_SHARED: list[Feeder] = []


@pytest.fixture(autouse=True)
def no_feeder_thread_leak():
    """As conftest's, but a shared feeder's receiving thread outlives each test by design."""
    yield
    deadline = time.monotonic() + 2.0
    alive = [t for t in feeder_threads() if t not in shared_threads()]
    while alive and time.monotonic() < deadline:
        for t in alive:
            t.join(0.02)
        alive = [t for t in feeder_threads() if t not in shared_threads()]
    assert not alive, f"feeder threads left running: {[t.name for t in alive]}"


def collect(f: Feeder, limit: int | None = None) -> list:
    """Every batch of one pass as numpy (copies: CPU uint8 batches are buffer views)."""
    out = []
    for i, batch in enumerate(f):
        if isinstance(batch, dict):
            out.append({k: _np(v) for k, v in batch.items()})
        else:
            out.append(tuple(_np(v) for v in batch))
        if limit is not None and i + 1 == limit:
            break
    return out


def _np(value):
    if isinstance(value, torch.Tensor):
        return value.numpy().copy()
    if isinstance(value, list):
        return [_np(v) for v in value]
    return value


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                _same(x[k], y[k])
        else:
            for u, v in zip(x, y):
                _same(u, v)


def _same(u, v) -> None:
    if isinstance(u, list):
        assert len(u) == len(v)
        for p, q in zip(u, v):
            _same(p, q)
    elif isinstance(u, np.ndarray):
        assert u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v)
    else:
        assert u == v


START = "spawn"  # the start method of this module's isolated feeders (see start_method)


@pytest.fixture(scope="module", params=["fork", "spawn"], autouse=True)
def start_method(request):
    """Run the module once per start method: every promise holds under both."""
    global START
    START = request.param
    yield request.param
    START = "spawn"


def make(source, transforms=TRANSFORMS, **options) -> Feeder:
    if options.get("isolation") == "process":
        options.setdefault("start_method", START)
    options.setdefault("seed", 11)
    options.setdefault("shuffle", True)
    options.setdefault("decode_threads", 2)
    options.setdefault("read_threads", 2)
    options.setdefault("timeout", JOIN_TIMEOUT_S)
    return Feeder(source, BATCH, transforms, **options)


@pytest.fixture(scope="module")
def pairs(start_method):
    """One isolated feeder over pairs, shared by the tests that do not close it."""
    f = make(MemorySource(BLOBS), isolation="process")
    assert f.start_method == start_method
    _SHARED.append(f)
    yield f
    f.close()


@pytest.fixture(scope="module")
def reference():
    """The thread engine's epochs 0 and 1 with the same settings."""
    with make(MemorySource(BLOBS)) as f:
        return [collect(f), collect(f)]


# -- the same batches -------------------------------------------------------------------------------

def test_same_batches_as_the_thread_engine(pairs, reference):
    pairs.set_epoch(0)
    first = collect(pairs)
    second = collect(pairs)
    assert_same(first, reference[0])
    assert_same(second, reference[1])
    assert pairs.last_batch.epoch == 1 and pairs.last_batch.number == len(reference[1]) - 1
    labels = np.concatenate([y for _, y in first])
    assert sorted(labels.tolist()) == list(range(N))  # exactly once


def make_dict(index: int) -> dict:
    """A sample with a mask, boxes with their labels, a numeric field and a passthrough."""
    img, boxes, labels = make_detection_sample(48, 56, seed=index)
    mask = (np.arange(48 * 56).reshape(48, 56) // 56 + index) % 5
    return {"image": encode_png(img), "mask": encode_png(mask.astype(np.uint8)), "boxes": boxes,
            "box_labels": labels, "weight": np.float32(index / 10), "name": f"sample-{index}"}


def test_dict_samples_same_as_the_thread_engine():
    transforms = [ops.RandomResizedCrop(32), ops.RandomHorizontalFlip()]
    with make(DictSource(20, make_dict), transforms) as f:
        expected = collect(f)
    with make(DictSource(20, make_dict), transforms, isolation="process") as f:
        got = collect(f)
        again = collect(f)  # a second pass reuses the buffers: the fields announced once
    assert_same(got, expected)
    assert got[0].keys() == {"image", "mask", "boxes", "box_labels", "weight", "name"}
    assert got[0]["mask"].shape == (BATCH, 32, 32)
    assert [n for b in got for n in b["name"]] != [n for b in again for n in b["name"]]
    assert sorted(n for b in again for n in b["name"]) == sorted(f"sample-{i}" for i in range(20))


class UnpicklableFieldSource:
    """Dict samples whose passed-through ``meta`` holds a lock (sample 3) or a lambda
    (sample 10): values a custom source may build that cannot cross to the training process."""

    def __len__(self) -> int:
        return 24

    def read(self, index: int) -> dict:
        meta = {3: threading.Lock(), 10: lambda: index}.get(index, f"meta-{index}")
        return {"image": BLOBS[index], "label": index, "meta": meta}


def test_unpicklable_field_names_the_field_and_the_sample():
    with make(UnpicklableFieldSource(), isolation="process", shuffle=False) as f:
        with pytest.raises(SampleError) as info:
            collect(f)
    err = info.value
    assert err.index == 3 and "field 'meta'" in str(err) and "cannot be pickled" in str(err)
    assert "lock" in str(err)


def test_unpicklable_field_is_skipped_and_counted_under_skip():
    with make(UnpicklableFieldSource(), isolation="process", shuffle=False, on_error="skip") as f:
        batches = collect(f)
        assert f.stats().skipped == 2
    labels = sorted(int(v) for b in batches for v in b["label"])
    assert labels == [i for i in range(24) if i not in (3, 10)]
    assert sorted(m for b in batches for m in b["meta"]) == sorted(
        f"meta-{i}" for i in range(24) if i not in (3, 10))


def test_early_break_then_a_new_pass(pairs, reference):
    pairs.set_epoch(0)
    head = collect(pairs, limit=2)
    assert_same(head, reference[0][:2])
    gc.collect()  # the abandoned iterator's pass stops
    pairs.set_epoch(0)
    assert_same(collect(pairs), reference[0])


def test_abandoned_pass_raises_when_replaced(pairs):
    pairs.set_epoch(0)
    it = iter(pairs)
    next(it)
    pairs.set_epoch(1)
    collect(pairs, limit=1)
    with pytest.raises(FeederError, match="new pass"):
        next(it)


def test_resume_mid_epoch(pairs, reference):
    pairs.set_epoch(1)
    it = iter(pairs)
    head = [tuple(_np(v) for v in next(it)) for _ in range(3)]
    state = pairs.state_dict()
    del it
    gc.collect()
    pairs.load_state_dict(state)
    rest = collect(pairs)
    assert_same(head + rest, reference[1])
    pairs.set_epoch(1)
    pairs.skip(2)
    assert_same(collect(pairs), reference[1][2:])


def test_stats_include_the_worker_stages(pairs):
    pairs.set_epoch(0)
    before = pairs.stats()
    batches = collect(pairs)
    s = pairs.stats()
    assert s.batches - before.batches == len(batches)
    assert s.samples - before.samples == N
    assert s.stage("decode").items - before.stage("decode").items == N
    assert s.stage("read").items - before.stage("read").items == N
    assert s.stage("transfer").items - before.stage("transfer").items == len(batches)
    assert s.stage("sampler").items > before.stage("sampler").items
    assert s.buffers >= 2
    assert {q.name for q in s.queues} >= {"decode", "collate", "output"}


def test_worker_pid_names_the_worker_process(pairs):
    pid = pairs.worker_pid
    with open(f"/proc/{pid}/stat") as stat:
        parent = int(stat.read().rsplit(") ", 1)[1].split()[1])
    assert pid != os.getpid() and parent == os.getpid()  # our child, the worker
    with make(MemorySource(BLOBS[:BATCH]), isolation="thread") as threads:
        assert threads.worker_pid is None
    if START == "fork":  # a second worker is cheap only when forked
        f = make(MemorySource(BLOBS[:BATCH]), isolation="process")
        assert f.worker_pid not in (None, pid)
        f.close()
        assert f.worker_pid is None


def test_worker_ignores_sigint(pairs):
    # A Ctrl-C reaches the whole process group; the training process decides what stops.
    pid = pairs.worker_pid
    os.kill(pid, signal.SIGINT)
    pairs.set_epoch(0)
    assert len(collect(pairs)) == N // BATCH
    assert worker_process_of(pairs).is_alive()


# -- errors ----------------------------------------------------------------------------------------

class Unpicklable(Exception):
    """An error whose constructor signature defeats pickling (its cause must not sink the message)."""

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def raise_unpicklable(img, rng):
    raise Unpicklable("x", "y")


def test_errors_name_the_sample_and_path():
    blobs = list(BLOBS[:16])
    blobs[5] = b"\xff\xd8 not a jpeg"
    names = [f"/data/img{i}.jpg" for i in range(16)]
    with make(MemorySource(blobs, names=names), isolation="process", shuffle=False) as f:
        with pytest.raises(SampleError) as info:
            collect(f)
    err = info.value
    assert (err.stage, err.index, err.path) == ("decode", 5, "/data/img5.jpg")
    assert "/data/img5.jpg" in str(err) and err.__cause__ is not None


def test_error_pickling():
    err = StageError("sampler", "broke")
    err.__cause__ = KeyError("k")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.stage, str(back)) == (StageError, "sampler", str(err))
    assert isinstance(back.__cause__, KeyError)
    sample = SampleError("read", 3, "/x.jpg", OSError("gone"))
    back = pickle.loads(pickle.dumps(sample))
    assert (back.stage, back.index, back.path, str(back)) == ("read", 3, "/x.jpg", str(sample))


def test_skip_policy_and_unpicklable_causes():
    blobs = list(BLOBS[:24])
    for i in (3, 10):
        blobs[i] = b"broken"
    with make(MemorySource(blobs), isolation="process", on_error="skip", shuffle=False) as f:
        labels = np.concatenate([y for _, y in collect(f)])
        assert sorted(labels.tolist()) == [i for i in range(24) if i not in (3, 10)]
        assert f.stats().skipped == 2
        state = f.state_dict()
        assert state["skipped_total"] == 2
    with make(MemorySource(BLOBS[:16]), [raise_unpicklable, ops.CenterCrop(24)],
              isolation="process") as f:
        with pytest.raises(FeederError, match="Unpicklable: x/y"):
            collect(f)


def test_unpicklable_source_and_transforms(start_method):
    src = MemorySource(BLOBS[:16])
    src.lock = threading.Lock()
    transforms = [ops.CenterCrop(24), lambda img, rng: img]
    if start_method == "spawn":
        with pytest.raises(ConfigError, match=r"transforms\[1\].*cannot be pickled.*"
                                              r"start_method='fork'.*isolation='thread'"):
            make(MemorySource(BLOBS[:16]), transforms, isolation="process")
        with pytest.raises(ConfigError, match=r"the source .*MemorySource.*module level"):
            make(src, isolation="process")
        return
    # A forked worker gets the objects themselves: nothing is pickled.
    with make(MemorySource(BLOBS[:16]), [ops.CenterCrop(24)]) as f:
        expected = collect(f)
    with make(src, transforms, isolation="process") as f:
        assert_same(collect(f), expected)


def test_isolation_option_is_checked():
    with pytest.raises(ValueError, match="isolation"):
        make(MemorySource(BLOBS[:16]), isolation="processes")


# -- shutdown --------------------------------------------------------------------------------------

def stall(img, rng):
    time.sleep(60)  # a transform stuck in user code in the worker
    return img


def test_close_with_the_worker_stuck_is_bounded():
    f = make(MemorySource(BLOBS[:16]), [stall, ops.CenterCrop(24)], isolation="process")
    it = iter(f)
    start_pass(it)
    # Until the worker reports a sample in the stuck transform.
    assert wait_until(lambda: pass_of(it).in_flight(), JOIN_TIMEOUT_S), "no sample reached the transform"
    process = worker_process_of(f)
    t0 = time.monotonic()
    f.close()
    took = time.monotonic() - t0
    assert took < 5.0, f"close() took {took:.2f} s"  # a hang bound, not a speed figure
    process.join(JOIN_TIMEOUT_S)
    assert process.exitcode is not None
    with pytest.raises(StopIteration):
        next(it)


def test_a_timeout_names_the_sample_stuck_in_the_worker():
    f = make(MemorySource(BLOBS[:16]), [stall, ops.CenterCrop(24)], isolation="process", timeout=2.0,
             decode_threads=1, read_threads=0, shuffle=False)
    try:
        it = iter(f)
        start_pass(it)
        # Once the worker reports the sample in the stuck transform, the wait begins.
        assert wait_until(lambda: pass_of(it).in_flight(), JOIN_TIMEOUT_S), "no sample reached the transform"
        with pytest.raises(FeederTimeoutError) as caught:
            next(it)
    finally:
        f.close()
    # Named as stuck (in the transform for more than half of the wait), or as the
    # oldest sample in flight.
    assert re.search(r"sample 0 \(mem://0\) in stage 'augment' for \d\.\d s", str(caught.value)), \
        str(caught.value)


@pytest.mark.parametrize("sig, why", [(signal.SIGKILL, "OOM killer"), (signal.SIGBUS, "/dev/shm")])
def test_worker_killed_raises_a_clear_error(sig, why):
    # pytest's faulthandler, inherited by a forked worker, would catch the signal,
    # print a "Fatal Python error" dump of ~130 lines into a passing run's log
    # (hiding real failures) and, dumping from a damaged process, could die by
    # another signal than the one sent. The worker is started without it.
    was_enabled = faulthandler.is_enabled()
    faulthandler.disable()
    try:
        f = make(MemorySource(BLOBS), isolation="process", queue_size=1)
    finally:
        if was_enabled:
            faulthandler.enable()
    try:
        it = iter(f)
        next(it)
        os.kill(f.worker_pid, sig)
        with pytest.raises(FeederError, match=f"killed by {sig.name}.*{why}"):
            for _ in range(N):
                next(it)
        with pytest.raises(FeederError, match=sig.name):
            collect(f)  # a new pass says so too
    finally:
        f.close()


class LeavesASegment(MemorySource):
    """Reading sample 0 leaves a named segment in /dev/shm under the worker's pid, as
    torch's allocation of a batch buffer does when the worker is killed between
    creating the name and unlinking it (a window too short to hit on purpose)."""

    def read(self, index):
        if index == 0:
            fd = os.open(f"/dev/shm/torch_{os.getpid()}_4242_{index}", os.O_CREAT | os.O_RDWR, 0o600)
            os.ftruncate(fd, 4096)
            os.close(fd)
        return super().read(index)


def _worker_segments(pid: int) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{pid}_")}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="named shared memory is Linux's /dev/shm")
@pytest.mark.parametrize("when", ["seen-dead", "closed"])
def test_killed_worker_leaves_no_shared_memory_segment(when):
    f = make(LeavesASegment(BLOBS), isolation="process", queue_size=1, shuffle=False)
    pid = f.worker_pid
    try:
        it = iter(f)
        next(it)  # sample 0 was read (its batch came): the segment exists
        assert _worker_segments(pid), "the worker did not leave its segment"
        os.kill(pid, signal.SIGKILL)
        if when == "seen-dead":
            # The training process reclaims what the worker left when it sees it die.
            with pytest.raises(FeederError, match="SIGKILL"):
                for _ in range(N):
                    next(it)
            assert not _worker_segments(pid)
    finally:
        f.close()
    assert not _worker_segments(pid)


def test_a_worker_that_dies_while_a_pass_starts_fails_that_pass(monkeypatch):
    """The worker dies after the new pass's check of it and before the pass is
    listed: the receiver fails the passes it finds, not this one, so the start
    sees the death itself; next() raises instead of waiting for ever."""
    from feeder.isolation import engine as iso

    f = make(MemorySource(BLOBS), isolation="process", shuffle=False)
    try:
        assert sum(1 for _ in f) > 0
        engine = f._engine
        original = iso.ProcessEngine._new_pass

        def new_pass_after_the_death(self, *args, **kw):
            os.kill(self.process.pid, signal.SIGKILL)
            assert wait_until(lambda: self.dead is not None, JOIN_TIMEOUT_S), "the death was not seen"
            return original(self, *args, **kw)

        monkeypatch.setattr(iso.ProcessEngine, "_new_pass", new_pass_after_the_death)
        box: dict = {}

        def first():
            try:
                box["batch"] = next(iter(f))
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                box["error"] = exc

        t = threading.Thread(target=first, daemon=True)
        t.start()
        t.join(JOIN_TIMEOUT_S)
        assert not t.is_alive(), "next() waited for a pass whose worker had died"
        assert isinstance(box.get("error"), FeederError) and "SIGKILL" in str(box["error"])
        assert engine.dead is not None
    finally:
        f.close()


def test_unclosed_feeder_is_collected_and_its_worker_exits():
    f = make(MemorySource(BLOBS), isolation="process")
    it = iter(f)
    next(it)
    process = worker_process_of(f)
    del f, it
    gc.collect()
    # The collected feeder's close runs in the reaper thread, which joins (and
    # reaps) the worker itself: wait for it rather than join concurrently.
    reaped()
    process.join(JOIN_TIMEOUT_S)
    assert process.exitcode is not None, "the worker outlived its collected feeder"


EXIT_SCRIPT = """
sys.path.insert(0, {repo!r})
from tests.support import MemorySource
from feeder import Feeder, ops
if __name__ == "__main__":
    f = Feeder(MemorySource(BLOBS), 2, [ops.CenterCrop(24)], seed=0, queue_size=1,
               isolation="process", start_method={start!r})
    it = iter(f)
    next(it)
    say(event="exiting", worker=f.worker_pid)
    {ending}
"""


@pytest.mark.parametrize("ending", ["pass", "raise RuntimeError('loss is nan')",
                                    "os.kill(os.getpid(), signal.SIGKILL)"])
def test_interpreter_exit_and_death_of_the_training_process(ending, start_method):
    repo = REPO_DIR
    child = Child("import signal\n" + EXIT_SCRIPT.format(repo=repo, ending=ending, start=start_method))
    try:
        report = json.loads(child.expect_line(60))
        assert report["event"] == "exiting"
        rc = child.wait(20)  # a hang fails here
    finally:
        child.kill()
    expected = {"pass": 0, "os.kill(os.getpid(), signal.SIGKILL)": -signal.SIGKILL}.get(ending, 1)
    assert rc == expected, f"rc={rc}; stderr:\n{child.stderr}"
    # The worker follows the training process out (pipe end, PR_SET_PDEATHSIG).
    # Not this process's child: nothing to wait on but its /proc entry.
    assert wait_until(lambda: not _alive(report["worker"]), 10), \
        "the worker process outlived the training process"


def test_feeder_built_in_a_thread_that_ends_keeps_its_worker(start_method):
    """The kernel's parent-death signal fires when the thread that started a process
    ends, not the process: a feeder built in a short-lived thread (a set-up thread,
    a pool building loaders) keeps its worker once that thread is gone."""
    built: dict = {}

    def build() -> None:
        f = built["feeder"] = make(MemorySource(BLOBS[:16]), [ops.CenterCrop(24)],
                                   isolation="process")
        # A whole pass here: the worker has started up (and set what it sets) while
        # this thread still runs.
        built["batches"] = len(collect(f))

    setup = threading.Thread(target=build, name="set-up", daemon=True)
    setup.start()
    setup.join(JOIN_TIMEOUT_S)
    assert not setup.is_alive()
    with built["feeder"] as f:
        assert built["batches"] == 16 // BATCH
        assert f.start_method == start_method
        for _ in range(3):
            batches = collect(f)
            assert sum(len(b[1]) for b in batches) == 16
        assert worker_process_of(f).is_alive()


SIGINT_SCRIPT = """
sys.path.insert(0, {repo!r})
from tests.support import MemorySource
from feeder.testing import pass_of
from tests.isolation.test_isolation import stall
if __name__ == "__main__":
    f = Feeder(MemorySource(BLOBS), 2, [stall, ops.CenterCrop(24)], seed=0, isolation="process",
               start_method={start!r})
    it = iter(f)
    main = threading.main_thread()

    def announce():
        # Say "waiting" only once the main thread is really blocked inside next().
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main.ident)
            names = set()
            while frame is not None:
                names.add(frame.f_code.co_name)
                frame = frame.f_back
            if {{"__next__", "get"}} <= names and pass_of(it) is not None and pass_of(it).in_flight():
                say(event="waiting", worker=f.worker_pid)
                return
            time.sleep(0.01)
        say(event="never-blocked")

    threading.Thread(target=announce, daemon=True).start()
    try:
        next(it)
        say(event="unexpected-batch")
    except KeyboardInterrupt:
        say(event="interrupted", at=time.monotonic(), stopped=pass_of(it).stopped())
        raise
"""


def test_ctrl_c_in_next_stops_the_pass_and_the_worker_follows(start_method):
    repo = REPO_DIR
    child = Child(SIGINT_SCRIPT.format(repo=repo, start=start_method))
    try:
        ready = json.loads(child.expect_line(60))
        assert ready["event"] == "waiting", ready
        sent = time.monotonic()
        os.kill(child.proc.pid, signal.SIGINT)
        report = json.loads(child.expect_line(15))
        rc = child.wait(20)
    finally:
        child.kill()
    assert report["event"] == "interrupted" and report["stopped"] is True
    assert report["at"] - sent < 5.0  # a hang bound: the wait in next() is interruptible
    assert rc in (-signal.SIGINT, 128 + signal.SIGINT), f"rc={rc}; stderr:\n{child.stderr}"
    assert "KeyboardInterrupt" in child.stderr
    assert wait_until(lambda: not _alive(ready["worker"]), 10), "the worker outlived the program"


def test_objects_the_worker_cannot_import_are_named(start_method):
    # ``Mem`` is defined in the script's __main__ ('python -c'): it pickles here, by
    # reference, but a spawned process cannot import it; a forked one has it.
    child = Child(f"""
f = Feeder(Mem(BLOBS), 2, [ops.CenterCrop(24)], seed=0, isolation="process",
           start_method={start_method!r})
try:
    say(error=None, batch=len(next(iter(f))[1]))
except Exception as exc:
    say(error=f"{{type(exc).__name__}}: {{exc}}")
f.close()
""")
    try:
        report = json.loads(child.expect_line(60))
        assert child.wait(20) == 0, child.stderr
    finally:
        child.kill()
    if start_method == "fork":
        assert report == {"error": None, "batch": 2}
        return
    assert report["error"] is not None
    assert report["error"].startswith("FeederError: the feeder's worker process could not load")
    assert "Mem" in report["error"] and "isolation='thread'" in report["error"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
