"""How ``isolation="process"`` starts its worker (``start_method``): the "auto" rule's
choice in each case, explicit values, bad values, and what a forked worker must
not inherit (the parent's pipe end, signal handlers, atexit handlers, stdio
buffers, library thread pools that are not fork-safe).

The promises of the isolated engine under each start method (batches, errors,
skips, stats, shutdown, a killed worker) are tested in ``test_isolation``, which
runs under both fork and spawn.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, REPO_DIR, MemorySource
from tests.support.faults import Child
from feeder import ConfigError, Feeder, FeederError, ops
from feeder.testing import engine_of, worker_process_of
from tests.isolation.test_isolation import BLOBS, assert_same, collect, make

REPO = REPO_DIR


@pytest.fixture(scope="module")
def expected():
    """The thread engine's first pass over the first 16 samples."""
    with make(MemorySource(BLOBS[:16])) as f:
        return collect(f)


# -- the "auto" rule ---------------------------------------------------------------------------------

RULE_SCRIPT = """
sys.path.insert(0, {repo!r})
from tests.support import MemorySource

def build():
    # A picklable source and transforms: each start method can take them.
    return Feeder(MemorySource(BLOBS[:16]), 4, [ops.CenterCrop(24)], seed=0, isolation="process",
                  timeout=30)

if __name__ == "__main__":
    first = build()
    next(iter(first))  # its receiving thread and the reaper run, idle
    say(case="clean, another isolated feeder idle", method=first.start_method)

    release = threading.Event()
    user = threading.Thread(target=release.wait, name="user-thread", daemon=True)
    user.start()
    f = build()
    say(case="a user thread runs", method=f.start_method)
    f.close()
    release.set()
    user.join(10)

    busy = Feeder(MemorySource(BLOBS), 4, [ops.CenterCrop(24)], seed=0, queue_size=1, timeout=30)
    it = iter(busy)
    next(it)  # a thread engine mid-pass: its stage threads run
    f = build()
    say(case="a thread engine runs a pass", method=f.start_method)
    f.close()
    busy.close()

    f = build()
    say(case="clean again", method=f.start_method, batches=len(list(f)))
    f.close()
    first.close()
"""


def test_auto_forks_only_when_no_other_thread_runs():
    child = Child(RULE_SCRIPT.format(repo=REPO))
    try:
        reports = [json.loads(child.expect_line(90)) for _ in range(4)]
        assert child.wait(30) == 0, child.stderr
    finally:
        child.kill()
    assert [(r["case"], r["method"]) for r in reports] == [
        ("clean, another isolated feeder idle", "fork"),
        ("a user thread runs", "spawn"),
        ("a thread engine runs a pass", "spawn"),
        ("clean again", "fork"),
    ]
    assert reports[3]["batches"] == 4


ENDED_PASS_SCRIPT = """
sys.path.insert(0, {repo!r})
from tests.support import MemorySource
from feeder import ConfigError

if __name__ == "__main__":
    val = Feeder(MemorySource(BLOBS[:16]), 4, [ops.CenterCrop(24)], seed=0, timeout=30)
    methods = []
    for _ in range(10):
        assert len(list(val)) == 4  # a pass of a thread engine runs to its end...
        try:  # ...and the next feeder is built at once, its pass threads still exiting
            f = Feeder(MemorySource(BLOBS[:16]), 4, [ops.CenterCrop(24), lambda img, rng: img],
                       seed=0, isolation="process", timeout=30)
        except ConfigError as exc:
            methods.append(str(exc))
            continue
        methods.append(f.start_method)
        f.close()
    say(methods=methods)

    busy = Feeder(MemorySource(BLOBS), 4, [ops.CenterCrop(24)], seed=0, queue_size=1, timeout=30)
    it = iter(busy)
    next(it)  # a pass still running (its threads wait on the full queue) counts
    try:
        Feeder(MemorySource(BLOBS[:16]), 4, [ops.CenterCrop(24), lambda img, rng: img],
               seed=0, isolation="process", timeout=30)
        say(error=None)
    except ConfigError as exc:
        say(error=str(exc))
    busy.close()
    val.close()
"""


def test_auto_forks_right_after_a_thread_engines_pass_ended():
    """The threads of a pass that has ended are waited for, not taken for running
    threads: the choice does not depend on how fast they exit. A pass still
    running still makes "auto" spawn, and a transform that cannot be pickled is
    then an error that says why "auto" chose spawn."""
    child = Child(ENDED_PASS_SCRIPT.format(repo=REPO))
    try:
        methods = json.loads(child.expect_line(120))["methods"]
        error = json.loads(child.expect_line(60))["error"]
        assert child.wait(30) == 0, child.stderr
    finally:
        child.kill()
    assert methods == ["fork"] * 10
    assert error is not None
    assert error.startswith("start_method='auto' chose spawn because other threads are running "
                            "(feeder-"), error
    assert "transforms[1]" in error and "cannot be pickled" in error


