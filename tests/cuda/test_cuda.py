"""The CUDA transfer stage: side stream, event ordering, pinned-buffer reuse,
caching-allocator safety, and values identical to the CPU path.

On a GPU when there is one, else under the CUDA stand-in (``tests/support/cuda_standin.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import drain, labels_of
from tests.support.cuda import (MEAN, SPIN, STD, assert_same_batches, assert_sums, batch_sum,
                          close_after_layout, close_to_cpu_path, make, reference_sums)
from tests.support.cuda import big_source as _big_source
from feeder.engine import transfer as _transfer
from feeder.testing import current_pass_of, free_buffers_of, pool_of, side_stream_of



@pytest.fixture
def big_source(jpeg_blobs):
    return _big_source(jpeg_blobs)  # 240 samples


def test_batches_on_device_with_layout_and_pinned_buffers(big_source):
    with make(big_source, device="cuda") as f:
        x, y = next(iter(f))
        assert x.is_cuda and y.is_cuda and x.dtype == torch.uint8 and y.dtype == torch.int64
        assert x.shape == (16, 3, 48, 48) and x.is_contiguous(memory_format=torch.channels_last)
        drain(f)
        free = free_buffers_of(f)
        # Checked before close(), which unlocks the feeder's own pinned blocks.
        assert free and all(b.images_t.is_pinned() and b.labels_t.is_pinned() for b in free)


@pytest.mark.parametrize("kw", [{}, {"dtype": torch.float32}, {"dtype": torch.float16, "normalize": (MEAN, STD)}])
def test_contiguous_memory_format_on_device(big_source, kw):
    with make(big_source, device="cpu", **kw) as cpu, \
         make(big_source, device="cuda", memory_format="contiguous", **kw) as gpu:
        cpu.set_epoch(1)
        gpu.set_epoch(1)
        a, err_a = drain(cpu)
        it = iter(gpu)
        x, _ = next(it)
        assert x.is_cuda and x.is_contiguous() and x.view(len(x), -1).shape[1] == 3 * 48 * 48
        del it, x
        gpu.set_epoch(1)
        b, err_b = drain(gpu)
    assert_same_batches(a, err_a, b, err_b, close_after_layout)


@pytest.mark.parametrize("kw", [{}, {"normalize": (MEAN, STD)}, {"dtype": torch.float16,
                                                                  "normalize": (MEAN, STD)}])
def test_values_identical_to_cpu_path(big_source, kw):
    with make(big_source, device="cpu", **kw) as cpu, make(big_source, device="cuda", **kw) as gpu:
        cpu.set_epoch(2)
        gpu.set_epoch(2)
        a, err_a = drain(cpu)
        b, err_b = drain(gpu)
    assert_same_batches(a, err_a, b, err_b, close_to_cpu_path)


@pytest.mark.real_cuda(reason="reads the streams of copies and kernels in a profiler trace")
def test_copies_run_on_a_side_stream(big_source, tmp_path):
    from torch.profiler import ProfilerActivity, profile
    with make(big_source, device="cuda", batch_size=32) as f:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for x, y in f:
                (x.float() @ torch.ones(48, 48, device="cuda")).sum()
            torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    copy_streams = {e["args"].get("stream") for e in events
                    if "Memcpy HtoD" in e.get("name", "") and "args" in e}
    consumer = torch.cuda.current_stream().cuda_stream
    assert copy_streams, "no host-to-device copy found in the trace"
    kernel_streams = {e["args"].get("stream") for e in events
                      if e.get("cat") == "kernel" and "gemm" in e.get("name", "").lower()}
    assert kernel_streams and not (copy_streams & kernel_streams), (copy_streams, kernel_streams, consumer)


def test_consumer_stream_waits_for_the_batch_event(big_source, monkeypatch):
    """The side stream is slowed down after the copy; a consumer that did not wait
    on the event would read half-converted batches."""
    original = _transfer.Converter.__call__

    def slow_convert(self, images):
        torch.cuda._sleep(SPIN)  # queued on the side stream (we are inside its context)
        return original(self, images)

    monkeypatch.setattr(_transfer.Converter, "__call__", slow_convert)
    waits = []
    real_wait = torch.cuda.Stream.wait_event
    monkeypatch.setattr(torch.cuda.Stream, "wait_event",
                        lambda self, ev: (waits.append(ev), real_wait(self, ev))[1])
    # The CPU half (reference_sums, batch_sum, assert_sums) runs in CI:
    # tests/engine/test_cuda_helpers.py::test_consumer_stream_waits_for_the_batch_event_cpu_half.
    with make(big_source, device="cpu", normalize=(MEAN, STD)) as cpu:
        expect = reference_sums(cpu, "float")
    consumer = torch.cuda.Stream()
    got = []
    with make(big_source, device="cuda", normalize=(MEAN, STD)) as gpu, torch.cuda.stream(consumer):
        for x, _ in gpu:
            got.append(batch_sum(x, "float"))  # queued on `consumer` right away
        torch.cuda.synchronize()
    assert len(waits) == len(expect)
    assert_sums(got, expect, "float")


def test_pinned_buffer_reused_only_after_its_copy_completed(big_source, monkeypatch):
    with make(big_source, device="cuda", batch_size=8, queue_size=1) as f:
        pool = pool_of(f)
        states = []
        real_release = pool.release

        def checked_release(buf):
            run = current_pass_of(f)
            stream = getattr(run.stages[-1], "stream", None) if run is not None else None
            states.append(stream is None or stream.query())
            real_release(buf)

        monkeypatch.setattr(pool, "release", checked_release)
        batches, err = drain(f)
    assert err is None and batches
    assert states and all(states)


def test_caching_allocator_does_not_recycle_batches_still_in_use(big_source):
    """Each batch is read by a delayed kernel on the consumer stream after the loop
    dropped it; without record_stream the allocator would hand its memory to the
    next batch's copy while that kernel is still queued."""
    # CPU half: tests/engine/test_cuda_helpers.py::test_lagging_consumer_cpu_half.
    with make(big_source, device="cpu", shuffle=False) as cpu:
        expect = reference_sums(cpu, "int")
    consumer = torch.cuda.Stream()
    sums = []
    with make(big_source, device="cuda", shuffle=False, queue_size=2) as gpu, torch.cuda.stream(consumer):
        for x, _ in gpu:
            torch.cuda._sleep(SPIN)  # the consumer stream lags behind the side stream
            sums.append(batch_sum(x, "int"))
            del x
        torch.cuda.synchronize()
    assert_sums(sums, expect, "int")


