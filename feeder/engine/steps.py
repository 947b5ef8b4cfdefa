"""The engine's per-sample steps, as plain functions with explicit inputs and
outputs::

    read       source, index             -> (image, label)             Source.read
                                          or a dict of fields           (sample.parse_sample)
    decode     bytes or pixels, key      -> (image, SampleContext)     SampleWork.decode
    transform  image, key, context, out  -> None (result in ``out``)   SampleWork.transform

:class:`~feeder.decode.step.SampleWork` (re-exported here) binds decode and
transform to one feeder's settings; :func:`steps` makes the engine's three
steps of it. A pair with an int label, the classic sample, takes no per-field
work: the label goes straight into the batch's int64 labels.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from ..decode.step import _FUSED, SampleWork
from ..errors import ConfigError, DecodeError
from .. import sources as _sources
from ..sources import FileList
from ..sample import INT_SCALAR, LABEL, MASK, NUMERIC, SIZE, Task, parse_sample
from ..sample.rng import epoch_key, index_key
from .stage import Step

__all__ = ["SampleWork", "as_label", "read_sample", "source_files", "steps"]

_INT64 = (-(1 << 63), 1 << 63)
_READ_FILE = _sources._read_file  # FileList.read's reader, as imported (see _path_label)
_SIZE_DTYPE = np.dtype(np.int64)
_SLOT = operator.attrgetter("slot")

#: A task's data once the read step has read and decoded it into its slot.
_READ_FUSED = object()


class _Failed:
    """The read step's fused decode failed: the decode step raises ``error``, so
    that the failure is the decode's, as it would have been."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def source_files(source: Any) -> int | None:
    """How many samples ``source`` holds (an upper bound on its distinct files),
    or None when it cannot say."""
    try:
        n = len(source)
    except Exception:  # noqa: BLE001 - any source that cannot say is "not known"
        return None
    return n if isinstance(n, int) and n >= 0 else None


def as_label(label: Any) -> int:
    """``label`` as the int64 the batch buffer stores, converted the same way.

    Raises:
        TypeError, ValueError, OverflowError: not representable as int64.
    """
    box = np.empty((), np.int64)
    box[()] = label
    return int(box)


def read_sample(source: Any, work: SampleWork, task: Task, sample: Any) -> Task:
    """The read step's checks of what ``source.read`` returned for ``task`` (see
    ``feeder.sample``); a pair of bytes and an int label, once the schema has seen
    one, never comes here (see :func:`steps`).

    Raises:
        SourceError: ``read`` returned something that is not a sample.
        FieldError: a field is malformed, or differs from the first sample's
            (naming the field).
    """
    schema = work.schema
    data, fields, is_dict = parse_sample(sample, source, task.index)
    if work.variable and SIZE in fields:
        raise ConfigError(f"sample {task.index} has a field {SIZE!r}, which variable-size batches "
                          f"(max_image_size) use for each image's valid (height, width): rename "
                          f"the source's field")
    schema.check(task.index, is_dict, tuple(sample) if is_dict else None, fields)
    task.data = data
    if not is_dict and not work.chain.takes_samples and schema.specs[LABEL] == INT_SCALAR:
        task.label = int(fields[LABEL])
        schema.classic = True
    else:
        task.fields = fields
    return task


