"""Made-slow parts for tests/test_doctor.py, importable as ``MODULE:NAME`` by
``feeder-doctor`` (the tests put this folder on ``sys.path``).

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
