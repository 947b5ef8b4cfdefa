"""The CUDA-only logic of the transfer path, checked without a GPU: ``torch.cuda``
is replaced by the recording CUDA stand-in (``tests/support/cuda_standin.py``), and each test asserts what the code asks of
CUDA and in which order (docs/design/cuda-transfer.md, "In the code", names
these tests; ``scripts/gpu-check`` checks the same on a GPU)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, REPO_DIR, MemorySource, drain
from tests.support.cuda_standin import Standin
from feeder import Feeder, ops
from feeder.engine import batch as _batch
from feeder.engine import cuda as _cuda
from feeder.engine import transfer as _transfer
from feeder.engine.queue import Closed
from feeder.testing import engine_of, pool_of, side_stream_of

AUG = [ops.CenterCrop(32)]


@pytest.fixture
def fake_cuda(monkeypatch):
    return Standin().install(monkeypatch)


def source() -> MemorySource:
    from tests.support import encode_jpeg
    from feeder.synthetic import make_image
    return MemorySource([encode_jpeg(make_image(40, 40, seed=i)) for i in range(8)])


class StubPass:
    """Stands in for a pass (whose CUDA transfer thread cannot run here): records
    the settings the engine starts it with."""

    made: list = []

    def __init__(self, cfg, *args, **kwargs):
        self.cfg = cfg
        self.side = args[-1] if args else None
        self.finished = threading.Event()
        self.finished.set()
        StubPass.made.append(self)

    def start(self):
        pass

    def stop(self):
        pass

    def join(self, timeout):
        return True

    def threads(self):
        return []

    def replace(self):
        pass

    def fold_output(self):
        pass


def test_events_are_blocking(fake_cuda):
    """Copies are waited for with blocking events (a default event's synchronize()
    spins a core); teardown and error paths wait the same way, never with a
    spinning stream.synchronize()."""
    event = _transfer.blocking_event()
    assert event.blocking
    stream = fake_cuda.Stream(torch.device("cuda", 1))
    fake_cuda.log.clear()
    _transfer.wait_idle(stream)
    assert fake_cuda.kinds("event", "record", "sync") == [
        ("event", True), ("record", 1), ("sync", True, 0)]
    code = inspect.getsource(_cuda) + inspect.getsource(_transfer)
    assert "torch.cuda.Event()" not in code and ".stream.synchronize()" not in code
    assert code.count("blocking_event()") >= 3  # its definition, wait_idle and the delivery's lease


def test_side_stream_made_once_per_device_with_the_highest_priority(fake_cuda):
    side = _transfer.SideStream(torch.device("cuda"))
    assert side.begin_pass() == torch.device("cuda", 0)
    assert side.begin_pass() == torch.device("cuda", 0)
    first = side.stream(torch.device("cuda", 0))
    assert side.stream(torch.device("cuda", 0)) is first
    # Made on its device, with that device current, at the top of torch's range.
    assert fake_cuda.kinds("stream") == [("stream", 0, -5, 0)]
    fake_cuda.set_current(1)  # the program changed its device between passes
    assert side.begin_pass() == torch.device("cuda", 1)
    assert fake_cuda.kinds("stream") == [("stream", 0, -5, 0), ("stream", 1, -5, 1)]
    assert fake_cuda.current() == 1


def test_cuda_resolved_to_another_gpu_than_local_rank_warns(fake_cuda, monkeypatch, caplog):
    """A torchrun rank that iterates before set_device(local_rank), or from a thread
    of its own, resolves "cuda" to GPU 0: said once, not silently."""
    import logging
    from feeder.engine import checks as _config
    monkeypatch.setattr(_config, "_warned_ranks", set())
    caplog.set_level(logging.WARNING, logger="feeder")
    monkeypatch.setenv("LOCAL_RANK", "1")
    side = _transfer.SideStream(torch.device("cuda"))
    assert side.begin_pass() == torch.device("cuda", 0)
    side.begin_pass()
    warned = [r for r in caplog.records if "LOCAL_RANK=1" in r.getMessage()]
    assert len(warned) == 1 and "cuda:0" in warned[0].getMessage()
    caplog.clear()
    fake_cuda.set_current(1)  # set_device(local_rank): as it should be
    assert side.begin_pass() == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "3")  # one GPU visible per rank: its own is GPU 0
    fake_cuda.set_current(0)
    side.begin_pass()
    assert not caplog.records


def test_cuda_resolved_to_gpu_0_from_a_helper_thread_warns(fake_cuda, monkeypatch, caplog):
    """Without LOCAL_RANK, a loop run from a thread of its own resolves "cuda" to
    GPU 0 whatever the main thread set: said once per thread, not silently."""
    import logging
    from feeder.engine import checks as _config
    monkeypatch.setattr(_config, "_warned_ranks", set())
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    caplog.set_level(logging.WARNING, logger="feeder")
    fake_cuda.set_current(1)  # the main thread's set_device(1)
    side = _transfer.SideStream(torch.device("cuda"))
    assert side.begin_pass() == torch.device("cuda", 1)
    got = []
    for _ in range(2):  # the second pass in the same thread says nothing more
        t = threading.Thread(target=lambda: got.append(side.begin_pass()), name="loop")
        t.start()
        t.join(JOIN_TIMEOUT_S)
    assert got == [torch.device("cuda", 0)] * 2
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "'loop'" in warned[0] and "cuda:0" in warned[0], warned
    caplog.clear()
    with fake_cuda.device(0):  # GPU 0 chosen in the main thread: nothing to say
        side.begin_pass()
    assert not caplog.records


def test_explicit_cuda_index_is_kept(fake_cuda):
    fake_cuda.set_current(1)
    side = _transfer.SideStream(torch.device("cuda", 0))
    assert side.begin_pass() == torch.device("cuda", 0)
    assert fake_cuda.kinds("stream") == [("stream", 0, -5, 0)]


def test_cuda_device_resolved_when_the_pass_starts(fake_cuda, monkeypatch):
    """A feeder built before set_device(1) delivers on GPU 1: the device is read at
    the pass's start, and the pass, its stream and the pinned buffers get it."""
    from feeder.engine import engine as _engine
    StubPass.made = []
    monkeypatch.setattr(_engine, "Pass", StubPass)
    with Feeder(source(), 4, AUG, device="cuda") as f:
        assert f.config.device == torch.device("cuda")
        assert fake_cuda.kinds("stream") == []  # nothing touches a GPU at construction
        fake_cuda.set_current(1)  # torch.cuda.set_device(local_rank), after the feeder
        engine_of(f).start_pass(0, 0, 0, 1)
        run = StubPass.made[-1]
        assert run.cfg.device == torch.device("cuda", 1)
        assert run.side is side_stream_of(f)
        assert fake_cuda.kinds("stream") == [("stream", 1, -5, 1)]
        assert pool_of(f).pinned.device == torch.device("cuda", 1)
        engine_of(f).start_pass(0, 1, 0, 1)  # the next pass: the same stream
        assert len(fake_cuda.kinds("stream")) == 1
    # Teardown drained the stream (asleep) with its device current; torch's host
    # cache, shared with the rest of the process, is left alone.
    assert ("sync", True, 1) in fake_cuda.log
    assert not fake_cuda.kinds("empty host cache")
    assert side_stream_of(f).closed


