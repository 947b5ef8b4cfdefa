"""The CUDA-only logic of the transfer path, checked without a GPU: ``torch.cuda``
is replaced by the recording CUDA stand-in (``tests/cuda_standin.py``), and each test asserts what the code asks of
CUDA and in which order (the module docstring of ``feeder/engine/transfer.py`` names
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

from conftest import JOIN_TIMEOUT_S, MemorySource, drain
from cuda_standin import Standin
from feeder import Feeder, ops
from feeder.engine import batch as _batch
from feeder.engine import transfer as _transfer
from feeder.engine.queue import Closed

AUG = [ops.CenterCrop(32)]


@pytest.fixture
def fake_cuda(monkeypatch):
    return Standin().install(monkeypatch)


def source() -> MemorySource:
    from conftest import encode_jpeg
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
    code = inspect.getsource(_transfer)
    assert "torch.cuda.Event()" not in code and ".stream.synchronize()" not in code
    assert code.count("blocking_event()") >= 3  # both delivery paths and wait_idle


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
        f._engine.start_pass(0, 0, 0, 1)
        run = StubPass.made[-1]
        assert run.cfg.device == torch.device("cuda", 1)
        assert run.side is f._engine.side
        assert fake_cuda.kinds("stream") == [("stream", 1, -5, 1)]
        assert f._engine.pool._geometry[3] == torch.device("cuda", 1)
        f._engine.start_pass(0, 1, 0, 1)  # the next pass: the same stream
        assert len(fake_cuda.kinds("stream")) == 1
    # Teardown drained the stream (asleep) with its device current, then gave the
    # host cache back with that device current.
    names = [e[0] for e in fake_cuda.log]
    assert ("sync", True, 1) in fake_cuda.log and ("empty host cache", 1) in fake_cuda.log
    assert names.index("sync") < names.index("empty host cache")
    assert f._engine.side.closed


def test_pinned_buffers_allocated_with_the_pass_device_current(fake_cuda, monkeypatch):
    made = []
    real_empty = torch.empty

    def empty(*shape, pin_memory=False, **kw):
        made.append((pin_memory, fake_cuda.current()))
        return real_empty(*shape, **kw)

    monkeypatch.setattr(_batch.torch, "empty", empty)
    pool = _batch.BufferPool(4, 2, 8, 8, pin=True)
    pool.pin_with(torch.device("cuda", 1))
    buf = pool.try_acquire()
    buf.array("score", torch.zeros(0, dtype=torch.float32).numpy().dtype, ())
    buf.masks()
    assert made and all(entry == (True, 1) for entry in made), made
    assert fake_cuda.current() == 0  # the allocating thread's own device is left alone
    plain = _batch.BufferPool(4, 2, 8, 8, pin=False)
    plain.pin_with(torch.device("cuda", 1))  # no pinning asked: nothing changes
    made.clear()
    plain.try_acquire()
    assert made and all(entry == (False, 0) for entry in made)


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
        engine = f._engine
        fake_cuda.set_current(1)
        engine.side.begin_pass()  # as start_pass does
        fake_cuda.set_current(0)  # the receiving thread's own device
        engine._register(torch.zeros(16, dtype=torch.uint8))
        ptr = engine._registered[0]
    names = [e[0] for e in fake_cuda.log]
    assert ("register", ptr, 1) in fake_cuda.log
    assert ("unregister", ptr, 1) in fake_cuda.log
    assert names.index("sync") < names.index("unregister")
    assert ("sync", True, 1) in fake_cuda.log
    assert engine._registered == []


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
        from conftest import encode_jpeg, MemorySource
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
    result = subprocess.run([sys.executable, str(script), os.path.dirname(__file__)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["mid-epoch", "freed isolated engine"], result.stdout
    assert "Traceback" not in result.stderr, result.stderr