def test_auto_spawns_when_cuda_is_initialized(monkeypatch, caplog, expected):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    caplog.set_level(logging.INFO, logger="feeder.isolation")
    with make(MemorySource(BLOBS[:16]), isolation="process", start_method="auto") as f:
        assert f.start_method == "spawn"
        assert_same(collect(f), expected)
    assert any("spawn (auto: CUDA is initialized" in r.getMessage() for r in caplog.records)


def test_auto_forks_with_a_cuda_device_when_cuda_is_not_initialized(monkeypatch):
    """device="cuda" without an index must not initialize CUDA while the options are
    checked: the start rule runs after, and would then always spawn."""
    calls = []

    def current_device():
        calls.append("current_device")
        raise AssertionError("torch.cuda.current_device() initializes CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    f = make(MemorySource(BLOBS[:16]), isolation="process", start_method="auto", device="cuda")
    try:
        # Not resolved yet: "cuda" is the current device when a pass starts.
        assert f.config.device == torch.device("cuda")
        assert f.start_method == "fork"
    finally:
        f.close()
    assert calls == []


def test_cuda_device_without_index_is_the_current_one_when_resolved(monkeypatch):
    from feeder.engine.config import parse_device, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert parse_device("cuda") == torch.device("cuda")
    assert resolve_device(parse_device("cuda")) == torch.device("cuda", 1)
    assert resolve_device(parse_device("cuda:0")) == torch.device("cuda", 0)


def test_auto_names_the_running_thread_it_spawns_for(caplog):
    caplog.set_level(logging.INFO, logger="feeder.isolation")
    release = threading.Event()
    user = threading.Thread(target=release.wait, name="my-prefetcher", daemon=True)
    user.start()
    try:
        with make(MemorySource(BLOBS[:16]), isolation="process", start_method="auto") as f:
            assert f.start_method == "spawn"
    finally:
        release.set()
        user.join(JOIN_TIMEOUT_S)
    started = [r.getMessage() for r in caplog.records if "started with" in r.getMessage()]
    assert len(started) == 1 and "spawn (other threads are running" in started[0]
    assert "my-prefetcher" in started[0]


@pytest.mark.parametrize("platform, methods", [("darwin", ["spawn", "fork", "forkserver"]),
                                               ("win32", ["spawn"]), ("linux", ["spawn"])])
def test_auto_spawns_where_fork_is_missing_or_unsafe(monkeypatch, platform, methods):
    from feeder.isolation import start

    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(start.multiprocessing, "get_all_start_methods", lambda: methods)
    method, why = start.start_rule()
    assert method == "spawn" and platform in why


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_explicit_start_methods_are_honoured(method, expected):
    with make(MemorySource(BLOBS[:16]), isolation="process", start_method=method) as f:
        assert f.start_method == method
        assert_same(collect(f), expected)


def test_explicit_fork_with_a_thread_running_forks_and_warns(caplog, expected):
    release = threading.Event()
    user = threading.Thread(target=release.wait, name="my-prefetcher", daemon=True)
    user.start()
    try:
        with make(MemorySource(BLOBS[:16]), isolation="process", start_method="fork") as f:
            assert f.start_method == "fork"
            assert_same(collect(f), expected)
    finally:
        release.set()
        user.join(JOIN_TIMEOUT_S)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("my-prefetcher" in m and "start_method='auto' would spawn" in m for m in warned)


def test_thread_engine_has_no_start_method():
    with make(MemorySource(BLOBS[:16])) as f:
        assert f.start_method is None


@pytest.mark.parametrize("value", ["vfork", "Fork", None, 1, ""])
def test_bad_start_method_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"start_method must be one of .*auto.*fork.*spawn"):
        make(MemorySource(BLOBS[:16]), isolation="process", start_method=value)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_start_method_with_threads_is_a_config_error(method):
    with pytest.raises(ConfigError, match=rf"start_method='{method}'.*isolation='thread'.*"
                                          r"isolation='process'"):
        make(MemorySource(BLOBS[:16]), start_method=method)


# -- what a forked worker inherits ---------------------------------------------------------------------

