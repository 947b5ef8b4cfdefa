"""A map-style ``torch.utils.data.Dataset`` as a source (:class:`DatasetSource`):
torchvision-style targets made into feeder's fields, checked on the first sample."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import FieldError, SourceError, name_tuple
from .sample import BOX_PREFIX, BOXES, IMAGE, numeric, parse_sample, pixels_size
from .sample.parse import _is_tensor

__all__ = ["DatasetSource", "TORCHVISION_PER_BOX"]


# torchvision's per-box target fields (CocoDetection through wrap_dataset_for_transforms_v2,
# the detection references): delivered as ``box_<name>``, filtered with the boxes.
TORCHVISION_PER_BOX = ("labels", "area", "iscrowd")
_BOX_FORMATS = ("xyxy", "xywh", "cxcywh")


def _kind_of(target: Any) -> str:
    return "dict" if isinstance(target, dict) else "label"


def _xyxy(boxes: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "xyxy" or boxes.ndim != 2 or boxes.shape[-1] != 4:
        return boxes  # a malformed array is left for the sample checks to name
    boxes = boxes.astype(np.float32)
    if fmt == "xywh":
        x, y, w, h = boxes.T
        return np.stack([x, y, x + w, y + h], 1)
    cx, cy, w, h = boxes.T
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)


def _as_numpy(value: Any) -> Any:
    """A tensor as a numpy array (on the CPU, detached); anything else as given."""
    if _is_tensor(value):  # torchvision's tv_tensors (BoundingBoxes, Mask) too
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        try:
            return t.numpy()
        except TypeError:  # bfloat16 and dtypes numpy lacks: left for the checks to name
            return value
    return value


def _scalar(value: Any) -> Any:
    """A 0-d or one-element integer array as a Python int (an ``image_id``), else ``value``."""
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "iu":
        return int(value.reshape(()))
    if isinstance(value, np.integer):
        return int(value)
    return value


class DatasetSource:
    """A map-style ``torch.utils.data.Dataset`` as a source: ``len(dataset)``
    samples, sample ``i`` read by ``dataset[i]``.

    ``dataset[i]`` returns ``(image, target)``: the image as a source's ``read``
    may give it (see :mod:`feeder.sample`), the target a class index (or float
    or multi-hot label: batches are ``(images, labels)``) or a torchvision-style
    dict (``CocoDetection`` wrapped by ``wrap_dataset_for_transforms_v2``),
    whose ``"boxes"`` become feeder's boxes in ``(x0, y0, x1, y1)`` and whose
    per-box fields become ``box_<name>``. The first sample is read and checked
    when the source is built. ``__getitem__`` runs in a read stage of its own
    (``reads_may_block = True``). The forms, the checks and where it runs:
    [Bring your own Dataset](../guides/own-dataset.md).

    Args:
        dataset: Any object with ``__len__`` and ``__getitem__(index)``.
        boxes_format: How plain ``"boxes"`` tensors are written: ``"xyxy"``
            (torchvision's detection models' format), ``"xywh"`` (COCO's
            ``bbox``) or ``"cxcywh"``.
        per_box: The target's fields that hold one entry per box (a string: that
            one field).

    Raises:
        TypeError: ``dataset`` has no ``__len__`` or ``__getitem__``, or ``per_box``
            is not a string or a list of strings.
        ValueError: ``boxes_format`` is not one of those.
        feeder.SourceError: the first sample is not ``(image, target)`` with a
            target of one of the forms above.
        feeder.FieldError: a field of the first sample is malformed.
    """

    #: ``__getitem__`` runs in a read stage of its own (see the guide linked above).
    reads_may_block = True

    def __init__(self, dataset: Any, *, boxes_format: str = "xyxy",
                 per_box: Sequence[str] = TORCHVISION_PER_BOX) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(f"DatasetSource: {type(dataset).__name__} has no __len__ and "
                            f"__getitem__; pass a map-style dataset (an IterableDataset has no "
                            f"indices to shuffle or resume by)")
        if boxes_format not in _BOX_FORMATS:
            raise ValueError(f"DatasetSource: boxes_format={boxes_format!r}; one of "
                             f"{', '.join(map(repr, _BOX_FORMATS))}")
        self.dataset = dataset
        self.boxes_format = boxes_format
        self.per_box = name_tuple(per_box, "DatasetSource: per_box")
        self._name = type(dataset).__name__
        self._kind: str | None = None  # "label" or "dict", from the first sample
        if len(dataset):
            self._check_first()

    def __len__(self) -> int:
        return len(self.dataset)

    def describe(self, index: int) -> str:
        return f"{self._name}[{index}]"

    def __repr__(self) -> str:
        return f"DatasetSource({self._name}, {len(self)} samples)"

    def _fail(self, index: int, what: str) -> SourceError:
        return SourceError(f"{self._name}[{index}] {what}; DatasetSource takes (image, target) "
                           f"with target a class index or a torchvision-style dict")

    def _check_first(self) -> None:
        """Read sample 0 and run the sample checks every read gets in the engine,
        so that a dataset of another form fails at once, naming it."""
        sample = self.read(0)
        image = sample[IMAGE] if isinstance(sample, dict) else sample[0]
        if not isinstance(image, (bytes, bytearray, memoryview)) and pixels_size(image) is None:
            raise self._fail(0, f"has an image of type {type(image).__module__}."
                                f"{type(image).__qualname__}, field 'image': an image is a PIL "
                                f"image, a uint8 array or tensor, or encoded bytes"
                                .replace("builtins.", ""))
        try:
            parse_sample(sample, self, 0)
        except FieldError as exc:
            raise FieldError(exc.field, f"of {self._name}[0] {str(exc).split(' ', 2)[2]}") from None

    def read(self, index: int) -> tuple[Any, Any] | dict[str, Any]:
        sample = self.dataset[index]
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            what = (f"a {type(sample).__name__} of {len(sample)} items"
                    if isinstance(sample, (tuple, list)) else f"a {type(sample).__module__}."
                    f"{type(sample).__qualname__}".replace("builtins.", ""))
            raise self._fail(index, f"returned {what}, not (image, target)")
        image, target = sample
        kind = _kind_of(target)
        if self._kind is None:
            self._kind = kind
        elif kind != self._kind:
            first = "a dict" if self._kind == "dict" else "a class index"
            raise self._fail(index, f"has a target of type {type(target).__name__} where sample "
                                    f"0's was {first}: every sample's target must have one form")
        if kind == "label":
            return image, self._label(index, target)
        out: dict[str, Any] = {IMAGE: image}
        out.update(self._fields(index, target))
        return out

    def _label(self, index: int, target: Any) -> Any:
        if isinstance(target, (bool, np.bool_)) or target is None or isinstance(target, (str, bytes)):
            raise self._fail(index, f"has a target of type {type(target).__name__} ({target!r:.40}), "
                                    f"field 'label': a class index is an int (map class names to "
                                    f"indices in the dataset)")
        if isinstance(target, (int, np.integer)):
            return int(target)
        value = _as_numpy(target)
        if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.ndim == 0:
            return int(value)
        if (isinstance(value, np.ndarray) and value.dtype.kind in "biuf") or isinstance(value, float):
            return value
        if isinstance(value, (list, tuple)):
            arr = numeric(value)
            if arr is not None:
                return arr
            inner = type(value[0]).__name__ if len(value) else "nothing"
            hint = (" (raw COCO annotations? wrap the dataset with torchvision's "
                    "wrap_dataset_for_transforms_v2 to get a dict of boxes and labels)"
                    if inner == "dict" else "")
            raise self._fail(index, f"has a target that is a {type(value).__name__} of {inner}, "
                                    f"field 'label': a label is a number or a numeric array, and "
                                    f"fields come as a dict{hint}")
        raise self._fail(index, f"has a target of type {type(target).__module__}."
                                f"{type(target).__qualname__}, field 'label': a class index, a "
                                f"numeric array or a dict of fields".replace("builtins.", ""))

    def _fields(self, index: int, target: dict) -> dict[str, Any]:
        out: dict[str, Any] = {}
        boxes = target.get(BOXES)
        for name, value in target.items():
            if not isinstance(name, str):
                raise self._fail(index, f"has a target dict with the key {name!r}: field names "
                                        f"must be str")
            if name == IMAGE:
                raise self._fail(index, "has a target dict with an \"image\" field, the name of "
                                        "the image itself")
            if name in ("masks", "keypoints") and boxes is None:
                raise self._fail(index, f"has a target with per-instance {name!r} but no "
                                        f"\"boxes\": they come one per box")
            value = _as_numpy(value)
            if name == BOXES:
                fmt = getattr(getattr(boxes, "format", None), "name", None)  # tv_tensors.BoundingBoxes
                fmt = fmt.lower() if isinstance(fmt, str) and fmt.lower() in _BOX_FORMATS else self.boxes_format
                arr = numeric(value)
                out[BOXES] = _xyxy(arr, fmt) if arr is not None and arr.dtype.kind in "iuf" else value
            elif boxes is not None and name in self.per_box:
                out[BOX_PREFIX + name] = value
            elif name in ("masks", "keypoints") or name.startswith(BOX_PREFIX):
                # per-instance, under feeder's names (torchvision's), or per-box
                # under feeder's own prefix: one row per box even when there is one
                out[name] = value
            else:
                out[name] = _scalar(value)
        return out
