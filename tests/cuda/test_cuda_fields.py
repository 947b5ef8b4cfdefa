"""Fields on CUDA: masks, numeric fields and boxes copied on the side stream behind
the batch's event, from pinned memory, recorded on the consumer's stream, and
equal to what the CPU path delivers.

On a GPU when there is one, else under the CUDA stand-in (``tests/support/cuda_standin.py``).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, encode_jpeg
from tests.support import collect as collect_batches
from feeder import Feeder, ops
from feeder.engine import transfer as _transfer
from feeder.synthetic import make_image
from feeder.testing import free_buffers_of
from tests.support.fields import DictSource, cell_mask, check_mask_follows_image, coordinate_image, png, rgb_png


CHAIN = [ops.RandomResizedCrop(40, scale=(0.3, 1.0)), ops.RandomHorizontalFlip()]
SPIN = 20_000_000  # GPU clock cycles for torch.cuda._sleep: milliseconds of delay


def source(n: int = 48, wide_every: int = 0) -> DictSource:
    sizes = ((96, 120), (130, 100), (80, 80))
    cache = {}

    def make(i):
        h, w = sizes[i % 3]
        if (h, w) not in cache:
            cache[(h, w)] = rgb_png(coordinate_image(h, w))
        mask = cell_mask(h, w)
        if wide_every and i % wide_every == 0:
            mask = png(mask.astype(np.uint16) + 1000, 16)
        else:
            mask = png(mask)
        return {"image": cache[(h, w)], "mask": mask, "label": i, "score": np.float32(i / 4),
                "boxes": np.array([[0, 0, w, h], [w / 2, h / 2, w, h]], np.float32)[: 1 + i % 2],
                "box_labels": np.arange(1 + i % 2), "key": f"k{i}"}
    return DictSource(n, make)


def collect(feeder, slow_consumer: bool = False):
    """Every batch, its tensors copied to the CPU by the consumer (after a long kernel
    on its stream when ``slow_consumer``: reading too early would see stale memory)."""
    def keep(batch):
        if slow_consumer:
            torch.cuda._sleep(SPIN)
        return {k: (v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else
                    [t.cpu() if isinstance(t, torch.Tensor) else t for t in v])
                for k, v in batch.items()}
    return collect_batches(feeder, timeout=JOIN_TIMEOUT_S * 2, keep=keep)


def same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert list(x) == list(y)
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
            elif x[k] and isinstance(x[k][0], torch.Tensor):
                assert all(torch.equal(p, q) for p, q in zip(x[k], y[k])), k
            else:
                assert x[k] == y[k], k


@pytest.mark.parametrize("wide_every", [0, 5])
def test_every_field_on_the_device_equals_the_cpu_path(wide_every):
    src = source(wide_every=wide_every)
    with Feeder(src, 8, CHAIN, seed=3, device="cpu") as f:
        cpu, err = collect(f)
    assert err is None
    with Feeder(src, 8, CHAIN, seed=3, device="cuda") as f:
        it = iter(f)
        first = next(it)
        for k in ("image", "mask", "label", "score"):
            assert first[k].is_cuda, k
        assert all(b.is_cuda for b in first["boxes"]) and all(b.is_cuda for b in first["box_labels"])
        assert first["key"] == [f"k{i}" for i in first["label"].tolist()]
        del it, first
        f.set_epoch(0)  # again the CPU feeder's pass, not the next epoch
        cuda, err = collect(f, slow_consumer=True)
    assert err is None
    same(cpu, cuda)
    for b in cuda:
        for img, mask in zip(b["image"], b["mask"]):
            m = mask.numpy().astype(np.int64)
            check_mask_follows_image(img.numpy(), m - 1000 if m.min() >= 1000 else m)


def test_field_storage_is_pinned_and_reused():
    with Feeder(source(), 8, CHAIN, device="cuda", queue_size=2) as f:
        collect(f)
        buffers = free_buffers_of(f)
        # Checked before close(), which unlocks the feeder's own pinned blocks.
        assert buffers
        for buf in buffers:
            assert buf.planes is not None and buf.planes.low_t.is_pinned()
            assert all(t.is_pinned() for t, _ in buf.arrays.values())


def test_every_device_tensor_is_recorded_on_the_consumer_stream(monkeypatch):
    recorded: list[set[int]] = []
    original = _transfer.Delivery.device_tensors

    def spy(self):
        tensors = original(self)
        recorded.append({t.untyped_storage().data_ptr() for t in tensors})
        return tensors
    monkeypatch.setattr(_transfer.Delivery, "device_tensors", spy)
    with Feeder(source(16, wide_every=3), 8, CHAIN, device="cuda", dtype=torch.float32) as f:
        for batch, ptrs in zip(f, iter(lambda: recorded[-1], None)):
            for k, v in batch.items():
                tensors = v if isinstance(v, list) else [v]
                for t in tensors:
                    if isinstance(t, torch.Tensor):
                        assert t.untyped_storage().data_ptr() in ptrs, k


def test_a_stream_waiting_consumer_never_sees_a_later_batch_s_fields():
    """Many batches through two buffers while the consumer's stream lags: the
    pinned field arrays are reused only after their copies completed."""
    src = source(96)
    with Feeder(src, 4, CHAIN, seed=8, device="cpu", queue_size=1) as f:
        cpu, _ = collect(f)
    with Feeder(src, 4, CHAIN, seed=8, device="cuda", queue_size=1) as f:
        cuda, err = collect(f, slow_consumer=True)
    assert err is None
    same(cpu, cuda)


def test_pairs_with_float_labels_on_the_device():
    blobs = [encode_jpeg(make_image(40, 40, seed=i)) for i in range(8)]
    src = DictSource(8, lambda i: (blobs[i], np.float32(i) / 2))
    with Feeder(src, 4, [ops.CenterCrop(32)], device="cuda", shuffle=False) as f:
        batches = [(x, y) for x, y in f]
    assert all(y.is_cuda and y.dtype == torch.float32 for _, y in batches)
    assert torch.cat([y.cpu() for _, y in batches]).tolist() == [i / 2 for i in range(8)]