def steps(source: Any, work: SampleWork, scratch: Any, seed: int,
          epoch: int, inline: bool = False, read_inline: bool = False) -> tuple[Step, Step, Step]:
    """The engine's three steps on a :class:`~feeder.sample.Task`, for one pass.

    ``read`` and ``decode`` return the task; ``augment`` writes the result into
    the task's slot of its batch (or a scratch array, when the batch has no buffer
    yet) and returns the batch when that completes it, else None.

    ``inline``: the augment step runs in the decode threads: a JPEG sample whose
    batch has its buffer has the chain's first steps fused into its decode
    (``SampleWork.decode_into``), into its slot. ``read_inline``: so does the
    read step (no read stage); with both, a FileList's file is read in the
    call that decodes it (:func:`_read_fused`).
    """
    pass_key = epoch_key(seed, epoch)  # each sample's key is then one mix away
    variable = work.variable
    fused = inline and work.fused is not None  # path_label: see _read_fused
    path_label = _path_label(source) if fused and read_inline else None

    read = _read_step(source, work, path_label)

    def decode(task: Task) -> Task:
        key = task.key
        if key is None:  # the sampler keys its batches; a task made elsewhere is keyed here
            task.key = key = index_key(pass_key, task.index)
        data, task.data = task.data, None
        if data is _READ_FUSED or type(data) is _Failed:  # the read step decoded it
            return _read_fused_done(task, data)
        fields = task.fields
        if fused and fields is None:
            buf = task.batch.buffer
            if buf is not None:
                # image None: the slot holds the fused steps' result.
                task.image, task.ctx = work.decode_into(data, key, buf.images[task.slot])
                return task
        task.image, task.ctx = work.decode(data, key)
        if fields is not None and MASK in fields:
            fields[MASK] = work.decode_mask(fields[MASK], task.ctx.source_size)
        if fields is not None:
            work.check_instances(fields, task.ctx.source_size)
        return task

    def augment(task: Task) -> Any:
        batch = task.batch
        slot = task.slot
        buf = batch.buffer
        fields = task.fields
        if fields is not None:
            _augment_fields(work, scratch, variable, task, batch, slot, buf, fields)
        elif buf is not None:
            image = task.image
            if image is None:  # fused into the slot by the decode step
                size = work.finish_into(task.key, buf.images[slot])
            else:
                size = work.transform(image, task.key, task.ctx, buf.images[slot])
            task.image = None  # its memory is back in the pool (see below)
            buf.labels[slot] = task.label
            if variable:
                buf.array(SIZE, _SIZE_DTYPE, (2,))[slot] = size
            buf.indices[slot] = task.index
        else:
            _augment_into_scratch(work, scratch, variable, task, batch, slot)
        return batch if batch.finish_slot() else None

    # A sample in the fused read is being read and decoded (see _read_fused).
    busy, run = ((None, None) if path_label is None
                 else ("read and decode", _run_reader(work, path_label, scratch)))
    return Step("read", read, busy=busy, run=run), Step("decode", decode), Step("augment", augment)


def _read_step(source: Any, work: SampleWork, path_label: Any) -> Callable[[Task], Task]:
    """The read step of :func:`steps`: a classic pair (bytes and an int label, once
    the schema has seen one) takes no further work; anything else is checked
    (:func:`read_sample`)."""
    read_source, schema, (low, high) = source.read, work.schema, _INT64

    def read(task: Task) -> Task:
        if path_label is None or not (task.data is not None  # read with its run (_read_run)
                                      or (schema.classic and task.key is not None
                                          and _read_fused(work, task, path_label))):
            sample = read_source(task.index)
            if not (schema.classic and type(sample) is tuple and len(sample) == 2
                    and type(sample[0]) is bytes and type(sample[1]) is int and low <= sample[1] < high):
                return read_sample(source, work, task, sample)
            task.data, task.label = sample
        if schema.support < 2:  # a classic pair: it agrees with the first (see Schema.support)
            schema.support = 2
        return task

    return read


def _run_reader(work: SampleWork, path_label: Any, scratch: Any) -> Any:
    """The read step's ``Step.run``: :func:`_read_run` on a run, once the schema
    knows the samples are classic pairs, into its batch's buffer, or into
    scratch arrays while the batch has none where nothing follows the fused
    steps (the samples then wait there, as the augment step's would)."""
    schema = work.schema
    whole = not work.fused.rest  # type: ignore[union-attr] - the fused steps are the chain

    def read_run(tasks: list[Task], at: Any) -> tuple[list[Task], int, Any]:
        if not tasks or not schema.classic:
            return tasks, 0, None
        buf = tasks[0].batch.buffer
        if buf is None and not whole:
            return tasks, 0, None
        return _read_run(work, tasks, buf, path_label, at, scratch)

    return read_run


def _path_label(source: Any) -> Any:
    """A FileList's ``path_label`` where its ``read`` and ``path_label`` are
    FileList's own, neither overridden by a subclass nor replaced on the
    instance, and FileList reads through the module's own file reader (what
    :func:`_read_fused` reads in their place); else None."""
    if (isinstance(source, FileList) and _sources._read_file is _READ_FILE
            and getattr(source.read, "__func__", None) is FileList.read
            and getattr(source.path_label, "__func__", None) is FileList.path_label):
        return source.path_label
    return None


def _read_fused(work: SampleWork, task: Task, path_label: Any) -> bool:
    """The read step of a FileList's classic pair whose batch has its buffer:
    the region decoder reads the file and decodes it into the slot in one
    call (``SampleWork.read_into``). True when the task is read: its data is
    then :data:`_READ_FUSED`, the file's bytes (for the decode step), or a
    :class:`_Failed` decode; False when the file was not read (the read step
    reads it as ever). A file that cannot be read fails here, in the read step."""
    buf = task.batch.buffer
    path, label = path_label(task.index)
    if buf is None or not _plain(path, label):
        return False
    try:
        got = work.read_into(path, task.key, buf.images[task.slot])
    except DecodeError as exc:  # the decode step's failure: raised there
        got = _Failed(exc)
    if got is None:
        return False
    task.data, task.label = (_READ_FUSED if got is True else got), label
    return True


