"""The names this module held before it was split, still importable from here:
buffer memory is in :mod:`.buffers`, the pool in :mod:`.pool`, the batch being
filled and the scratch arrays in :mod:`.filling`.

``Batch`` here is the batch being filled (:class:`~.filling.FillingBatch`), not
the public ``feeder.Batch`` of delivered fields.
"""

from __future__ import annotations

from .buffers import SIZE, BatchBuffer, MaskPlanes, _ALLOCATING, _host, _move_masks, move_slots
from .filling import FillingBatch, Scratch, _place
from .pool import (FILLING, FREE, LENT, PARKED, QUEUED, RETIRED, BufferPool, _BUSY_S, _POLL_S,
                   _REAPING_S, _now, log)

Batch = FillingBatch

__all__ = ["SIZE", "Batch", "BatchBuffer", "BufferPool", "FILLING", "FREE", "FillingBatch", "LENT",
           "MaskPlanes", "PARKED", "QUEUED", "RETIRED", "Scratch", "move_slots", "_ALLOCATING",
           "_BUSY_S", "_POLL_S", "_REAPING_S", "_host", "_move_masks", "_now", "_place", "log"]