def test_exactly_once_and_order_on_cuda(big_source):
    with make(big_source, device="cuda", batch_size=10, shuffle=False, drop_last=False) as f:
        batches, err = drain(f)
    assert err is None and labels_of(batches) == list(range(240))


def test_each_batch_is_copied_recorded_waited_for_and_recorded_on_the_consumer_stream(
        big_source, cuda):
    """The order of the CUDA calls behind every batch (the stand-in's call log; on
    a GPU, test_copies_run_on_a_side_stream and the race tests check the effects):
    pinned, non-blocking copies on the feeder's side stream in its transfer thread;
    the batch's event recorded there after them; the consumer's stream made to wait
    on it before next() returns; every device tensor recorded on that stream."""
    if cuda is None:
        pytest.skip("the CUDA call log exists under the stand-in only")
    consumer = torch.cuda.Stream()
    got = []
    with make(big_source, device="cuda", batch_size=32) as f, torch.cuda.stream(consumer):
        for x, y in f:
            got.append((len(cuda.calls), x.untyped_storage().data_ptr(),
                        y.untyped_storage().data_ptr()))
        side = side_stream_of(f).stream(torch.device("cuda", 0))
    assert len(got) == 8 and side.cuda_stream != consumer.cuda_stream
    copies = cuda.of("copy to device")
    assert copies and all(c.stream == side.cuda_stream and c.detail["pinned"]
                          and c.detail["non_blocking"] and c.thread.startswith("feeder-")
                          for c in copies)
    # The transfer thread runs ahead of the loop: a batch's copies and event
    # record may land in the call log before the previous batch is handed over,
    # so each record is looked for in the whole log before the wait on it.
    log = cuda.calls
    start = 0
    for end, images, labels in got:
        waits = [i for i in range(start, end) if log[i].what == "wait"]
        assert len(waits) == 1 and log[waits[0]].stream == consumer.cuda_stream
        wait = waits[0]
        event = log[wait].detail["event"]
        record = max(i for i in range(wait) if log[i].what == "record"
                     and log[i].detail["event"] == event)
        assert log[record].stream == side.cuda_stream
        thread = log[record].thread
        before = [i for i in range(record) if log[i].thread == thread
                  and log[i].what == "record"]
        since = before[-1] + 1 if before else 0
        assert any(log[i].what == "copy to device" and log[i].thread == thread
                   for i in range(since, record))
        recorded = {c.detail["storage"] for c in log[wait:end] if c.what == "record_stream"
                    and c.stream == consumer.cuda_stream}
        assert {images, labels} <= recorded
        start = end
    assert cuda.contexts == {0}