def _read_run(work: SampleWork, tasks: list[Task], buf: Any, path_label: Any,
              at: Any, scratch: Any) -> tuple[list[Task], int, Any]:
    """The read step of a run of one batch's tasks (``Step.run``): every FileList
    file of the run read and decoded in one call (``SampleWork.read_run``) into
    its slot of ``buf``, the batch's buffer, and where nothing follows the fused
    steps, each such sample finished here as the decode and augment steps would
    finish it; with ``buf`` None (the batch has no buffer yet, and nothing
    follows the fused steps), into scratch arrays, stored in the batch as the
    augment step stores its samples. Returns (the tasks left for the steps, the
    samples finished, the batch when they completed it, else None). A task left
    has what the read step would have given it (see :func:`_read_fused`), or
    nothing: then it takes its steps as ever, and meets any error there."""
    batch = tasks[0].batch
    picked, paths, keys, outs, labels, left = [], [], [], [], [], []
    try:
        for task in tasks:
            path, label = path_label(task.index)
            if task.batch is not batch or task.key is None or not _plain(path, label):
                left.append(task)
                continue
            picked.append(task)
            paths.append(path)
            keys.append(task.key)
            outs.append(buf.images[task.slot] if buf is not None else scratch.take())
            labels.append(label)
        at.tasks = picked
        got = work.read_run(paths, keys, outs, at.at) if picked else None
    except Exception:  # noqa: BLE001 - each task then meets its error in its own steps
        got = None
    if got is None:
        if buf is None:
            for out in outs:
                scratch.give(out)
        return tasks, 0, None
    finish = not work.fused.rest  # type: ignore[union-attr] - nothing after the fused steps
    done = 0
    for task, label, result, out in zip(picked, labels, got, outs):
        if result is True and finish:
            slot = task.slot
            if buf is None:
                batch.store(slot, out, label, scratch.give, task.index)
            else:
                buf.labels[slot] = label
                buf.indices[slot] = task.index
            done += 1
            continue
        if buf is None:
            scratch.give(out)
        if result is not None:  # the sample's slot (True), or its file's bytes
            task.data, task.label = (_READ_FUSED if result is True else result), label
        left.append(task)
    left.sort(key=_SLOT)  # in the run's order, as the steps would take them alone
    complete = False
    for _ in range(done):
        complete = batch.finish_slot() or complete
    return left, done, (batch if complete else None)


def _plain(path: Any, label: Any) -> bool:
    """A path the extension reads (a str) and an int label the batch holds:
    a sample the fused read takes (:func:`_read_fused`, :func:`_read_run`)."""
    return type(path) is str and type(label) is int and _INT64[0] <= label < _INT64[1]


def _read_fused_done(task: Task, data: Any) -> Task:
    """The decode step of a task the read step decoded (:func:`_read_fused`):
    its slot holds the fused steps' result, or the decode's error is raised."""
    if type(data) is _Failed:
        raise data.error
    task.image, task.ctx = None, _FUSED
    return task


def _augment_into_scratch(work: SampleWork, scratch: Any, variable: bool, task: Task, batch: Any,
                          slot: int) -> None:
    """The augment step of a pair whose batch has no buffer yet (the training loop
    still holds the last free one): into a scratch array, copied in on binding."""
    out = scratch.take()
    try:
        size = work.transform(task.image, task.key, task.ctx, out)
        # transform() has given the decode memory back: forget the image
        # before anything else can fail, or the failure path gives it twice.
        task.image = None
        label = as_label(task.label)  # fails here, as a write into the buffer would
    except BaseException:
        scratch.give(out)
        raise
    record = None
    if variable:
        record = [(LABEL, NUMERIC, np.int64(label)),
                  (SIZE, NUMERIC, np.array(size, _SIZE_DTYPE))]
        out = out[:size[0], :size[1]]  # only the image is copied into the slot
    batch.store(slot, out, label, scratch.give, task.index, record)


def _augment_fields(work: SampleWork, scratch: Any, variable: bool, task: Task, batch: Any, slot: int,
                    buf: Any, fields: dict[str, Any]) -> None:
    """The augment step of a sample with fields: into its slot, or a scratch array."""
    out = buf.images[slot] if buf is not None else scratch.take()
    try:
        record = work.transform_sample(task.image, task.key, task.ctx, out, fields)
        task.image = None  # as for a pair: its memory is back in the pool
    except BaseException:
        if buf is None:
            scratch.give(out)
        raise
    if buf is not None:
        buf.write(slot, record)
        buf.indices[slot] = task.index
    else:
        if variable:
            h, w = next(value for name, _, value in record if name == SIZE)
            out = out[:h, :w]  # only the image is copied into the slot
        batch.store(slot, out, -1, scratch.give, task.index, record)
