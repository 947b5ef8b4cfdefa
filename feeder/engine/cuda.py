"""CUDA streams and events for the transfer: the engine's high-priority side
streams (:class:`SideStream`), events that sleep instead of spinning
(:func:`blocking_event`, :func:`wait_idle`), and the consumer's side of each
batch (:func:`wait_for`). The reasoning is in docs/design/cuda-transfer.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .config import resolve_device
from .queue import Closed

__all__ = ["SideStream", "blocking_event", "wait_for", "wait_idle"]

# The logger of the module this code was defined in before, so that filters on
# it keep working.
log = logging.getLogger("feeder.engine.transfer")

# How long SideStream.close() waits for a copy being queued by the transfer
# thread (a few launches: microseconds, unless the thread is descheduled).
_CLOSE_LOCK_S = 1.0


def blocking_event() -> Any:
    """A CUDA event whose ``synchronize()`` sleeps instead of spinning a core
    (``cudaEventBlockingSync``). test_events_are_blocking."""
    return torch.cuda.Event(blocking=True)


def wait_idle(stream: Any) -> None:
    """Wait, asleep, until everything queued on ``stream`` so far has run.
    (``stream.synchronize()`` spins under the default device flags.)"""
    event = blocking_event()
    event.record(stream)
    event.synchronize()


def _highest_priority() -> int:
    """The highest stream priority torch gives out (lower is higher); -1 when the
    range cannot be read (torch maps an out-of-range value to the nearest one)."""
    try:
        return int(torch.cuda.Stream.priority_range()[1])
    except (AttributeError, RuntimeError, TypeError, IndexError):
        return -1


class SideStream:
    """An engine's side CUDA streams: one per device the engine's passes deliver
    to (one, unless the program changes its current device between passes),
    made once, on that device, with the highest priority (see
    docs/design/cuda-transfer.md); and the guard that stops new copies before teardown.

    Args:
        requested: The feeder's ``device`` (``"cuda"`` or ``"cuda:N"``).
    """

    def __init__(self, requested: torch.device) -> None:
        self.requested = requested
        self.device: torch.device | None = None  # the latest pass's, resolved
        self._streams: dict[int, Any] = {}
        # Held while the transfer thread queues copies from host memory, and by
        # close(): once close() has drained the streams, no copy can be queued
        # behind its back from memory about to be unregistered.
        self._lock = threading.Lock()
        self.closed = False

    def begin_pass(self) -> torch.device:
        """Resolve the device of the pass starting now (in the thread calling its
        first ``next()``) and make its stream if this is the first pass there."""
        device = resolve_device(self.requested)
        self.stream(device)
        self.device = device
        return device

    def stream(self, device: torch.device) -> Any:
        """The side stream of ``device`` (an indexed CUDA device), made on first use."""
        with self._lock:
            found = self._streams.get(device.index)
            if found is None:
                # Made with the device current: the stream, and the context it
                # needs, on that device only.
                with torch.cuda.device(device):
                    found = torch.cuda.Stream(device=device, priority=_highest_priority())
                self._streams[device.index] = found
            return found

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Held while copies from host memory are queued; raises :class:`Closed`
        after :meth:`close` (the transfer thread then exits quietly)."""
        with self._lock:
            if self.closed:
                raise Closed("side stream")
            yield

    def close(self, timeout: float = _CLOSE_LOCK_S) -> bool:
        """Refuse new copies and wait (asleep) until every copy queued on the side
        streams has finished reading host memory. Safe to repeat, from any thread.

        Returns:
            False when a copy being queued held the lock past ``timeout`` seconds:
            the caller must then not free or unregister the memory it may read.
        """
        if not self._lock.acquire(timeout=timeout):
            log.warning("feeder: the transfer thread is still queuing a copy after %.1f s; "
                        "host memory it may read is left registered", timeout)
            return False
        try:
            if self.closed:
                return True  # drained then, and nothing queued since
            self.closed = True
            for index, stream in list(self._streams.items()):
                with torch.cuda.device(index):
                    wait_idle(stream)
        finally:
            self._lock.release()
        return True

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The latest pass's device current in this thread (a no-op before any pass):
        for CUDA calls made outside the transfer thread."""
        if self.device is None:
            yield
            return
        with torch.cuda.device(self.device):
            yield


def wait_for(device: torch.device, event: Any, tensors: Iterable[torch.Tensor]) -> None:
    """Make the current stream of ``device`` (the consumer's, in ``next()``) wait on
    a batch's ``event``, and ``record_stream`` the batch's device ``tensors`` on it,
    so that the caching allocator does not reuse their blocks while that stream
    may still read them."""
    stream = torch.cuda.current_stream(device)
    stream.wait_event(event)
    for tensor in tensors:
        tensor.record_stream(stream)
