"""The transfer stage: sequence finished buffers into batches and hand them to the
training loop, copied to the device on a side CUDA stream when the target is CUDA.

Every delivery holds its buffer through one :class:`Lease`, which gives the
buffer back to the pool (or lends it to the loop) on every exit. The stream and
event handling is in :mod:`.cuda`, the fields other than the image in
:mod:`.gather`, the messages in :mod:`.delivery`; the reasoning is in
docs/design/cuda-transfer.md.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
import torch

from .batch_dict import Batch, _per_image_integer, _register_batch_with_pytree, _renamed
from .buffers import SIZE, BatchBuffer
from .collate import CollatingStage, Collator, batch_extent
from .cuda import _CLOSE_LOCK_S, SideStream, _highest_priority, blocking_event, log, wait_idle
from .delivery import Delivery, Failure
from .gather import (_ROWS_COPY_MIN_BYTES, _gather, _host_integers, _numeric_host, _padded,
                     copy_region, zero_padding)
from .on_device import BatchTransforms, Converter, OutputOptions
from .pool import BufferPool
from .queue import END, Channel
from .reaper import watch_all
from .stage import Control, Counters
from ..errors import FeederError
from ..sample import IMAGE, INT_SCALAR, LABEL, MASKS, Schema
from ..sample.sizes import Padding

# Every name this module held before it was split stays importable from here.
__all__ = ["Batch", "Converter", "Delivery", "Failure", "Lease", "SideStream", "Transfer",
           "blocking_event", "copy_region", "wait_idle", "zero_padding", "_CLOSE_LOCK_S",
           "_ROWS_COPY_MIN_BYTES", "_gather", "_highest_priority", "_host_integers",
           "_numeric_host", "_padded", "_per_image_integer", "_register_batch_with_pytree",
           "_renamed", "log"]


class Lease:
    """The transfer stage's hold on one buffer while it delivers the buffer's batch.

    The buffer leaves the lease exactly once: lent to the training loop
    (:meth:`lend`), or back to the pool (:meth:`release`, and on every exit of
    the ``with`` block that has not given it up: success, an error, a stop).
    Once copies from it may be queued (:meth:`on_stream`), it goes back only
    after they have read it: after the batch's event (:meth:`record`), or,
    before there is one, after everything queued on the stream.
    """

    __slots__ = ("pool", "buf", "event", "keep", "_stream")

    def __init__(self, pool: BufferPool, buf: BatchBuffer) -> None:
        self.pool = pool
        self.buf: BatchBuffer | None = buf  # None once lent or released
        self.event: Any = None
        # Pinned staging tensors the copies read, alive until the buffer goes back.
        self.keep: list[torch.Tensor] = []
        self._stream: Any = None

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def on_stream(self, stream: Any) -> None:
        """From now on, copies queued on ``stream`` may read the buffer."""
        self._stream = stream

    def copied(self, event: Any) -> None:
        """The copies that read the buffer are done once ``event`` has completed."""
        self.event = event

    def record(self, stream: Any) -> Any:
        """Record the batch's event on ``stream``, after everything queued there (the
        copies and the work on the device), and return it."""
        event = blocking_event()
        event.record(stream)
        self.copied(event)
        return event

    def lend(self, views: list[Any]) -> None:
        """The batch is ``views`` of the buffer, on their way to the training loop:
        the buffer goes back to the pool once they are all gone."""
        buf, self.buf = self.buf, None
        self.pool.lend(buf)
        # The last reference may go in any thread, inside any lock (see reaper.py).
        watch_all(views, self.pool.release, buf)

    def release(self) -> None:
        """Give the buffer back to the pool now, once no queued copy can read it
        (asleep: a blocking event). Safe to repeat; a no-op once lent."""
        buf = self.buf
        if buf is None:
            return
        if self.event is not None:
            self.event.synchronize()
        elif self._stream is not None:
            wait_idle(self._stream)  # a copy may still be reading the pinned buffer
        self.buf = None
        self.pool.release(buf)
        self.keep.clear()


class Transfer(CollatingStage):
    """Collates finished buffers (in order when asked) and delivers them.

    Args:
        control: The pipeline's control interface.
        collator: Turns completed batches into output batches.
        pool: The buffer pool (buffers are lent to the loop, or released, here).
        device: Where batches go.
        convert: uint8 -> the output dtype, on ``device``.
        inbox: Completed batches; outbox: deliveries for ``next()``.
        batch: Batch transforms run after ``convert``, or None.
        schema: The samples' fields (the engine's; filled in by the first samples).
        side: The engine's side streams (CUDA; None on the CPU).
        padding: Variable-size batches (``max_image_size``): how each batch was
            padded (its extent is rounded up to ``padding.divisibility``); None
            for fixed sizes.
    """

    def __init__(self, control: Control, collator: Collator, pool: BufferPool, device: torch.device,
                 convert: "Converter", inbox: Channel, outbox: Channel,
                 batch: BatchTransforms | None = None, schema: Schema | None = None,
                 side: SideStream | None = None, padding: Padding | None = None) -> None:
        super().__init__(control, collator, pool, inbox, outbox)
        # Variable-size batches (max_image_size): delivered as dicts with "size",
        # cut to each batch's extent (see collate.pad_batch, which padded them).
        self.padding = padding
        self.device, self.convert, self.batch, self.side = device, convert, batch, side
        self.schema = schema if schema is not None else Schema()
        self.delivered = 0  # batches delivered so far: the next one's number

    @classmethod
    def for_pass(cls, output: OutputOptions, padding: Padding | None, control: Control,
                 collator: Any, pool: Any, inbox: Channel, outbox: Channel, seed: int, epoch: int,
                 schema: Schema, side: SideStream | None) -> "Transfer":
        """The transfer stage of a pass with output options ``output`` (the device
        resolved), the feeder's ``padding`` (None: fixed sizes), and the pass's
        ``seed`` and ``epoch``."""
        o = output
        convert = Converter(o.dtype, o.normalize, o.device, o.memory_format)
        batch = (BatchTransforms(o.batch_transforms, seed, epoch, o.device,
                                 o.dtype if o.dtype is not None else torch.uint8,
                                 padding is not None)
                 if o.batch_transforms else None)
        return cls(control, collator, pool, o.device, convert, inbox, outbox, batch, schema, side,
                   padding)

    def work(self, c: Counters) -> None:
        if self.device.type == "cuda":
            if self.side is None or self.device.index is None:
                raise FeederError("a CUDA transfer stage needs its engine's side stream and "
                                  "the pass's resolved device")
            torch.cuda.set_device(self.device)
            self.stream = self.side.stream(self.device)
        # This thread's CPU time, for stats(): on CUDA it shows whether waiting for
        # the copies costs a core (a spinning wait would; see blocking_event).
        # One clock read per batch.
        cpu0 = time.thread_time()

        def deliver(buf: BatchBuffer, n: int, c: Counters) -> None:
            self.deliver(buf, n, c)
            c.cpu_s = time.thread_time() - cpu0

        try:
            error = self.collate(c, deliver)
            self.put(c, self.outbox, END if error is None else Failure(error))
        finally:
            c.cpu_s = time.thread_time() - cpu0

    def deliver(self, buf: BatchBuffer, n: int, c: Counters) -> None:
        """Deliver the first ``n`` slots of ``buf`` as the pass's next batch: lent to
        the loop as a view, converted, or copied to the device; the buffer is held
        by one :class:`Lease` until then."""
        schema = self.schema
        fields = (schema.is_dict or schema.specs.get(LABEL, INT_SCALAR) != INT_SCALAR
                  or self.padding is not None)
        c.items += 1
        number = self.delivered
        self.delivered += 1
        indices = buf.indices[:n].copy()
        with Lease(self.pool, buf) as lease:
            build = self._fields if fields else self._pair
            self._queue(c, build(lease, n, indices, number), lease)

    def _queue(self, c: Counters, delivery: Delivery, lease: Lease) -> None:
        """Queue ``delivery``; a buffer still held goes back first, unless it waits
        for a CUDA copy and the queue has room.

        The wait for the copies (asleep: a blocking event) comes after the put, so
        that it overlaps the loop's turnaround (the lease's exit gives the buffer
        back), unless the queue is full: then it comes first, and the buffer goes
        back before this thread blocks, rather than sit unused for as long as the
        loop takes to make room. This thread is the queue's only producer, so room
        seen here is still there at the put.
        (test_a_full_queue_does_not_hold_a_copied_buffer; gpu-check: "copy
        slowed on the side stream".)"""
        if lease.event is None or self.outbox.depth() >= self.outbox.maxsize:
            lease.release()
        self.put(c, self.outbox, delivery)

    def _hand_over(self, c: Counters, delivery: Delivery, buf: BatchBuffer, event: Any) -> None:
        """Queue a CUDA ``delivery`` whose copies from ``buf`` end with ``event``, and
        give ``buf`` back once they have read it (as :meth:`deliver` does)."""
        with Lease(self.pool, buf) as lease:
            lease.copied(event)
            self._queue(c, delivery, lease)

    # -- an image and an int label per sample ---------------------------------------
    def _pair(self, lease: Lease, n: int, indices: np.ndarray, number: int) -> Delivery:
        """The delivery of a batch of ``(images, labels)`` with int labels."""
        buf = lease.buf
        if self.batch is not None:
            self.batch.check_labels(buf.labels[:n], indices, number)
        if self.device.type == "cuda":
            return self._pair_cuda(lease, n, indices, number)
        labels = torch.from_numpy(buf.labels[:n].copy())
        lent = None
        if self.convert.keeps_buffer_layout:
            # Hand out a view of the buffer; it returns to the pool when the
            # training loop's last reference to the batch is gone.
            view = buf.images[:n]
            images = torch.from_numpy(view).permute(0, 3, 1, 2)
            lent = buf
            lease.lend([view])
        else:
            images = self.convert(torch.from_numpy(buf.images[:n]).permute(0, 3, 1, 2))
            lease.release()
        if self.batch is not None:
            images, labels = self.batch(images, labels, number, indices=indices)
        return Delivery(images, labels, indices, number, None, lent)

    def _pair_cuda(self, lease: Lease, n: int, indices: np.ndarray, number: int) -> Delivery:
        buf, device = lease.buf, self.device
        lease.on_stream(self.stream)
        with torch.cuda.stream(self.stream):
            # None queued once teardown has drained the stream
            # (test_teardown_waits_for_a_copy_being_queued).
            with self.side.copying():
                images = buf.images_t[:n].to(device, non_blocking=True)
                labels = buf.labels_t[:n].to(device, non_blocking=True)
            images = self.convert(images.permute(0, 3, 1, 2))
            if self.batch is not None:
                images, labels = self.batch(images, labels, number, indices=indices)
            event = lease.record(self.stream)
        return Delivery(images, labels, indices, number, event)

    # -- samples with fields ----------------------------------------------------------
    def _fields(self, lease: Lease, n: int, indices: np.ndarray, number: int) -> Delivery:
        """The delivery of a batch of samples with fields (or non-int labels)."""
        buf = lease.buf
        cuda = self.device.type == "cuda"
        if cuda:
            lease.on_stream(self.stream)
        extent = self._extent(buf, n)
        if self.batch is not None:
            self.batch.check_label_field(buf, n, self.schema, indices, number)
            self.batch.check_fields(self.schema, number)
        views = None
        with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
            if cuda:
                images, fields, extra, sizes = self._copied_fields(lease, n, extent)
            else:
                images, fields, extra, sizes, views = self._host_fields(lease, n, extent)
            # Before the batch transforms, which may replace a field's tensor.
            host = _host_integers(buf, n, self.schema, fields)
            if self.padding is not None:
                host[SIZE] = (sizes, [tuple(hw) for hw in buf.arrays[SIZE][1][:n].tolist()])
            if self.padding is not None and self.convert.normalized:
                # The padding was 0 in uint8, so (0 - mean) / std once normalized:
                # make it 0 in the output, as torchvision's ImageList pads
                # normalized images. (Host sizes: no wait for the device.)
                zero_padding(images, buf.arrays[SIZE][1][:n], sizes)
            labels = fields.get(LABEL)
            if self.batch is not None:
                images, labels = self._transform(images, labels, fields, extra, buf, n, number,
                                                 indices)
            event = lease.record(self.stream) if cuda else None
        if views is not None:
            lease.lend(views)
        return Delivery(images, labels, indices, number, event, buf if views is not None else None,
                        self._output(images, fields, sizes),
                        tuple(t for t in extra if isinstance(t, torch.Tensor)) if cuda else (),
                        host)

    def _extent(self, buf: BatchBuffer, n: int) -> tuple[int, int] | None:
        """A variable-size batch's extent; None for fixed sizes, or all of the buffer."""
        if self.padding is None:
            return None
        extent = batch_extent(buf.arrays[SIZE][1][:n], self.padding.divisibility)
        if extent == tuple(buf.images.shape[1:3]):
            return None  # the whole buffer: as for fixed sizes
        return extent

    def _copied_fields(self, lease: Lease, n: int, extent: tuple[int, int] | None
                       ) -> tuple[torch.Tensor, dict[str, Any], list[torch.Tensor], Any]:
        """The images, the other fields, the device tensors behind them and the
        sizes (None: fixed sizes), copied to the device on the current stream."""
        buf, device = lease.buf, self.device
        sizes = None
        with self.side.copying():  # see _pair_cuda
            images = copy_region(buf.images_t, n, extent, device)
            fields, extra = _gather(buf, n, self.schema, device, lease.keep, extent)
            if self.padding is not None:
                # Before the event, as every copy from the buffer.
                sizes = buf.arrays[SIZE][0][:n].to(device, non_blocking=True)
                extra.append(sizes)
        images = self.convert(images.permute(0, 3, 1, 2))
        return images, fields, extra, sizes

    def _host_fields(self, lease: Lease, n: int, extent: tuple[int, int] | None
                     ) -> tuple[torch.Tensor, dict[str, Any], list[torch.Tensor], Any,
                                list[np.ndarray] | None]:
        """As :meth:`_copied_fields`, on the CPU, and the views of the buffer a lent
        batch holds (None: the batch is memory of its own)."""
        buf = lease.buf
        # The batch's part of the buffer (all of it for fixed sizes).
        region = buf.images[:n] if extent is None else buf.images[:n, :extent[0], :extent[1]]
        views = None
        if self.convert.keeps_buffer_layout:
            # Lent as a view: channels innermost, with the rows (and images) of the
            # buffer's stride. A dense copy would cost a serial pass over the batch
            # in this thread (the training loop's .contiguous() makes one when it
            # needs it). The buffer returns to the pool once the training loop has
            # dropped every view of it (the image, masks).
            images = torch.from_numpy(region).permute(0, 3, 1, 2)
            views = [region]
        else:
            # The buffer returns to the pool at delivery: the conversion's output,
            # and every other field, is memory of its own.
            images = self.convert(torch.from_numpy(region).permute(0, 3, 1, 2))
        fields, extra = _gather(buf, n, self.schema, self.device, lease.keep, extent, views)
        sizes = buf.arrays[SIZE][0][:n].clone() if self.padding is not None else None
        return images, fields, extra, sizes, views

    def _transform(self, images: torch.Tensor, labels: Any, fields: dict[str, Any],
                   extra: list[torch.Tensor], buf: BatchBuffer, n: int, number: int,
                   indices: np.ndarray) -> tuple[torch.Tensor, Any]:
        """Run the batch transforms on the images, the labels and the masks; a field
        they replace is replaced in ``fields`` and its tensor added to ``extra``."""
        masks = {name: fields[name] for name, spec in self.schema.specs.items()
                 if spec.kind == MASKS}
        valid = buf.arrays[SIZE][1][:n] if self.padding is not None else None
        images, labels = self.batch(images, labels, number, masks, indices, valid)
        if labels is not None:  # None: no "label" field, label-free transforms
            fields[LABEL] = labels
            extra.append(labels)
        for name, mask in masks.items():
            if mask is not fields[name]:
                fields[name] = mask
                extra.append(mask)
        return images, labels

    def _output(self, images: torch.Tensor, fields: dict[str, Any], sizes: Any
                ) -> dict[str, Any] | None:
        """The batch's dict of fields, in the schema's order; None for pairs."""
        if self.padding is not None:
            keys = self.schema.keys if self.schema.is_dict else (IMAGE, *fields)
            output = {name: images if name == IMAGE else fields[name] for name in keys}
            output[SIZE] = sizes
            return output
        if self.schema.is_dict:
            return {name: images if name == "image" else fields[name] for name in self.schema.keys}
        return None