def _socket_inode(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _fd_targets(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return out


def test_forked_worker_holds_no_parent_end_of_any_pipe():
    # While the worker held a copy of the training process's end, the pipe would
    # never end when the training process closes it or dies.
    with make(MemorySource(BLOBS[:16]), isolation="process", start_method="fork") as first, \
         make(MemorySource(BLOBS[:16]), isolation="process", start_method="fork") as second:
        assert len(collect(second)) == 2
        ours = {_socket_inode(engine_of(first).conn.fileno()), _socket_inode(engine_of(second).conn.fileno())}
        assert all(target.startswith("socket:") for target in ours)
        assert not ours & _fd_targets(second.worker_pid)
        assert not ours & _fd_targets(first.worker_pid)


def _shm_mappings(pid: int) -> set[str]:
    """The shared-memory files ``pid`` maps (torch's shared tensors), with their inodes."""
    out = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and any(k in parts[5] for k in ("torch_", "/dev/shm", "memfd")):
                out.add(f"{parts[5]} {parts[4]}")
    return out


def test_a_forked_child_drops_another_feeders_batch_buffers():
    """A process forked while an isolated feeder is alive (another feeder's worker,
    a DataLoader worker) must drop that feeder's views of its shared batch buffers:
    kept, they would hold /dev/shm memory after the feeder is closed, until that
    process exits."""
    import select

    a = make(MemorySource(BLOBS[:16]), isolation="process", start_method="fork")
    try:
        assert len(collect(a)) == 2
        assert engine_of(a)._mirrors, "the feeder's batches came through no shared buffer"
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: feeder's at-fork hook has run
            try:
                engine = engine_of(a)
                ok = not engine._mirrors and engine.current is None and not engine._by_id
                os.write(w, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(w)
        try:
            ready, _, _ = select.select([r], [], [], JOIN_TIMEOUT_S)
            assert ready, "the forked child did not answer"
            assert os.read(r, 1) == b"1", "the forked child kept the feeder's buffers"
        finally:
            os.close(r)
            os.waitpid(pid, 0)
    finally:
        a.close()



def test_receiving_thread_is_not_taken_for_idle_while_it_reports_a_dead_worker():
    """After its loop the receiving thread fails the passes (taking their locks):
    the fork check must see it at work then, not idle."""
    from feeder.isolation import start

    f = make(MemorySource(BLOBS[:16]), isolation="process", start_method="fork")
    engine = engine_of(f)
    inside, release = threading.Event(), threading.Event()
    fail_current = engine._fail_current

    def held_fail_current(error):
        inside.set()
        release.wait(JOIN_TIMEOUT_S)
        fail_current(error)

    engine._fail_current = held_fail_current
    try:
        engine.process.kill()
        assert inside.wait(JOIN_TIMEOUT_S), "the receiving thread never saw the worker die"
        with start.quiet_threads() as others:
            assert engine.receiver.name in others
    finally:
        release.set()
        engine.receiver.join(JOIN_TIMEOUT_S)
        f.close()
    assert not engine.receiver.is_alive()


def test_forked_worker_runs_no_handler_of_the_parent(tmp_path):
    # A trainer's SIGTERM handler (save a checkpoint, say) must not run in the worker.
    marker = tmp_path / "handler-ran"

    def handler(signum, frame):
        marker.write_text(str(os.getpid()))

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        f = make(MemorySource(BLOBS), isolation="process", start_method="fork", queue_size=1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        it = iter(f)
        next(it)
        process = worker_process_of(f)
        os.kill(process.pid, signal.SIGTERM)
        # The receiving thread reaps the worker to name its death: let it, rather than
        # join concurrently (two waitpid calls race; the loser sees no exit code).
        with pytest.raises(FeederError, match="killed by SIGTERM"):
            for _ in range(len(BLOBS)):
                next(it)
        process.join(JOIN_TIMEOUT_S)
        assert process.exitcode == -signal.SIGTERM
        assert not marker.exists(), "the parent's SIGTERM handler ran in the worker"
    finally:
        f.close()


STDIO_SCRIPT = """
import atexit, os, sys
sys.path.insert(0, {repo!r})
from tests.support import MemorySource
from feeder import Feeder, ops
from tests.isolation.test_isolation import BLOBS

def shout(img, rng):
    print("worker-line")
    return img

atexit.register(lambda: print("atexit-ran"))
sys.stdout.write("parent-line\\n")  # buffered (stdout is a pipe), not yet flushed
f = Feeder(MemorySource(BLOBS[:16]), 4, [shout, ops.CenterCrop(24)], seed=0, isolation="process",
           start_method="fork", timeout=30)
print("batches", len(list(f)), f.start_method)
f.close()
"""


def test_forked_worker_neither_repeats_the_parents_output_nor_runs_its_atexit():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    out = subprocess.run([sys.executable, "-c", STDIO_SCRIPT.format(repo=REPO)], capture_output=True,
                         text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines.count("parent-line") == 1
    assert lines.count("atexit-ran") == 1
    assert lines.count("worker-line") == 16  # the worker's own output, flushed once, not lost
    assert "batches 4 fork" in lines


POOLS_SCRIPT = """
import os, sys, threading, time
import cv2, numpy as np, torch
sys.path.insert(0, {repo!r})
from tests.support import MemorySource
from feeder import Feeder, ops
from tests.isolation.test_isolation import BLOBS

def tasks():
    return len(os.listdir("/proc/self/task"))

def torch_work(img, rng):
    # A multi-threaded op in the parent; in the worker it must not wait for the
    # parent's OpenMP threads, which do not exist there.
    a = torch.from_numpy(np.resize(img, (256, 256)).astype(np.float32))
    (a @ a).sum()
    return img

before = tasks()
count = cv2.getNumThreads()
big = np.random.default_rng(0).integers(0, 255, (3000, 3000, 3), dtype=np.uint8)
for _ in range(3):
    cv2.resize(big, (1500, 1500))  # OpenCV's pool starts its threads
    m = torch.randn(600, 600)
    m @ m  # so do torch's OpenMP threads
    np.ones((400, 400)) @ np.ones((400, 400))  # and the BLAS's
started = tasks() - before

def all_idle():
    # The pools' threads asleep on their condition variables (OpenCV's spin for a
    # few milliseconds after a job first): the state a training process forks in.
    me = str(threading.get_native_id())
    states = []
    for tid in os.listdir("/proc/self/task"):
        if tid != me:
            with open(f"/proc/self/task/{{tid}}/stat") as fh:
                states.append(fh.read().rsplit(")", 1)[1].split()[0])
    return all(s == "S" for s in states)

deadline = time.monotonic() + 20
while not all_idle() and time.monotonic() < deadline:
    time.sleep(0.005)
f = Feeder(MemorySource(BLOBS), 4, [ops.RandomResizedCrop(48), torch_work], seed=0,
           isolation="process", start_method="fork", timeout=30, decode_threads=2)
labels = sorted(int(y) for _, ys in f for y in ys)
print(json.dumps({{"started": started, "cv_threads": count, "labels": labels,
                   "cv_after": cv2.getNumThreads(), "method": f.start_method,
                   "resize_after": cv2.resize(big, (100, 100)).shape}}), flush=True)
f.close()
"""


def test_fork_after_native_thread_pools_started():
    # OpenCV's pthreads pool is not fork-safe (setNumThreads in the child waits for
    # the parent's pool threads), torch's OpenMP pool neither (a parallel region
    # in the child waits for the parent's team): the worker must still deliver
    # every sample, within the feeder's timeout, never hang.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    script = "import json\n" + POOLS_SCRIPT.format(repo=REPO)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if report["cv_threads"] < 2 or report["started"] < 1:
        pytest.skip("one core: the libraries start no pool threads to inherit")
    assert report["method"] == "fork"
    assert report["labels"] == list(range(len(BLOBS)))  # every sample, once
    assert report["cv_after"] == report["cv_threads"]  # the parent's pool is back as it was
    assert report["resize_after"] == [100, 100, 3]


def test_start_method_the_platform_lacks_is_a_config_error(monkeypatch):
    from feeder.isolation import start

    monkeypatch.setattr(start.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(ConfigError, match=r"start_method='fork' is not available on this platform"):
        make(MemorySource(BLOBS[:16]), isolation="process", start_method="fork")


def test_a_spawned_worker_that_dies_before_reading_its_payload_is_an_error_not_a_hang(tmp_path,
                                                                                         monkeypatch):
    # The fresh interpreter exits before it reads anything (as a failing import or
    # an unguarded script's second Feeder would end it); the source pickles to far
    # more than a pipe's 64 KiB buffer, which is what a write into the start
    # method's own pipe would have waited on forever.
    from tests.support import run_in_thread

    (tmp_path / "sitecustomize.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    blobs = [bytes([i % 256]) * 4096 + BLOBS[0] for i in range(64)]  # distinct: pickled whole

    def build():
        Feeder(MemorySource(blobs), 4, [ops.CenterCrop(8)], isolation="process", start_method="spawn")

    with pytest.raises(FeederError, match=r"exited with code 3 before it had read the source"):
        run_in_thread(build, timeout=60)
