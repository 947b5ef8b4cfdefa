"""Made-slow parts for tests/doctor/test_doctor.py, importable as
``tests.support.doctor:NAME`` by ``feeder-doctor`` (the tests put the repository
on ``sys.path``).

The image folder comes from ``$FEEDER_DOCTOR_TEST_DATA`` (set by the test)."""

from __future__ import annotations

import os
import threading
import time

from feeder import ImageFolder, ops


def small():
    """Cheap transforms: a 64-pixel crop and a flip."""
    return [ops.RandomResizedCrop(64), ops.RandomHorizontalFlip()]


class _SleepyTransform:
    """A transform that takes 5 ms an image, GIL released (as a slow C call would)."""

    def __call__(self, img, rng):
        time.sleep(0.005)
        return img


def slow_transforms():
    return [ops.RandomResizedCrop(64), _SleepyTransform()]


class SerializedSource:
    """Storage that serves one read at a time, 10 ms each (a saturated disk): about
    100 samples/s however many threads read."""

    reads_may_block = True

    def __init__(self) -> None:
        self.inner = ImageFolder(os.environ["FEEDER_DOCTOR_TEST_DATA"])
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.inner)

    def read(self, index: int):
        with self.lock:
            time.sleep(0.01)
            return self.inner.read(index)


class _GILBurner:
    """A transform that holds the GIL for a fixed time of pure-Python work (a few
    ms an image, as a transform written in Python does): while it runs, any other
    Python thread waits for the interpreter. Timed, not counted in iterations, so
    that it costs the same on a slower or busier CPU as on a fast one."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, img, rng):
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return img


def gil_transforms():
    """A small crop, then a pure-Python transform of 8 ms an image."""
    return [ops.RandomResizedCrop(32), _GILBurner(0.008)]


def launch_bound_step(images, labels):
    """A launch-bound training step: 1000 tiny torch ops on a small CPU tensor (a
    host thread launching kernels, taking the GIL back after each), then 6 ms
    with the GIL released (the host waiting for the device)."""
    import torch

    x = torch.zeros(16)
    for _ in range(1000):
        x.add_(1)
    time.sleep(0.006)


class ManyPhotos:
    """The test photos, each 20 times: an epoch long enough that a fed run never
    restarts its pipeline (a new pass's first batches make the loop wait)."""

    reads_may_block = False

    def __init__(self) -> None:
        self.inner = ImageFolder(os.environ["FEEDER_DOCTOR_TEST_DATA"])

    def __len__(self) -> int:
        return 20 * len(self.inner)

    def read(self, index: int):
        return self.inner.read(index % len(self.inner))