def test_pinned_buffers_allocated_with_the_pass_device_current(fake_cuda):
    pool = _batch.BufferPool(4, 2, 8, 8, pin=True)
    pool.pin_with(torch.device("cuda", 1))
    buf = pool.try_acquire()
    buf.array("score", torch.zeros(0, dtype=torch.float32).numpy().dtype, ())
    buf.masks()
    registered = fake_cuda.kinds("register")
    assert len(registered) == 4  # images, labels, the numeric field, the mask plane
    assert all(entry[2] == 1 for entry in registered), registered
    assert fake_cuda.current() == 0  # the allocating thread's own device is left alone
    plain = _batch.BufferPool(4, 2, 8, 8, pin=False)
    plain.pin_with(torch.device("cuda", 1))  # no pinning asked: nothing is locked
    plain.try_acquire().masks()
    assert len(fake_cuda.kinds("register")) == 4


def test_pinned_blocks_are_exactly_the_buffer_bytes(fake_cuda):
    """Each array of a pinned buffer is one block of its own, locked at its bytes
    rounded to the page (torch's caching host allocator would round a 38.5 MB
    buffer up to 64 MiB), at the array's own address."""
    from feeder.engine.pinned import PAGE, page_round
    pool = _batch.BufferPool(4, 256, 224, 224, pin=True)
    pool.pin_with(torch.device("cuda", 0))
    buf = pool.try_acquire()
    buf.masks()
    arrays = [buf.images_t, buf.labels_t, buf.planes.low_t]
    expect = {t.data_ptr(): page_round(t.numel() * t.element_size()) for t in arrays}
    assert fake_cuda.locked == expect
    assert expect[buf.images_t.data_ptr()] == 256 * 224 * 224 * 3  # a whole number of pages
    assert expect[buf.labels_t.data_ptr()] == PAGE
    assert all(ptr % PAGE == 0 for ptr in expect)
    assert pool.pinned.locked_bytes == sum(expect.values())
    assert buf.images.flags.writeable and buf.images.shape == (256, 224, 224, 3)
    pool.release(buf)
    pool.close()
    pool.unpin()
    assert fake_cuda.locked == {} and pool.pinned.locked_bytes == 0
    assert [e[1] for e in fake_cuda.kinds("unregister")] == list(expect)


