"""``peers``'s ``bare`` row (feeder.bench.bare): one process per core running
feeder's per-sample work with nothing around it. Every epoch accounts for
every image once, over all its processes; a sample that fails ends the epoch
with an error naming the process and the sample's error, not a hang; closing
ends every process."""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest
import torch

pytest.importorskip("feeder.bench")

from feeder.bench.bare import BareLoader  # noqa: E402

TIMEOUT_S = 240  # spawned processes import torch: generous on a loaded 2-core machine


def _folder(root: str, n: int, broken: int | None = None) -> str:
    rng = np.random.default_rng(3)
    for i in range(n):
        d = os.path.join(root, f"class_{i % 2}")
        os.makedirs(d, exist_ok=True)
        img = cv2.GaussianBlur(rng.integers(0, 256, (48 + i, 64, 3), dtype=np.uint8), (5, 5), 2)
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
        data = buf.tobytes()
        if i == broken:
            data = data[: len(data) // 3]  # cut off: the decode fails
        with open(os.path.join(d, f"{i:03d}.jpg"), "wb") as f:
            f.write(data)
    return root


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_every_epoch_counts_every_image_once_over_the_processes(tmp_path):
    root = _folder(str(tmp_path / "data"), 37)
    loader = BareLoader(root, 32, seed=1, processes=2)
    try:
        for epoch in range(3):
            batches = list(loader.epoch(epoch))
            assert 1 <= len(batches) <= 2  # one per process that did any of the epoch
            assert sum(b.shape[0] for b, _ in batches) == 37
            for b, labels in batches:
                assert b.dtype == torch.uint8 and b.shape[1:] == (3, 32, 32)
                assert labels.shape == (b.shape[0],)
        assert loader.stats() == {"processes": 2}
    finally:
        loader.close()
    assert not any(p.is_alive() for p in loader._procs)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_failing_sample_is_an_error_naming_the_process(tmp_path):
    root = _folder(str(tmp_path / "data"), 12, broken=5)
    loader = BareLoader(root, 32, processes=2)
    try:
        with pytest.raises(RuntimeError, match=r"bare: process bare-[01] failed: .*Error"):
            list(loader.epoch(0))
    finally:
        loader.close()
    assert not any(p.is_alive() for p in loader._procs)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_process_that_dies_is_an_error_naming_it_not_a_hang(tmp_path):
    root = _folder(str(tmp_path / "data"), 8)
    loader = BareLoader(root, 32, processes=2)
    try:
        victim = loader._procs[1]
        victim.kill()
        victim.join(timeout=30)
        assert victim.exitcode not in (None, 0)
        with pytest.raises(RuntimeError, match=r"bare: process bare-1 died \(exit code -9\)"):
            list(loader.epoch(0))
    finally:
        loader.close()
    assert not any(p.is_alive() for p in loader._procs)
