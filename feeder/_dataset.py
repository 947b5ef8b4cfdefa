"""``Feeder.dataset``: the source seen as a map-style dataset, one sample at a time.

Reference training scripts read ``loader.dataset`` for things other than
loading batches: ``len(loader.dataset)`` for logging and schedules, and
evaluation helpers index it (torchvision's detection reference builds its COCO
ground truth with ``img, target = dataset[i]`` for every ``i``). This view
answers those uses with the feeder's own per-sample work (the same read
checks, decode and transforms as a batch, on the calling thread), so a sample
it returns is exactly the one a batch holds for that index and epoch.

It is not a way to load batches: it has no threads and no read-ahead.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from .sample.rng import epoch_key, index_key
from .sample import IMAGE, MASK, Task
from .engine.buffers import SIZE
from .engine.steps import SampleWork, read_sample, source_files
from .errors import SampleError
from .sources import describe


class FeederDataset:
    """``feeder.dataset``: ``len()`` and ``[index]`` over the feeder's source.

    ``dataset[i]`` reads sample ``i``, decodes it and runs the feeder's
    transforms with the randomness of ``(seed, epoch, i)``, ``epoch`` being
    the latest pass's (the next pass's before any), so it is exactly the
    sample a batch of that pass holds (with deterministic transforms, of any
    pass), and returns it as torchvision datasets do: ``(image, label)`` for
    a pair, ``(image, target)`` for a sample of named fields, ``target`` the
    dict of its other fields (arrays as tensors, scalars as Python numbers).
    ``image`` is a uint8 ``[3, H, W]`` tensor, at the sample's own size
    when sizes vary (``max_image_size``: a batch pads it, a sample alone
    is not padded; ``target["size"]`` holds that size too).

    Attributes:
        source: The feeder's source (``feeder.source``).
    """

    def __init__(self, feeder: Any) -> None:
        self._feeder = weakref.ref(feeder)
        self.source = feeder.source
        # The thread engine's memory of files read to their end is shared: the
        # same files, the same settings, one table and one index ring.
        engine_work = getattr(getattr(feeder, "_engine", None), "work", None)
        self._work = SampleWork.of(feeder.chain, feeder.config.decode, feeder.config.sizes.padding,
                                   files=source_files(feeder.source),
                                   verified=getattr(engine_work, "verified", None))

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"feeder.dataset indices are ints, got {type(index).__name__}")
        n = len(self.source)
        i = int(index) + n if index < 0 else int(index)
        if not 0 <= i < n:
            raise IndexError(f"sample index {index} is out of range for a source of {n} samples")
        feeder = self._feeder()
        if feeder is None:
            raise ReferenceError("the feeder of this dataset was garbage-collected")
        work = self._work
        stage = "read"  # the engine's stage names, for the error
        try:
            task = Task(None, 0, i)
            read_sample(self.source, work, task, self.source.read(i))
            stage = "decode"
            key = index_key(epoch_key(feeder.seed, _epoch(feeder)), i)
            image, ctx = work.decode(task.data, key)
            fields = task.fields
            if fields is not None and MASK in fields:
                fields[MASK] = work.decode_mask(fields[MASK], ctx.source_size)
            if fields is not None:
                work.check_instances(fields, ctx.source_size)
            stage = "augment"
            out = np.empty((*work.image_size, 3), np.uint8)
            if fields is None:
                size = work.transform(image, key, ctx, out)
                return _chw(_own_size(out, size, work.variable)), task.label
            record = work.transform_sample(image, key, ctx, out, fields)
        except Exception as exc:
            raise SampleError(stage, i, describe(self.source, i), exc) from exc
        if work.variable:
            out = _own_size(out, next(value for name, _, value in record if name == SIZE), True)
        target = {name: _tensor(value) for name, _kind, value in record if name != IMAGE}
        if set(target) == {"label"}:
            return _chw(out), target["label"]
        return _chw(out), target

    def __repr__(self) -> str:
        return f"FeederDataset({self.source!r}, {len(self)} samples)"


def _epoch(feeder: Any) -> int:
    """The epoch of the feeder's latest pass, else of its next one."""
    return feeder._cursor.latest_epoch()


def _own_size(out: np.ndarray, size: Any, variable: bool) -> np.ndarray:
    """The image at its own size: with variable sizes (``max_image_size``) the
    transforms wrote it into the top-left corner of a buffer of the largest
    size, and a batch pads it; a sample alone has no padding (evaluation
    helpers take each image's height and width from its shape)."""
    if not variable:
        return out
    h, w = (int(v) for v in size)
    return np.ascontiguousarray(out[:h, :w])


def _chw(hwc: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(hwc).permute(2, 0, 1)


def _tensor(value: Any) -> Any:
    """A field as a torchvision dataset gives it: a scalar as a Python number (as
    the source gave it), an array as a tensor, anything else as it is."""
    if isinstance(value, np.ndarray):
        return value.item() if value.ndim == 0 else torch.from_numpy(value.copy())
    return value


def refuse_a_rebuild(caller: str) -> None:
    """Refuse ``feeder.dataset`` to Accelerate (``caller``: the module asking).

    Accelerate's ``skip_first_batches`` rebuilds a DataLoader around
    ``loader.dataset`` and would read every skipped sample through it, one at a
    time: it alone gets the AttributeError saying what to use."""
    if caller == "accelerate" or caller.startswith("accelerate."):
        raise AttributeError(
            "Feeder cannot be rebuilt as a DataLoader around its dataset: to skip the first "
            "batches of an epoch use feeder.skip(num_batches) after feeder.set_epoch(epoch); "
            "to resume, feeder.load_state_dict(state)")
