"""What travels between the stages for one sample, and the limits every stage shares.

This module sits below every stage: it imports nothing of feeder's.
"""

from __future__ import annotations

from typing import Any

# Default ceiling on decoded pixels (width * height): a decompression bomb is
# rejected from its header before any pixel memory is allocated. 2**28 pixels
# is 768 MiB of RGB, far beyond any training image.
DEFAULT_MAX_PIXELS = 1 << 28


class Task:
    """One sample on its way through the stages (one object, reused by every stage).

    Attributes:
        batch: The ``_batch.Batch`` it belongs to.
        slot: Its position in that batch.
        index: Its index in the source.
        data: The encoded bytes, between the read and the decode step.
        label: Its label, as the source gave it.
        key: Its randomness key, from (seed, epoch, index).
        image: The decoded image, between the decode and the transform step.
        ctx: The ``ops.SampleContext`` the decode step computed for the transforms.
    """

    __slots__ = ("batch", "slot", "index", "data", "label", "key", "image", "ctx")

    def __init__(self, batch: Any, slot: int, index: int) -> None:
        self.batch = batch
        self.slot = slot
        self.index = index
        self.data: Any = None
        self.label: Any = -1
        self.key = 0
        self.image: Any = None
        self.ctx: Any = None
