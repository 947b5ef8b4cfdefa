"""The collating end of a pass: completed batches become output batches (in
order when asked, topped up past skipped samples, padded when sizes vary), and
the one loop that feeds them to the last stage, which the transfer stage and
the isolated engine's shipper share (:class:`CollatingStage`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .buffers import SIZE, BatchBuffer, move_slots
from .filling import FillingBatch
from .queue import END, Channel
from .stage import Control, Counters, Stage
from ..errors import FeederError
from ..sample.sizes import Padding

Output = tuple[BatchBuffer, int]  # a buffer and how many leading samples it delivers

def batch_extent(sizes: np.ndarray, divisibility: int) -> tuple[int, int]:
    """The (height, width) a variable-size batch is padded to: its largest image's
    sides, each rounded up to a multiple of ``divisibility``."""
    h, w = (int(v) for v in sizes.max(axis=0))
    d = divisibility
    return -(-h // d) * d, -(-w // d) * d


def pad_batch(padding: Padding, buf: BatchBuffer, n: int) -> None:
    """Pad the first ``n`` slots of a variable-size batch (``Feeder(max_image_size=...)``).

    Every image sits at the top left of its slot with its (height, width) in the
    buffer's ``"size"`` array. Before a batch is delivered, the pixels of the
    batch's extent (:func:`batch_extent`, rounded to ``padding.divisibility``)
    outside each image are set to 0, and those outside each mask to
    ``padding.mask_fill``: the slots hold whatever an earlier batch of the buffer
    left there. Only the padding is written, nothing else: the cost is that of
    the padding itself.
    """
    sizes = buf.arrays[SIZE][1][:n]
    Hb, Wb = batch_extent(sizes, padding.divisibility)
    planes = buf.planes
    low, high = padding.mask_fill & 0xFF, padding.mask_fill >> 8
    if planes is not None and high:
        # A fill past 255 needs the high bytes: the batch's masks come as int64.
        planes._high()
        planes.wide[:n] = True
    for slot in range(n):
        h, w = (int(v) for v in sizes[slot])
        for plane, value in ((buf.images, 0), (None if planes is None else planes.low, low),
                             (None if planes is None else planes.high, high)):
            if plane is None:
                continue
            plane[slot, h:Hb, :Wb] = value
            plane[slot, :h, w:Wb] = value


class Collator:
    """Turns completed batches into full output batches, in order when asked.

    Full batches pass straight through (no copy). A batch with skipped samples
    (or the short last batch) is held as the *open* batch and topped up from
    the next such batch, so output batches keep ``batch_size`` and every
    surviving sample is delivered exactly once. With ``ordered`` the input is
    re-sequenced by batch index first, which makes the result independent of
    thread timing.
    """

    def __init__(self, batch_size: int, ordered: bool, drop_last: bool,
                 release: Callable[[BatchBuffer], None],
                 park: Callable[[BatchBuffer, bool], None] = lambda buf, parked: None,
                 pad: Callable[[BatchBuffer, int], None] | None = None) -> None:
        self.batch_size, self.ordered, self.drop_last = batch_size, ordered, drop_last
        # Where a buffer goes that delivers nothing (back to the pool), and the
        # pool's note that one is held open, waiting for more samples.
        self._release, self._park = release, park
        # Run on each output batch as it leaves (variable sizes: pad_batch); in the
        # isolated engine that is the worker process, off the training process.
        self._pad = pad
        self._pending: dict[int, FillingBatch] = {}  # ordered: completed batches ahead of their turn
        self._next = 0  # ordered: the batch index next in line
        self._open: FillingBatch | None = None  # the partial batch being topped up
        self._fill = 0  # its samples so far

    def add(self, batch: FillingBatch) -> Iterator[Output]:
        """Feed a completed batch; yield what can be delivered now.

        Raises:
            BaseException: the batch's recorded error, when it is next in line.
        """
        if self._pad is None:
            yield from self._add(batch)
            return
        for buf, n in self._add(batch):
            self._padded(buf, n)
            yield buf, n

    def _padded(self, buf: BatchBuffer, n: int) -> None:
        try:
            self._pad(buf, n)
        except BaseException:
            self._release(buf)
            raise

    def _add(self, batch: FillingBatch) -> Iterator[Output]:
        if not self.ordered:
            yield from self._take(batch)
            return
        self._pending[batch.index] = batch
        while self._next in self._pending:
            yield from self._take(self._pending.pop(self._next))
            self._next += 1

    def finish(self) -> Iterator[Output]:
        """End of pass: deliver (or drop, with ``drop_last``) the open partial batch."""
        for buf, n in self._finish():
            if self._pad is not None:
                self._padded(buf, n)
            yield buf, n

    def _finish(self) -> Iterator[Output]:
        if self._pending:
            raise RuntimeError(f"batches {sorted(self._pending)} completed but never sequenced")
        if self._open is not None:
            batch, fill = self._open, self._fill
            self._open = None
            self._park(batch.buffer, False)
            if self.drop_last or fill == 0:
                self._release(batch.buffer)
            else:
                yield batch.buffer, fill

    def _take(self, batch: FillingBatch) -> Iterator[Output]:
        if batch.error is not None:
            self._release(batch.buffer)
            raise batch.error
        good = batch.compact()
        B = self.batch_size
        if good == B:
            yield batch.buffer, B
            return
        if good == 0:
            self._release(batch.buffer)
            return
        if self._open is None:
            self._open, self._fill = batch, good
            self._park(batch.buffer, True)
            return
        # Top the open batch up from this one; what is left becomes the open batch.
        dst, src = self._open.buffer, batch.buffer
        k = min(B - self._fill, good)
        move_slots(src, 0, dst, self._fill, k)
        self._fill += k
        rest = good - k
        if self._fill == B:
            self._park(dst, False)
            self._open = None
            yield dst, B
        if rest:
            move_slots(src, k, src, 0, rest)
            # The open batch was just delivered (it was full), so this one takes its place.
            self._open, self._fill = batch, rest
            self._park(batch.buffer, True)
        else:
            self._release(src)


class CollatingStage(Stage):
    """The last stage of a pass (one thread, named ``"transfer"``): collates the
    completed batches it takes and hands each output batch to a ``deliver``
    function (:meth:`collate`). The transfer stage delivers to the training
    loop; the isolated engine's worker ships to the training process.

    Args:
        control: The pipeline's control interface.
        collator: Turns completed batches into output batches.
        pool: The buffer pool (buffers are lent, or released, here).
        inbox: Completed batches; outbox: what the stage hands on (or None).
    """

    def __init__(self, control: Control, collator: Collator, pool: Any, inbox: Channel,
                 outbox: Channel | None) -> None:
        super().__init__("transfer", 1, control, inbox, outbox)
        self.collator = collator
        self.pool = pool

    def collate(self, c: Counters, deliver: Callable[[BatchBuffer, int, Counters], None]
                ) -> FeederError | None:
        """Collate until the end of the pass and ``deliver`` each output batch.

        Returns:
            None at the end of the pass (every batch delivered), or the error that
            ends it early: a batch's recorded failure, or one ``deliver`` raised.
        """
        collator = self.collator
        while True:
            batch = self.get(c)
            if batch is END:
                for buf, n in collator.finish():
                    deliver(buf, n, c)
                return None
            try:
                for buf, n in collator.add(batch):
                    deliver(buf, n, c)
            except FeederError as err:
                return err
