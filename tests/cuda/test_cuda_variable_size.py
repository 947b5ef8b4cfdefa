"""Variable-size batches on CUDA: the batch's region copied on the side stream
(rows only, or whole slots, cut on the device), the sizes behind the same event,
equal to what the CPU path delivers, on both engines.

On a GPU when there is one, else under the CUDA stand-in (``tests/support/cuda_standin.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_variable_size import Segments, Sized, _sizes, collect
from feeder import Feeder



@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize("rows_min", [0, 1 << 40])  # per-sample row copies / whole slots
@pytest.mark.parametrize("normalize", [None, ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))])
def test_cuda_batches_equal_the_cpu_ones(isolation, rows_min, normalize, monkeypatch):
    monkeypatch.setattr("feeder.engine.gather._ROWS_COPY_MIN_BYTES", rows_min)
    source = Segments(_sizes(13, seed=3, low=8, high=120))
    kw = dict(max_image_size=(128, 128), size_divisibility=8, shuffle=True, seed=1,
              normalize=normalize)
    with Feeder(source, 4, [], device="cpu", **kw) as f:
        expected = collect(f)
    with Feeder(source, 4, [], device="cuda", isolation=isolation, **kw) as f:
        got = collect(f)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g["image"].is_cuda and g["size"].is_cuda and g["mask"].is_cuda
        assert torch.equal(g["size"].cpu(), e["size"])
        torch.testing.assert_close(g["image"].cpu(), e["image"], rtol=0, atol=1e-6)
        assert torch.equal(g["mask"].cpu(), e["mask"])
        assert all(torch.equal(a.cpu(), b) for a, b in zip(g["boxes"], e["boxes"]))


def test_cuda_batch_size_one_is_the_image_as_decoded():
    source = Sized(_sizes(5, seed=2))
    with Feeder(source, 1, [], device="cuda", max_image_size=(40, 40), shuffle=False) as f:
        for i, b in enumerate(collect(f)):
            img = b["image"][0].permute(1, 2, 0).cpu().numpy()
            assert (img == source.images[i]).all()
