"""In-memory sources: plain, counting its reads, blocking on one sample."""

from __future__ import annotations

import collections
import threading

from .passes import JOIN_TIMEOUT_S


class MemorySource:
    """An in-memory source; labels default to the sample index (for exactly-once checks)."""

    def __init__(self, blobs: list[bytes], labels: list[int] | None = None, names: list[str] | None = None):
        self.blobs = blobs
        self.labels = list(range(len(blobs))) if labels is None else labels
        self.names = names

    def __len__(self) -> int:
        return len(self.blobs)

    def read(self, index: int):
        return self.blobs[index], self.labels[index]

    def describe(self, index: int) -> str:
        return self.names[index] if self.names else f"mem://{index}"


class CountingSource(MemorySource):
    """A :class:`MemorySource` that counts ``read()`` calls per index (``reads``)."""

    def __init__(self, blobs: list[bytes], labels: list[int] | None = None):
        super().__init__(blobs, labels)
        self.reads: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def read(self, index: int):
        with self._lock:
            self.reads[index] += 1
        return super().read(index)


class BlockingSource(MemorySource):
    """``read(stuck)`` blocks until ``release`` is set (storage that hangs on one
    sample); ``entered`` is set once it is blocked. A read never released fails
    with TimeoutError after ``JOIN_TIMEOUT_S``."""

    def __init__(self, blobs: list[bytes], stuck: int = 0):
        super().__init__(blobs)
        self.stuck = stuck
        self.entered = threading.Event()
        self.release = threading.Event()

    def read(self, index: int):
        if index == self.stuck:
            self.entered.set()
            if not self.release.wait(JOIN_TIMEOUT_S):
                raise TimeoutError(f"read({index}) was never released")
        return super().read(index)