def test_pinned_blocks_unlocked_after_the_drain(fake_cuda, monkeypatch):
    """close() unlocks every pinned block, after the side stream drained and with the
    pass's device current; so does the collection of a feeder never closed. A
    drain that cannot start leaves them locked (and mapped)."""
    from feeder.engine import engine as _engine
    from tests.support import reaped
    monkeypatch.setattr(_engine, "Pass", StubPass)
    for how in ("close", "collect", "timeout"):
        fake_cuda.log.clear()
        f = Feeder(source(), 4, AUG, device="cuda")
        fake_cuda.set_current(1)
        engine_of(f).start_pass(0, 0, 0, 1)
        fake_cuda.set_current(0)
        pool = pool_of(f)
        pool.release(pool.try_acquire())
        locked = dict(fake_cuda.locked)
        assert len(locked) == 2
        if how == "timeout":
            side_stream_of(f).close = lambda timeout=1.0: False  # a copy held the lock
        if how == "collect":
            del f, pool
            import gc
            gc.collect()
            reaped()
        else:
            f.close()
        if how == "timeout":
            assert fake_cuda.locked == locked and pool.pinned.locked_bytes > 0
            del side_stream_of(f).close
            engine_of(f).free()  # a later free, once the stream drains, unlocks them
        assert fake_cuda.locked == {}, how
        names = [e[0] for e in fake_cuda.log]
        assert names.index("sync") < names.index("unregister")
        assert {e[2] for e in fake_cuda.kinds("unregister")} == {1}
        assert not fake_cuda.kinds("empty host cache")


def test_teardown_waits_for_a_copy_being_queued(fake_cuda):
    """close() cannot drain the stream between a copy's start and its queuing: it takes
    the copy lock, so the copy is queued before the drain and none after."""
    side = _transfer.SideStream(torch.device("cuda"))
    side.begin_pass()
    inside, go = threading.Event(), threading.Event()

    def copy():
        with side.copying():
            inside.set()
            assert go.wait(JOIN_TIMEOUT_S)
            fake_cuda.log.append(("copy queued",))

    t = threading.Thread(target=copy, daemon=True)
    t.start()
    assert inside.wait(JOIN_TIMEOUT_S)
    closer = threading.Thread(target=side.close, daemon=True)
    closer.start()
    go.set()
    t.join(JOIN_TIMEOUT_S)
    closer.join(JOIN_TIMEOUT_S)
    assert not closer.is_alive()
    names = [e[0] for e in fake_cuda.log]
    assert names.index("copy queued") < names.index("sync")
    with pytest.raises(Closed):
        with side.copying():
            pass
    assert side.close()  # safe to repeat


