"""The isolated engine on CUDA: shared batch arrays page-locked in place
(cudaHostRegister), copies from them that keep the thread engine's values and
ordering, released only after their copy, unregistered on close.

On a GPU when there is one, else under the CUDA stand-in (``tests/support/cuda_standin.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support import drain, labels_of
from tests.support.cuda import (MEAN, SPIN, STD, assert_sums, batch_sum, make_isolated as make,
                          reference_sums)
from tests.support.cuda import big_source as _big_source
from feeder import ops
from feeder.testing import current_pass_of, engine_of, pool_of
from tests.support.fields import DictSource
from tests.isolation.test_isolation import assert_same, make_dict



@pytest.fixture
def big_source(jpeg_blobs):
    return _big_source(jpeg_blobs)  # 240 samples


@pytest.mark.parametrize("kw", [{}, {"normalize": (MEAN, STD)},
                                {"dtype": torch.float16, "memory_format": "contiguous"}])
def test_same_batches_as_the_thread_engine(big_source, kw):
    with make(big_source, device="cuda", **kw) as f:
        expect, err = drain(f)
    assert err is None
    with make(big_source, device="cuda", isolation="process", **kw) as f:
        got, err = drain(f)
        engine = engine_of(f)
        # Every shared array the transfer stage copied from is page-locked in place.
        assert engine.pinned.locked_bytes > 0
        for buf in engine._mirrors.values():
            assert buf.images_t.is_pinned() and buf.labels_t.is_pinned()
    assert err is None and len(got) == len(expect)
    for (xa, ya), (xb, yb) in zip(expect, got):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)  # the same kernels on the same bytes
    assert engine.pinned.locked_bytes == 0 and engine._mirrors == {}


def test_buffers_go_back_only_after_their_copy(big_source, monkeypatch):
    with make(big_source, device="cuda", isolation="process", queue_size=1) as f:
        pool = pool_of(f)
        states = []
        real_release = pool.release

        def checked_release(buf):
            run = current_pass_of(f)
            stream = getattr(run.stage, "stream", None) if run is not None else None
            states.append(stream is None or stream.query())
            real_release(buf)

        monkeypatch.setattr(pool, "release", checked_release)
        batches, err = drain(f)
    assert err is None and batches
    assert states and all(states)


def test_consumer_stream_lagging_behind(big_source):
    """A consumer stream that lags: batches keep their values (events, record_stream)."""
    # CPU half: tests/engine/test_cuda_helpers.py::test_lagging_consumer_cpu_half.
    with make(big_source, device="cpu", shuffle=False) as cpu:
        expect = reference_sums(cpu, "int")
    consumer = torch.cuda.Stream()
    sums = []
    with make(big_source, device="cuda", shuffle=False, queue_size=2,
              isolation="process") as gpu, torch.cuda.stream(consumer):
        for x, _ in gpu:
            torch.cuda._sleep(SPIN)
            sums.append(batch_sum(x, "int"))
            del x
        torch.cuda.synchronize()
    assert_sums(sums, expect, "int")


def test_dict_samples_on_cuda():
    transforms = [ops.RandomResizedCrop(32), ops.RandomHorizontalFlip()]
    with make(DictSource(20, make_dict), transforms, batch_size=8, device="cuda") as f:
        expect = [{k: (v.cpu() if isinstance(v, torch.Tensor) else
                       [t.cpu() if isinstance(t, torch.Tensor) else t for t in v])
                   for k, v in b.items()} for b in f]
    with make(DictSource(20, make_dict), transforms, batch_size=8, device="cuda", isolation="process") as f:
        got = [{k: (v.cpu() if isinstance(v, torch.Tensor) else
                    [t.cpu() if isinstance(t, torch.Tensor) else t for t in v])
                for k, v in b.items()} for b in f]
    to_np = lambda rows: [{k: (v.numpy() if isinstance(v, torch.Tensor) else  # noqa: E731
                               [t.numpy() if isinstance(t, torch.Tensor) else t for t in v])
                           for k, v in b.items()} for b in rows]
    assert_same(to_np(got), to_np(expect))


def test_exactly_once_on_cuda(big_source):
    with make(big_source, device="cuda", batch_size=10, shuffle=False,
              isolation="process") as f:
        batches, err = drain(f)
    assert err is None
    assert labels_of(batches) == list(range(len(big_source)))
