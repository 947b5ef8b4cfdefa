"""Transfer stage: sequence finished buffers into batches and hand them to the
training loop, copied to the device on a side CUDA stream when the target is CUDA.

CUDA reasoning, in one place (CI has no GPU: each point names the CPU test in
``tests/test_cuda_logic.py`` that checks it with a faked ``torch.cuda``, and
the ``scripts/gpu-check`` row that checks it on a GPU):

* The copy runs on a dedicated stream from page-locked (pinned) memory with
  ``non_blocking=True``, so it overlaps the model's kernels on the consumer's
  stream. Conversion to ``dtype`` and normalization run on the same side
  stream, after the copy, so only uint8 crosses the bus.
  So does the change to contiguous NCHW (``memory_format="contiguous"``):
  done there, it costs the training loop nothing, and it is fused with the
  dtype conversion, one pass over the batch.
* One side stream per engine (:class:`SideStream`), made once per device on
  that device, with the highest priority torch offers. ``torch.cuda.Stream()``
  hands out streams of a shared pool round robin, so a stream made per pass at
  the default priority may be the one the model or another library uses; the
  conversion and batch-transform kernels would then queue behind the model's
  kernels, and the batch's event (so the next training step) behind them.
  High priority lets the scheduler run them between the model's kernels.
  (test_side_stream_made_once_per_device_with_the_highest_priority; gpu-check
  "40 passes against a user stream".)
* ``device="cuda"`` is resolved when each pass starts (``_config.resolve_device``:
  the current device of the thread that calls the first ``next()``), and the
  stream, the pinned buffers and every CUDA call of a thread that is not the
  transfer thread (registration, unregistration, freeing host memory) run with
  that device current (``torch.cuda.device``): a torchrun rank that builds its
  feeder before ``set_device(local_rank)`` touches only its own GPU, never
  creating a context on GPU 0. (test_cuda_device_resolved_when_the_pass_starts,
  test_pinned_buffers_allocated_with_the_pass_device_current; gpu-check
  "set_device after build".)
* An event is recorded on the side stream after that work. The consumer's
  ``next()`` makes *its* current stream wait on the event before the batch is
  returned, so no kernel of the training step can read the batch early. Only
  that stream is protected: a batch used on another stream needs the user's own
  ``wait_stream``/``record_stream`` (README, "CUDA").
* The pinned source buffer goes back to the pool only after the event has
  completed (``event.synchronize()`` in this thread): reusing it earlier would
  let the decoders overwrite memory the DMA engine is still reading. The events
  are made with ``blocking=True`` (:func:`blocking_event`): a default event's
  ``synchronize()`` spins a CPU core for as long as the copy runs, a core taken
  from the decoders; a blocking one sleeps. ``stats().stage("transfer").cpu_s``
  reports the thread's CPU time. (test_events_are_blocking; gpu-check "copy
  slowed on the side stream" and "transfer CPU / wall".)
* The pinned buffers are the engine's own: each array a block of its bytes
  rounded to the page, locked with ``cudaHostRegister`` (``pinned.py``), not
  torch's caching host allocator, which rounds blocks up to a power of two and
  keeps them for the whole process. (test_pinned_blocks_are_exactly_the_buffer_bytes.)
* Teardown: before host memory a copy may still read is unregistered
  (``cudaHostUnregister``: the pool's buffers, the isolated engine's shared
  arrays), :meth:`SideStream.close` refuses new copies and waits, with a
  blocking event, for everything queued on the side streams; if it cannot,
  the memory stays registered and mapped. torch's host cache, which other code
  of the process shares, is left alone.
  (test_side_stream_drained_before_unregister, test_pinned_blocks_unlocked_after_the_drain;
  gpu-check "teardown while the side stream is busy" and "exit mid-epoch".)
* The device tensors are allocated by PyTorch's caching allocator on the side
  stream. When the training loop drops them, the allocator would hand that
  memory to the next allocation on the side stream at once, although kernels
  queued on the consumer's stream may still be reading it. ``record_stream``
  on the consumer's stream (done in ``next()``) makes the allocator wait for
  that stream's queued work before reusing the block.
* Batch transforms (``batch_transforms``, e.g. MixUp) run on the side stream
  too, after the conversion and before the event is recorded, so the consumer
  never sees a half-mixed batch. Their generators live on the device and their
  draws stay there: nothing in this thread waits for the device per batch.
* Every other field travels the same way, before the same event: fixed-shape
  ones (masks, numeric labels) from their own pinned arrays of the buffer, so
  the buffer's return to the pool after the event covers them too; boxes and
  other per-box arrays, whose sizes vary, are gathered into one pinned tensor
  per field and batch (torch's caching host allocator keeps that cheap and
  holds the block until the copy's stream has passed it), copied once and
  split on the device into one tensor per sample. A 16-bit mask batch crosses
  the bus as two uint8 planes and becomes int64 on the device. Every device
  tensor is ``record_stream``-ed on the consumer's stream, as the images are.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .batch import SIZE, BatchBuffer, BufferPool
from .on_device import BatchTransforms, Converter
from .collate import CollatingStage, Collator, batch_extent
from .config import resolve_device
from .queue import END, Channel, Closed
from .reaper import watch, watch_all
from ..sample import (BOX_LIST, IMAGE, INSTANCES, INT_SCALAR, LABEL, MASKS, NUMERIC, PER_BOX,
                           POINTS, Schema)
from .stage import Control, Counters
from ..errors import FeederError

log = logging.getLogger(__name__)

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
    made once, on that device, with the highest priority (see the module's
    docstring); and the guard that stops new copies before teardown.

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


class Batch(dict):
    """A batch of named fields: a ``dict`` (``"image"``, ``"label"``, ``"mask"``,
    ``"boxes"``...) that cannot be silently unpacked as a pair.

    ``images, targets = batch`` (or ``for images, targets in feeder``) on a
    plain dict of two fields binds the two *key names*, and the mistake
    surfaces much later (in the loss, or never). A two-field ``Batch`` raises
    a ``TypeError`` that says what to write instead when iterated directly;
    with more fields, unpacking into two names fails anyway (Python's "too
    many values to unpack"), so iterating gives the keys as a dict does. Take
    fields by name, or iterate ``batch.keys()``, ``batch.values()`` or
    ``batch.items()``, which work for any batch. Everything else is a dict's:
    ``dict(batch)``, ``{**batch}``, ``len``, ``in``, pickling, torch's pytree,
    and the trainers' device moves (which rebuild mappings from ``items()``).
    """

    # {field: (its tensor, its rows as host values)}: a variable-size batch's
    # "size" rows as (height, width) pairs, and each per-image integer field's
    # values, as the transfer stage had them on the host, so that
    # images_and_targets() does not read them back from the device (a wait for
    # the device every step). Keyed by the tensor: a field a batch transform
    # replaced is read from its new tensor.
    __slots__ = ("_host",)

    def images_and_targets(self, rename: dict[str, str] | None = None
                           ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """The batch as torchvision's detection and segmentation models take it: a
        list of ``[3, h, w]`` images, each at its own size (views of the batch:
        ``"size"`` says how much of a padded batch is the image), and a list of
        one dict per image holding its other fields (boxes, per-box fields,
        labels, a mask cut to the image's size, per-instance ``"masks"`` uint8
        ``[N, h, w]`` cut to it too, ``"keypoints"`` ``[N, K, 3]``,
        passed-through values), as Mask R-CNN and Keypoint R-CNN take them.

        A per-image integer field (one number per image, such as ``"image_id"``)
        comes as a Python ``int``, as torchvision's detection references and
        pycocotools' ``loadRes`` take ``target["image_id"]``.

        Args:
            rename: Field names to give other keys in the targets, e.g.
                ``{"box_labels": "labels"}`` for torchvision's detection models. A
                key and value ending in ``*`` rename a prefix: ``{"box_*": "*"}``
                gives ``box_labels``, ``box_area`` and ``box_iscrowd`` as
                ``labels``, ``area`` and ``iscrowd``. A field's own name wins over
                a prefix, and a longer prefix over a shorter one.

        Raises:
            ValueError: ``rename`` names a field (or a prefix) the batch does not
                have, writes ``*`` elsewhere than at the end of both a key and its
                value, or gives a field the name of another target (of a field
                already called so, or of another renamed field): one would
                silently replace the other.
        """
        images = self["image"]
        n = images.shape[0]
        size = dict.get(self, "size")
        if size is None:
            sizes = [tuple(images.shape[-2:])] * n
        else:
            sizes = self._host_values("size", size)
        out = [img[:, :h, :w] for img, (h, w) in zip(images, sizes)]
        kept = [name for name in dict.keys(self) if name not in ("image", "size")]
        names = _renamed(kept, rename or {})
        claimed: dict[str, str] = {}
        for name in kept:
            key = names[name]
            if key in claimed:
                raise ValueError(f"images_and_targets: with rename={rename!r}, the fields "
                                 f"{claimed[key]!r} and {name!r} would both be {key!r} in the "
                                 f"targets, and one would replace the other; choose another name, "
                                 f"or rename the other field too")
            claimed[key] = name
        targets: list[dict[str, Any]] = [{} for _ in range(n)]
        for name, value in dict.items(self):
            if name in ("image", "size"):
                continue
            key = names[name]
            if _per_image_integer(value, n):
                for k, number in enumerate(self._host_values(name, value)):
                    targets[k][key] = number
                continue
            for k in range(n):
                item = value[k]
                if name == "mask":
                    h, w = sizes[k]
                    item = item[:h, :w]  # of a padded batch: the image's part
                elif name == "masks" and isinstance(item, torch.Tensor) and item.dim() == 3:
                    h, w = sizes[k]
                    item = item[:, :h, :w]  # per-instance masks: the image's part
                targets[k][key] = item
        return out, targets

    def _host_values(self, name: str, value: torch.Tensor) -> list[Any]:
        """``value.tolist()``, from the host copy the transfer stage kept if it has one."""
        entry = getattr(self, "_host", {}).get(name)
        if entry is not None and entry[0] is value:
            return entry[1]
        return value.tolist()

    def __iter__(self) -> Iterator[str]:
        if len(self) == 2:
            a, b = self.keys()
            raise TypeError(
                f"a feeder batch of named fields is a dict: `x, y = batch` would bind its key names "
                f"({a!r}, {b!r}), so it is not iterated directly; take the fields by name, "
                f"batch[{a!r}], batch[{b!r}], or iterate batch.keys() / batch.items()")
        return super().__iter__()


def _per_image_integer(value: Any, n: int) -> bool:
    """Whether a batch field holds one integer per image (an id, a class), which the
    targets give as Python ints."""
    return (isinstance(value, torch.Tensor) and value.shape == (n,)
            and not value.dtype.is_floating_point and not value.dtype.is_complex
            and value.dtype != torch.bool)


def _renamed(kept: list[str], rename: dict[str, str]) -> dict[str, str]:
    """Each field's name in the targets under ``rename`` (see
    :meth:`Batch.images_and_targets`)."""
    exact: dict[str, str] = {}
    prefixes: dict[str, str] = {}
    for old, new in rename.items():
        if not isinstance(old, str) or not isinstance(new, str):
            raise ValueError(f"images_and_targets: rename maps names to names, got "
                             f"{old!r}: {new!r}")
        stars = (old.count("*"), new.count("*"))
        if stars == (0, 0):
            exact[old] = new
        elif stars == (1, 1) and old.endswith("*") and new.endswith("*"):
            prefixes[old[:-1]] = new[:-1]
        else:
            raise ValueError(f"images_and_targets: rename {old!r}: {new!r}; a prefix is "
                             f"renamed with one '*' at the end of both, as "
                             f"{{'box_*': '*'}} (box_area -> area)")
    names = {}
    used = set()
    for name in kept:
        if name in exact:
            names[name] = exact[name]
            used.add(name)
            continue
        matches = [p for p in prefixes if name.startswith(p)]
        if matches:
            prefix = max(matches, key=len)
            names[name] = prefixes[prefix] + name[len(prefix):]
            used.add(prefix + "*")
        else:
            names[name] = name
    missing = sorted(set(exact) - used) + sorted(p + "*" for p in prefixes if p + "*" not in used)
    if missing:
        raise ValueError(f"images_and_targets: rename names the field(s) {missing}, which the "
                         f"targets do not have (their fields: {kept})")
    return names


def _register_batch_with_pytree() -> None:
    # torch's pytree (tree_map, torch.compile's input handling) treats an
    # unregistered dict subclass as a leaf; flatten a Batch like a dict.
    try:
        from torch.utils import _pytree
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    def flatten(batch: Batch) -> tuple[list[Any], list[str]]:
        keys = list(batch.keys())
        return [batch[k] for k in keys], keys

    def unflatten(values: Any, keys: Any) -> Batch:
        return Batch(zip(keys, values))

    register = getattr(_pytree, "register_pytree_node", None)
    if register is not None:
        try:
            register(Batch, flatten, unflatten, serialized_type_name="feeder.Batch")
        except (TypeError, ValueError):  # an older signature, or registered already
            pass


_register_batch_with_pytree()


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
        size_divisibility: Variable-size batches (``max_image_size``): what each
            batch's extent is rounded up to; None for fixed sizes.
    """

    def __init__(self, control: Control, collator: Collator, pool: BufferPool, device: torch.device,
                 convert: "Converter", inbox: Channel, outbox: Channel,
                 batch: BatchTransforms | None = None, schema: Schema | None = None,
                 side: SideStream | None = None, size_divisibility: int | None = None) -> None:
        super().__init__(control, collator, pool, inbox, outbox)
        # Variable-size batches (max_image_size): delivered as dicts with "size",
        # cut to each batch's extent (see _collate.Padding, which padded them).
        self.size_divisibility = size_divisibility
        self.device, self.convert, self.batch, self.side = device, convert, batch, side
        self.schema = schema if schema is not None else Schema()
        self.delivered = 0  # batches delivered so far: the next one's number

    @classmethod
    def for_pass(cls, cfg: Any, control: Control, collator: Any, pool: Any, inbox: Channel,
                 outbox: Channel, seed: int, epoch: int, schema: Schema, side: SideStream | None
                 ) -> "Transfer":
        """The transfer stage of a pass with settings ``cfg`` (the feeder's ``Config``, its
        device resolved) and the pass's ``seed`` and ``epoch``."""
        convert = Converter(cfg.dtype, cfg.normalize, cfg.device, cfg.memory_format)
        variable = cfg.max_image_size is not None
        batch = (BatchTransforms(cfg.batch_transforms, seed, epoch, cfg.device,
                                 cfg.dtype if cfg.dtype is not None else torch.uint8, variable)
                 if cfg.batch_transforms else None)
        return cls(control, collator, pool, cfg.device, convert, inbox, outbox, batch, schema, side,
                   cfg.size_divisibility if variable else None)

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
        schema = self.schema
        if (schema.is_dict or schema.specs.get(LABEL, INT_SCALAR) != INT_SCALAR
                or self.size_divisibility is not None):
            self._deliver_fields(buf, n, c)
            return
        c.items += 1
        number = self.delivered
        self.delivered += 1
        indices = buf.indices[:n].copy()
        if self.batch is not None:
            try:
                self.batch.check_labels(buf.labels[:n], indices, number)
            except BaseException:
                self.pool.release(buf)
                raise
        if self.device.type == "cuda":
            self._deliver_cuda(buf, n, indices, number, c)
            return
        labels = torch.from_numpy(buf.labels[:n].copy())
        if self.convert.keeps_buffer_layout:
            # Hand out a view of the buffer; it returns to the pool when the
            # training loop's last reference to the batch is gone.
            view = buf.images[:n]
            images = torch.from_numpy(view).permute(0, 3, 1, 2)
            self.pool.lend(buf)
            # The last reference may go in any thread, inside any lock (see _reaper).
            watch(view, self.pool.release, buf)
            if self.batch is not None:
                images, labels = self.batch(images, labels, number, indices=indices)
            self.put(c, self.outbox, Delivery(images, labels, indices, number, None, buf))
            return
        try:
            images = self.convert(torch.from_numpy(buf.images[:n]).permute(0, 3, 1, 2))
        finally:
            self.pool.release(buf)
        if self.batch is not None:
            images, labels = self.batch(images, labels, number, indices=indices)
        self.put(c, self.outbox, Delivery(images, labels, indices, number, None))

    def _deliver_cuda(self, buf: BatchBuffer, n: int, indices: np.ndarray, number: int,
                      c: Counters) -> None:
        device = self.device
        try:
            with torch.cuda.stream(self.stream):
                # None queued once teardown has drained the stream
                # (test_teardown_waits_for_a_copy_being_queued).
                with self.side.copying():
                    images = buf.images_t[:n].to(device, non_blocking=True)
                    labels = buf.labels_t[:n].to(device, non_blocking=True)
                images = self.convert(images.permute(0, 3, 1, 2))
                if self.batch is not None:
                    images, labels = self.batch(images, labels, number, indices=indices)
                event = blocking_event()
                event.record(self.stream)
        except BaseException:
            wait_idle(self.stream)  # the copy may still be reading the pinned buffer
            self.pool.release(buf)
            raise
        self._hand_over(c, Delivery(images, labels, indices, number, event), buf, event)

    def _hand_over(self, c: Counters, delivery: Delivery, buf: BatchBuffer, event: Any) -> None:
        """Queue a CUDA ``delivery`` and give ``buf`` back once its copies have read it.

        The wait for the copies (asleep: a blocking event) comes after the put, so
        that it overlaps the loop's turnaround, unless the queue is full: then it
        comes first, and the buffer goes back before this thread blocks, rather
        than sit unused for as long as the loop takes to make room. This thread is
        the queue's only producer, so room seen here is still there at the put.
        (test_a_full_queue_does_not_hold_a_copied_buffer; gpu-check: "copy
        slowed on the side stream".)"""
        held: BatchBuffer | None = buf
        try:
            if self.outbox.depth() >= self.outbox.maxsize:
                event.synchronize()
                held = None
                self.pool.release(buf)
            self.put(c, self.outbox, delivery)
        finally:
            if held is not None:
                event.synchronize()
                self.pool.release(held)

    # -- samples with fields -----------------------------------------------------
    def _deliver_fields(self, buf: BatchBuffer, n: int, c: Counters) -> None:
        """:meth:`deliver` for batches of samples with fields (or non-int labels)."""
        c.items += 1
        number = self.delivered
        self.delivered += 1
        indices = buf.indices[:n].copy()
        cuda = self.device.type == "cuda"
        event = None
        lent = None
        keep: list[torch.Tensor] = []  # pinned staging tensors, alive until the copy is done
        # A lent CPU batch's views of its buffer (the image, masks): the buffer
        # returns to the pool once the training loop has dropped all of them.
        views: list[np.ndarray] = []
        extent = None
        try:
            if self.size_divisibility is not None:
                extent = batch_extent(buf.arrays[SIZE][1][:n], self.size_divisibility)
                if extent == tuple(buf.images.shape[1:3]):
                    extent = None  # the whole buffer: as for fixed sizes
            if self.batch is not None:
                self.batch.check_label_field(buf, n, self.schema, indices, number)
                self.batch.check_fields(self.schema, number)
            with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
                if cuda:
                    with self.side.copying():  # see _deliver_cuda
                        images = copy_region(buf.images_t, n, extent, self.device)
                        fields, extra = _gather(buf, n, self.schema, self.device, keep, extent)
                        if self.size_divisibility is not None:
                            # Before the event, as every copy from the buffer.
                            sizes = buf.arrays[SIZE][0][:n].to(self.device, non_blocking=True)
                            extra.append(sizes)
                    images = self.convert(images.permute(0, 3, 1, 2))
                else:
                    # The batch's part of the buffer (all of it for fixed sizes).
                    region = (buf.images[:n] if extent is None
                              else buf.images[:n, :extent[0], :extent[1]])
                    if self.convert.keeps_buffer_layout:
                        # Lent as a view: channels innermost, with the rows (and
                        # images) of the buffer's stride. A dense copy would cost
                        # a serial pass over the batch in this thread (the
                        # training loop's .contiguous() makes one when it needs it).
                        images = torch.from_numpy(region).permute(0, 3, 1, 2)
                        lent = buf
                        views.append(region)
                    else:
                        # The buffer returns to the pool at delivery: the
                        # conversion's output, and every other field, is memory
                        # of its own.
                        images = self.convert(torch.from_numpy(region).permute(0, 3, 1, 2))
                    fields, extra = _gather(buf, n, self.schema, self.device, keep, extent,
                                            views if lent is not None else None)
                    if self.size_divisibility is not None:
                        sizes = buf.arrays[SIZE][0][:n].clone()
                # Before the batch transforms, which may replace a field's tensor.
                host = _host_integers(buf, n, self.schema, fields)
                if self.size_divisibility is not None:
                    host[SIZE] = (sizes, [tuple(hw) for hw in buf.arrays[SIZE][1][:n].tolist()])
                if self.size_divisibility is not None and self.convert.normalized:
                    # The padding was 0 in uint8, so (0 - mean) / std once normalized:
                    # make it 0 in the output, as torchvision's ImageList pads
                    # normalized images. (Host sizes: no wait for the device.)
                    zero_padding(images, buf.arrays[SIZE][1][:n], sizes)
                labels = fields.get(LABEL)
                if self.batch is not None:
                    masks = {name: fields[name] for name, spec in self.schema.specs.items()
                             if spec.kind == MASKS}
                    valid = buf.arrays[SIZE][1][:n] if self.size_divisibility is not None else None
                    images, labels = self.batch(images, labels, number, masks, indices, valid)
                    if labels is not None:  # None: no "label" field, label-free transforms
                        fields[LABEL] = labels
                        extra.append(labels)
                    for name, mask in masks.items():
                        if mask is not fields[name]:
                            fields[name] = mask
                            extra.append(mask)
                if cuda:
                    event = blocking_event()
                    event.record(self.stream)
        except BaseException:
            if cuda:
                wait_idle(self.stream)  # a copy may still be reading the pinned buffer
            self.pool.release(buf)
            raise
        if lent is not None:
            self.pool.lend(buf)
            # The last reference may go in any thread, inside any lock (see _reaper).
            watch_all(views, self.pool.release, buf)
        output = None
        if self.size_divisibility is not None:
            keys = self.schema.keys if self.schema.is_dict else (IMAGE, *fields)
            output = {name: images if name == IMAGE else fields[name] for name in keys}
            output[SIZE] = sizes
        elif self.schema.is_dict:
            output = {}
            for name in self.schema.keys:
                output[name] = images if name == "image" else fields[name]
        delivery = Delivery(images, labels, indices, number, event, lent, output,
                            tuple(t for t in extra if isinstance(t, torch.Tensor)) if cuda else (),
                            host)
        if cuda:
            self._hand_over(c, delivery, buf, event)
            return
        if lent is None:
            self.pool.release(buf)
        self.put(c, self.outbox, delivery)