def test_side_stream_drained_before_unregister(fake_cuda):
    """The isolated engine: registration with the pass's device current, and at
    close the side stream drained (blocking event) before any cudaHostUnregister,
    also made with that device current."""
    with Feeder(source(), 4, AUG, device="cuda", isolation="process", start_method="fork") as f:
        engine = engine_of(f)
        fake_cuda.set_current(1)
        engine.side.begin_pass()  # as start_pass does
        fake_cuda.set_current(0)  # the receiving thread's own device
        engine._register(torch.zeros(16, dtype=torch.uint8))
        ptr = next(iter(fake_cuda.locked))
    names = [e[0] for e in fake_cuda.log]
    assert ("register", ptr, 1) in fake_cuda.log
    assert ("unregister", ptr, 1) in fake_cuda.log
    assert names.index("sync") < names.index("unregister")
    assert ("sync", True, 1) in fake_cuda.log
    assert fake_cuda.locked == {} and engine.pinned.locked_bytes == 0


def test_isolated_close_that_times_out_keeps_the_mirrors_registered(fake_cuda):
    """A close whose drain cannot start (a copy being queued holds the side stream)
    leaves the shared arrays registered, and keeps them mapped: unmapping pages
    that are still registered, or that a queued copy may read, is the hazard."""
    f = Feeder(source(), 4, AUG, device="cuda", isolation="process", start_method="fork")
    engine = engine_of(f)
    engine.side.begin_pass()
    view = _batch.BatchBuffer.mirror(1)
    shared = torch.zeros(4096, dtype=torch.uint8).share_memory_()
    view.attach("labels", shared)
    engine._mirrors[1] = view
    engine._register(shared)
    ptr = shared.data_ptr()
    del shared
    engine.side.close = lambda timeout=1.0: False  # the copy lock held past the timeout
    f.close()
    assert ptr in fake_cuda.locked and not fake_cuda.kinds("unregister")
    assert engine._mirrors.get(1) is view and view.labels_t.data_ptr() == ptr
    assert engine.pinned.locked_bytes == 4096
    del engine.side.close
    engine.free()  # once the stream can drain, the arrays are unregistered and dropped
    assert fake_cuda.locked == {} and engine._mirrors == {}


def test_a_cuda_transfer_stage_needs_a_resolved_device_and_a_side_stream():
    from feeder.engine.stage import Counters
    stage = _transfer.Transfer(None, None, None, torch.device("cuda"), None, None, None)
    with pytest.raises(Exception, match="side stream"):
        stage.work(Counters())


def test_transfer_cpu_time_in_stats():
    with Feeder(source(), 2, AUG, device="cpu", seed=1) as f:
        batches, err = drain(f)
        s = f.stats()
    assert err is None and len(batches) == 4
    t = s.stage("transfer")
    assert t.items == 4 and t.cpu_s > 0
    assert t.cpu_per_item_s == pytest.approx(t.cpu_s / 4)
    assert t.cpu_s <= t.busy_s + t.wait_input_s + t.wait_output_s + 0.05
    assert "transfer thread CPU" in str(s)
    assert all(st.cpu_s == 0 for st in s.stages if st.name != "transfer")


def test_exit_handler_frees_an_isolated_engine_mid_epoch(tmp_path):
    """Interpreter exit mid-epoch stops and frees isolated engines too (where the
    side stream is drained and the shared arrays unregistered), with exit code 0."""
    script = tmp_path / "exit_mid_epoch.py"
    script.write_text(textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        from tests.support import encode_jpeg, MemorySource
        from feeder import Feeder, ops
        from feeder.isolation import engine as _isolation
        from feeder.synthetic import make_image

        real_free = _isolation.ProcessEngine.free
        def free(self):
            print("freed isolated engine", flush=True)
            real_free(self)
        _isolation.ProcessEngine.free = free
        src = MemorySource([encode_jpeg(make_image(40, 40, seed=i)) for i in range(32)])
        f = Feeder(src, 4, [ops.CenterCrop(32)], isolation="process")
        it = iter(f)
        next(it)
        print("mid-epoch", flush=True)
    """))
    env = dict(os.environ)
    result = subprocess.run([sys.executable, str(script), REPO_DIR], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["mid-epoch", "freed isolated engine"], result.stdout
    assert "Traceback" not in result.stderr, result.stderr
