"""The device-independent halves of the GPU suite (``tests/cuda``): how its tests
build their feeders, the CPU reference each compares against, and the
comparisons. Nothing here needs CUDA: ``tests/engine/test_cuda_helpers.py`` runs every
part of it on the CPU in CI, so a helper that only works on tensors, or only on
the numpy arrays ``drain()`` returns, fails there and not on the first GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.support import MemorySource, drain
from tests.support.faults import feeder_factory
from feeder import Feeder, ops

AUG = [ops.RandomResizedCrop(48), ops.RandomHorizontalFlip()]
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SPIN = 20_000_000  # GPU clock cycles for torch.cuda._sleep: milliseconds of delay


def big_source(jpeg_blobs) -> MemorySource:
    """240 samples, labelled by index."""
    return MemorySource(list(jpeg_blobs) * 4)


#: A thread-engine feeder as ``tests/cuda/test_cuda.py`` builds them.
make = feeder_factory(16, AUG, seed=11)


def make_isolated(source, transforms=AUG, **kw) -> Feeder:
    """A feeder as ``tests/cuda/test_cuda_isolation.py`` builds them (``isolation``
    given by the caller)."""
    kw.setdefault("batch_size", 16)
    kw.setdefault("seed", 5)
    kw.setdefault("decode_threads", 2)
    kw.setdefault("timeout", 60)
    return Feeder(source, transforms=transforms, **kw)


def assert_same_batches(a, err_a, b, err_b, close_floats) -> None:
    """Two drained passes (lists of numpy ``(images, labels)``, as ``drain`` returns)
    delivered the same labels, the same uint8 images, and float images that
    ``close_floats`` accepts (float kernels may differ in the last bit)."""
    assert err_a is None and err_b is None and len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(ya, yb)
        assert xa.dtype == xb.dtype and xa.shape == xb.shape
        if xa.dtype == np.uint8:
            np.testing.assert_array_equal(xa, xb)
        else:
            close_floats(xa, xb)


def close_after_layout(xa: np.ndarray, xb: np.ndarray) -> None:
    """Float batches made in another memory layout: equal within 1e-3."""
    np.testing.assert_allclose(xa, xb, rtol=1e-3, atol=1e-3)


def close_to_cpu_path(xa: np.ndarray, xb: np.ndarray) -> None:
    """Float batches of the CPU and CUDA paths: float32 within 1e-5, half within 1e-2."""
    np.testing.assert_allclose(xa.astype(np.float32), xb.astype(np.float32), rtol=0,
                               atol=1e-5 if xa.dtype == np.float32 else 1e-2)


def reference_sums(feeder: Feeder, kind: str) -> list:
    """The CPU half of a race test: drain ``feeder`` and sum each batch's images,
    exactly as :func:`batch_sum` does on the device (``kind``: "float" in float64,
    "int" in int64). ``drain`` returns numpy arrays, not tensors."""
    batches, err = drain(feeder)
    assert err is None, err
    dtype = np.float64 if kind == "float" else np.int64
    return [x.astype(dtype).sum().item() for x, _ in batches]


def batch_sum(images: torch.Tensor, kind: str) -> torch.Tensor:
    """The device half: a batch's sum as a 0-d tensor, queued on the current stream
    (nothing waits for it here)."""
    return images.double().sum() if kind == "float" else images.long().sum()


def assert_sums(got: list, expect: list, kind: str) -> None:
    """``got`` (0-d tensors from :func:`batch_sum`, any device) equals ``expect``
    (from :func:`reference_sums`): exactly for "int", within 1e-6 for "float"."""
    values = [g.item() for g in got]
    assert len(values) == len(expect)
    if kind == "int":
        assert values == expect
    else:
        np.testing.assert_allclose(values, expect, rtol=1e-6)