# Variable-size batches on CUDA: below this many bytes of rows outside a batch's
# extent per sample, one copy of the whole slots beats one copy per sample (each
# copy costs a launch, some microseconds; PCIe moves ~250 KiB in 10 us).
_ROWS_COPY_MIN_BYTES = 256 << 10


def copy_region(host: torch.Tensor, n: int, extent: tuple[int, int] | None,
                device: torch.device) -> torch.Tensor:
    """The first ``n`` slots of ``host`` (``[B, H, W, ...]``, pinned) on ``device``,
    cut to their top left ``extent`` (None: all of them), dense, copied on the
    current stream.

    Only the rows of the extent cross the bus when the rows left out are worth
    a copy per sample; the columns are cut on the device (a slot's rows are
    contiguous in host memory, a narrower window of them is not)."""
    if extent is None:
        return host[:n].to(device, non_blocking=True)
    hb, wb = extent
    H = host.shape[1]
    row_bytes = host[0, 0].numel() * host.element_size()
    if hb < H and (H - hb) * row_bytes >= _ROWS_COPY_MIN_BYTES:
        out = torch.empty((n, hb, *host.shape[2:]), dtype=host.dtype, device=device)
        for i in range(n):
            out[i].copy_(host[i, :hb], non_blocking=True)
    else:
        out = host[:n].to(device, non_blocking=True)[:, :hb]
    out = out[:, :, :wb]
    return out if out.is_contiguous() else out.contiguous()


