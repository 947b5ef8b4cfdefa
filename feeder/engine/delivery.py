"""The messages the transfer stage sends the consumer: a :class:`Delivery` (a batch
ready for ``next()``) or a :class:`Failure` (an error travelling in-band).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .batch_dict import Batch
from .buffers import BatchBuffer

__all__ = ["Delivery", "Failure"]


@dataclass(slots=True)
class Delivery:
    """A batch ready for the consumer: ``event`` is set for CUDA batches, ``lent``
    for a CPU batch that is a view of a pool buffer; ``indices`` are the source
    indices of its samples and ``number`` its position among the pass's batches.

    ``fields`` holds a dict sample's batch (``"image"`` and every other field),
    None for pairs; ``extra`` the device tensors behind its other fields, which
    the consumer's stream must ``record_stream`` as it does the images."""

    images: torch.Tensor
    labels: Any
    indices: np.ndarray
    number: int
    event: Any
    lent: BatchBuffer | None = None
    fields: dict[str, Any] | None = None
    extra: tuple[torch.Tensor, ...] = ()
    host: dict[str, tuple[torch.Tensor, list]] | None = None  # see Batch._host

    def batch(self) -> Any:
        """What ``next()`` returns: ``(images, labels)``, or the dict of fields."""
        if self.fields is None:
            return self.images, self.labels
        if type(self.fields) is not dict:
            return self.fields
        batch = Batch(self.fields.items())
        if self.host:
            batch._host = self.host
        return batch

    def device_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch whose memory the consumer's stream will read."""
        found = [self.images, *self.extra]
        if isinstance(self.labels, torch.Tensor):
            found.append(self.labels)
        return found


class Failure:
    """An error travelling in-band to the consumer."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error