def zero_padding(images: torch.Tensor, sizes: np.ndarray,
                 device_sizes: torch.Tensor | None = None) -> None:
    """Set the pixels of ``images`` (``[n, C, Hb, Wb]``) outside each image's valid
    (height, width) in ``sizes`` (host ``[n, 2]``) to 0, in place, in one pass
    over the batch. ``device_sizes``: the same sizes already on ``images``'
    device (the batch's "size" field), so that nothing is copied here."""
    Hb, Wb = images.shape[2:]
    if not len(sizes) or (sizes[:, 0] >= Hb).all() and (sizes[:, 1] >= Wb).all():
        return  # no padding in this batch
    if device_sizes is None:
        device_sizes = torch.from_numpy(np.ascontiguousarray(sizes)).to(images.device)
    h = device_sizes[:, 0].view(-1, 1, 1, 1)
    w = device_sizes[:, 1].view(-1, 1, 1, 1)
    rows = torch.arange(Hb, device=images.device).view(1, 1, Hb, 1)
    cols = torch.arange(Wb, device=images.device).view(1, 1, 1, Wb)
    images.masked_fill_((rows >= h) | (cols >= w), 0)


def _gather(buf: BatchBuffer, n: int, schema: Schema, device: torch.device,
            keep: list[torch.Tensor], extent: tuple[int, int] | None = None,
            views: list[np.ndarray] | None = None
            ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Every field of the first ``n`` slots of ``buf`` but the image, as delivered:
    tensors on ``device`` (copied there on the current stream) or lists; masks cut
    to ``extent`` (a variable-size batch's). Returns them with the device tensors
    the consumer's stream must record.

    On the CPU, every field is memory of its own, except with ``views`` (a lent
    batch's): masks may then be views of the buffer, each appended to ``views``,
    so that the buffer stays lent until they are gone too."""
    cuda = device.type == "cuda"
    fields: dict[str, Any] = {}
    extra: list[torch.Tensor] = []
    for name, spec in list(schema.specs.items()):
        kind = spec.kind
        if kind == NUMERIC:
            host = _numeric_host(buf, n, name, spec)
            value = host.to(device, non_blocking=True) if cuda else host.clone()
            extra.append(value)
        elif kind == MASKS:
            planes = buf.planes
            if cuda:
                value = copy_region(planes.low_t, n, extent, device)
                extra.append(value)
                if planes.is_wide(n):
                    high = copy_region(planes.high_t, n, extent, device)
                    extra.append(high)
                    value = value.long() | (high.long() << 8)
                    extra.append(value)
            else:
                host = planes.host(n, *(extent or (None, None)), copy=views is None)
                if views is not None and np.may_share_memory(host, planes.low):
                    views.append(host)
                value = torch.from_numpy(host)
        elif kind in (BOX_LIST, PER_BOX, POINTS, INSTANCES):
            arrays = buf.lists[name][:n]
            if kind == INSTANCES:
                # Each image's [Ni, h, w] masks, padded (with 0) to the batch's
                # images: one shape, as the images have.
                arrays = _padded(arrays, extent or tuple(buf.images.shape[1:3]))
            if cuda:
                # One pinned staging tensor and one copy for the whole batch; the
                # samples' tensors are views of its device copy.
                counts = [len(a) for a in arrays]
                trailing = arrays[0].shape[1:]
                staged = torch.empty((sum(counts), *trailing), pin_memory=True,
                                     dtype=torch.from_numpy(arrays[0][:0]).dtype)
                if staged.numel():
                    np.concatenate(arrays, out=staged.numpy())
                keep.append(staged)
                whole = staged.to(device, non_blocking=True)
                extra.append(whole)
                value = list(torch.split(whole, counts))
            else:
                value = [torch.from_numpy(np.array(a, copy=True)) for a in arrays]
        else:
            value = list(buf.lists[name][:n])
        fields[name] = value
    return fields, extra


def _padded(masks: list[np.ndarray], size: tuple[int, int]) -> list[np.ndarray]:
    """Per-instance masks ``[Ni, h, w]`` padded with 0 to ``size`` (height, width)."""
    out = []
    for m in masks:
        if m.shape[1:] != size:
            full = np.zeros((m.shape[0], *size), np.uint8)
            full[:, :m.shape[1], :m.shape[2]] = m
            m = full
        out.append(m)
    return out


def _numeric_host(buf: BatchBuffer, n: int, name: str, spec: Any) -> torch.Tensor:
    """The first ``n`` rows of a numeric field in the buffer's host memory."""
    return buf.labels_t[:n] if name == LABEL and spec == INT_SCALAR else buf.arrays[name][0][:n]


def _host_integers(buf: BatchBuffer, n: int, schema: Schema,
                   fields: dict[str, Any]) -> dict[str, tuple[torch.Tensor, list]]:
    """``{name: (its delivered tensor, its values)}`` for each per-image integer
    field, the values read from the host buffer for :meth:`Batch.images_and_targets`."""
    found = {}
    for name, spec in schema.specs.items():
        if spec.kind == NUMERIC and name in fields:
            host = _numeric_host(buf, n, name, spec)
            if _per_image_integer(host, n):
                found[name] = (fields[name], host.tolist())
    return found
