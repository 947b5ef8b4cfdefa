"""Checking what a source's ``read`` returned: the image (encoded bytes or
pixels, :func:`pixels`), every field's value (:func:`parse_value`) and the whole
sample (:func:`parse_sample`, :func:`check_sample`); the protocol itself is
described in :mod:`feeder.sample.fields`."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..errors import FieldError, SourceError
from .fields import (BOX_LIST, BOX_PREFIX, BOXES, IMAGE, INSTANCE_MASKS, INSTANCES, KEYPOINTS, LABEL,
                     MASK, MASKS, NUMERIC, OBJECT, PER_BOX, POINTS, Spec, _BYTES, numeric, per_box)


def _source_name(source: Any) -> str:
    return type(source).__name__ if source is not None else "the source"


def _what(value: Any) -> str:
    name = type(value).__name__
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return f"str {shown!r}"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} items"
    if value is None:
        return "None"
    module = type(value).__module__
    return f"{module}.{name}" if module not in ("builtins",) else name


_READ_MUST = ("read(index) must return (image, label), or a dict with the image under \"image\"; "
              "an image is encoded bytes, a uint8 array or tensor, or a PIL image (see "
              "feeder.check_sample)")


def _hint(value: Any) -> str:
    if isinstance(value, (np.ndarray, bytes)) or _is_pil(value) or _is_tensor(value):
        return " (an image alone? return it with its label: (image, label))"
    if isinstance(value, str):
        return " (a path? read the file and return its bytes: open(path, 'rb').read())"
    if hasattr(value, "getpixel") or (hasattr(value, "mode") and hasattr(value, "size")):
        return (" (a decoded image of another library? return a numpy array, a tensor, a PIL "
                "image or the encoded file bytes)")
    return ""


def _bad_image(value: Any, source: Any, index: Any, where: str) -> SourceError:
    return SourceError(f"{_source_name(source)}.read({index}) returned {where} {_what(value)}, not "
                       f"an image{_hint(value)}; {_READ_MUST}")


def _image(value: Any, source: Any, index: Any, where: str) -> np.ndarray:
    """A decoded image as :func:`pixels` gives it, checked as an image.

    Raises:
        SourceError: not an image at all (a mistake in the source).
        FieldError: an array of a dtype or shape that is not an image.
    """
    arr = pixels(value, IMAGE)
    if arr is None:
        raise _bad_image(value, source, index, where)
    if arr.dtype != np.uint8:
        raise FieldError(IMAGE, f"is {_array_what(value, arr)}; an image array is uint8 (0-255): "
                                f"convert floats in [0, 1] with (x * 255).round().astype(np.uint8), "
                                f"or return the encoded file")
    if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (1, 3, 4))):
        raise FieldError(IMAGE, f"is {_array_what(value, arr)}; an image array is [H, W, 3] (numpy: "
                                f"HWC, RGB), [H, W], [H, W, 1] or [H, W, 4] (RGBA), or a [3, H, W] "
                                f"tensor (CHW)")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise FieldError(IMAGE, f"is {_array_what(value, arr)}: an empty image")
    return arr


def _array_what(value: Any, arr: np.ndarray) -> str:
    if isinstance(value, np.ndarray):
        return f"a {arr.dtype} array of shape {arr.shape}"
    if _is_pil(value):
        return f"a PIL image of mode {value.mode!r}"
    return f"a tensor of dtype {value.dtype} and shape {tuple(value.shape)}"


def _is_pil(value: Any) -> bool:
    # Pillow is optional: a value can only be a PIL image once PIL.Image is imported.
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(value, module.Image)


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


# PIL modes read as one channel of 16-bit values (``I``: how Pillow before 10
# opened 16-bit PNGs; its values must fit 16 bits).
_PIL_16 = ("I;16", "I;16B", "I;16L", "I;16N", "I")
_PIL_AS_RGB = ("1", "P", "PA", "LA")  # converted by Pillow, as a decoder shows them


def _pil_16(value: Any, field: str) -> np.ndarray:
    arr = np.asarray(value)
    if value.mode == "I" and arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFF):
        raise FieldError(field, f"is a PIL image of mode 'I' with values {int(arr.min())}.."
                                f"{int(arr.max())}, outside 16 bits")
    return arr.astype(np.uint16)


def pixels(value: Any, field: str = IMAGE) -> np.ndarray | None:
    """A decoded image or mask (numpy array, torch tensor, PIL image) as a numpy
    array in HWC layout (``[H, W]`` or ``[H, W, C]``), a view of the value's
    memory where it has one; None when ``value`` is none of those.

    A tensor whose first of three dimensions is 1, 3 or 4 is CHW (torchvision's
    layout), any other HWC. An image's PIL modes become what a decoder makes of
    the same file: ``1``, ``P``, ``PA`` and ``LA`` RGB (through Pillow's
    ``convert``), 16-bit gray 8-bit (rounded, value / 257); a mask's keep their
    stored values (palette indices, 0/1, 16 bits). Nothing here checks the
    dtype or the shape of a numpy array or tensor.

    Raises:
        FieldError: a PIL mode that is not an image (or mask) mode handled here,
            or a tensor that has no numpy dtype.
    """
    if isinstance(value, np.ndarray):
        return value
    if _is_tensor(value):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        try:
            arr = t.numpy()
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            raise FieldError(field, f"is a tensor of dtype {value.dtype}; an image tensor is "
                                    f"uint8") from None
        if field == IMAGE and arr.ndim == 3 and arr.shape[0] in (1, 3, 4):
            arr = arr.transpose(1, 2, 0)
        return arr
    if not _is_pil(value):
        return None
    mode = value.mode
    if field == MASK:
        if mode in ("L", "P"):
            return np.asarray(value)
        if mode == "1":
            return np.asarray(value).astype(np.uint8)
        if mode in _PIL_16:
            return _pil_16(value, field)
        raise FieldError(field, f"is a PIL image of mode {mode!r}; a mask image is of mode 'L', "
                                f"'P' (its indices), '1' or 'I;16'")
    if mode in ("RGB", "RGBA", "L"):
        return np.asarray(value)
    if mode in _PIL_AS_RGB:
        return np.asarray(value.convert("RGB"))
    if mode in _PIL_16:
        # As a 16-bit file is decoded: round(value / 257), exactly (257 is odd: no ties).
        return ((_pil_16(value, field).astype(np.uint32) + 128) // 257).astype(np.uint8)
    raise FieldError(field, f"is a PIL image of mode {mode!r}, which feeder does not convert; "
                            f"convert it in the source (image.convert('RGB'))")


def pixels_size(value: Any) -> tuple[int, int] | None:
    """The (height, width) of a decoded image (see :func:`pixels`) without
    converting it, or None when ``value`` is not one of an image's shapes."""
    if _is_pil(value):
        w, h = value.size
        return int(h), int(w)
    arr = pixels(value)  # a view: nothing is copied for arrays and tensors
    if arr is None or arr.ndim not in (2, 3):
        return None
    return int(arr.shape[0]), int(arr.shape[1])


def parse_sample(sample: Any, source: Any = None, index: Any = "i") -> tuple[Any, dict[str, Any] | None, bool]:
    """Split a ``read`` result into (encoded image, fields, is_dict).

    ``fields`` maps every field but the image to its checked value: numeric
    fields as arrays (:func:`numeric`), ``"boxes"`` as float32 ``[N, 4]``,
    per-box arrays as arrays, masks and other values as given.

    Raises:
        SourceError: not one of the documented shapes (a mistake in the source:
            never skipped); the message says what ``read`` must return and names
            the source class and the sample.
        FieldError: a field's value is malformed (names the field).
    """
    if isinstance(sample, tuple):
        if len(sample) != 2:
            raise SourceError(f"{_source_name(source)}.read({index}) returned {_what(sample)}; "
                              f"{_READ_MUST}")
        data, label = sample
        if not isinstance(data, _BYTES):
            data = _image(data, source, index, "a pair whose image is")
        return data, {LABEL: parse_value(LABEL, label)}, False
    if isinstance(sample, dict):
        if IMAGE not in sample:
            raise SourceError(f"{_source_name(source)}.read({index}) returned a dict without an "
                              f"\"image\" key (keys: {sorted(map(str, sample))}); {_READ_MUST}")
        data = sample[IMAGE]
        if not isinstance(data, _BYTES):
            data = _image(data, source, index, "a dict whose \"image\" is")
        fields: dict[str, Any] = {}
        for name, value in sample.items():
            if name == IMAGE:
                continue
            if not isinstance(name, str):
                raise SourceError(f"{_source_name(source)}.read({index}) returned a dict with the "
                                  f"key {name!r}; field names must be str")
            fields[name] = parse_value(name, value)
        if BOXES not in fields and any(per_box(n) for n in fields):
            first = next(n for n in fields if per_box(n))
            raise FieldError(first, "is a per-box field without \"boxes\""
                             + ("" if first.startswith(BOX_PREFIX) else
                                f" (per-instance {first} come one per box, with the boxes)"))
        if BOXES in fields:
            n = len(fields[BOXES])
            for name, value in fields.items():
                if per_box(name) and (value.ndim == 0 or value.shape[0] != n):
                    form = {INSTANCE_MASKS: "[N, H, W]", KEYPOINTS: "[N, K, 3]"}.get(name, "[N, ...]")
                    raise FieldError(name, f"has shape {value.shape} but there are {n} boxes "
                                           f"(a per-box field is {form})")
        return data, fields, True
    raise SourceError(f"{_source_name(source)}.read({index}) returned {_what(sample)}{_hint(sample)}; "
                      f"{_READ_MUST}")


def parse_value(name: str, value: Any) -> Any:
    """One field's value, checked and converted for the engine (see :func:`parse_sample`)."""
    try:
        if name == MASK:
            if isinstance(value, _BYTES):
                return value
            arr = pixels(value, MASK)
            if arr is not None and arr.ndim == 2 and arr.dtype in (np.uint8, np.uint16):
                return arr
            what = _what(value) if arr is None else _array_what(value, arr)
            raise FieldError(name, f"is {what}; a mask is encoded PNG bytes, a uint8/uint16 "
                                   f"[H, W] array or tensor, or a PIL image of mode 'L', 'P', "
                                   f"'1' or 'I;16'")
        if name == BOXES:
            arr = numeric(value)
            if arr is None or arr.dtype.kind == "b":
                raise FieldError(name, f"is {_what(value)}; boxes are a float [N, 4] array")
            if arr.size == 0:
                arr = arr.reshape(0, 4)
            if arr.ndim != 2 or arr.shape[1] != 4:
                raise FieldError(name, f"has shape {arr.shape}; boxes are [N, 4] (x0, y0, x1, y1)")
            boxes = arr.astype(np.float32)
            if not np.isfinite(boxes).all():
                raise FieldError(name, "holds a value that is not finite")
            if (boxes[:, 2] < boxes[:, 0]).any() or (boxes[:, 3] < boxes[:, 1]).any():
                k = int(np.flatnonzero((boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1]))[0])
                raise FieldError(name, f"row {k} is {boxes[k].tolist()}: x1 < x0 or y1 < y0 "
                                       f"(boxes are x0, y0, x1, y1)")
            return boxes
        if name == INSTANCE_MASKS:
            return _instance_masks(value)
        if name == KEYPOINTS:
            return _keypoints(value)
        arr = numeric(value)
        if name == LABEL and arr is None:
            # It would reach the batch as a Python list and fail later, in the loss.
            what = _what(value) + (f" of dtype {value.dtype}" if isinstance(value, np.ndarray) else "")
            raise FieldError(name, f"is {what}; a label is a number or a numeric array (map "
                                   f"class names to int indices in the source, as ImageFolder does)")
        if name.startswith(BOX_PREFIX):
            if arr is None:
                raise FieldError(name, f"is {_what(value)}; a per-box field is a numeric [N, ...] array")
            return arr
        return arr if arr is not None else value
    except OverflowError as exc:
        raise FieldError(name, str(exc)) from None


def _instance_masks(value: Any) -> np.ndarray:
    """A ``"masks"`` value as a uint8 ``[N, H, W]`` array (a view where it can be)."""
    arr = pixels(value, INSTANCE_MASKS) if not _is_pil(value) else None
    if arr is None:
        raise FieldError(INSTANCE_MASKS, f"is {_what(value)}; per-instance masks are a uint8 or "
                                         f"bool [N, H, W] array or tensor, one mask per box")
    what = _array_what(value, arr)
    if arr.dtype == np.bool_:
        arr = arr.view(np.uint8)
    elif arr.dtype == np.uint8 and arr.size and int(arr.max()) > 1:
        # 0/255 masks (as PNG mask files store them) would train a mask loss on
        # targets of 255: refuse them rather than guess a threshold.
        raise FieldError(INSTANCE_MASKS, f"holds values up to {int(arr.max())}; per-instance masks "
                                         f"are 0/1 per pixel (0/255 masks: pass masks > 0, or "
                                         f"masks // 255)")
    if arr.dtype != np.uint8:
        raise FieldError(INSTANCE_MASKS, f"is {what}; per-instance masks are uint8 or bool "
                                         f"(0/1 per pixel), [N, H, W]")
    if arr.ndim != 3:
        hint = (" (one [H, W] mask of class ids goes under \"mask\"; per-instance masks "
                "are [N, H, W], one per box: [1, H, W] for one instance)") if arr.ndim == 2 else ""
        raise FieldError(INSTANCE_MASKS, f"is {what}; per-instance masks are [N, H, W]{hint}")
    return arr


def instances_fit(count: int, size: tuple[int, int], max_pixels: int) -> None:
    """Refuse ``count`` per-instance masks of ``size`` (height, width) above the
    memory bound of one sample's masks: ``max_pixels`` bytes (one byte a pixel).

    Raises:
        FieldError: naming the field ``masks``, the count, the size and the bound.
    """
    if count * size[0] * size[1] > max_pixels:
        raise FieldError(INSTANCE_MASKS, f"would be {count} masks of {tuple(size)} (height, width) "
                                         f"= {count * size[0] * size[1]} bytes, above "
                                         f"max_pixels={max_pixels}, the bound on one sample's "
                                         f"per-instance masks (one byte a pixel): keep fewer "
                                         f"instances, or raise Feeder(max_pixels=...)")


def _keypoints(value: Any) -> np.ndarray:
    """A ``"keypoints"`` value as a float32 ``[N, K, 3]`` array."""
    arr = numeric(value)
    if arr is None or arr.dtype.kind == "b":
        raise FieldError(KEYPOINTS, f"is {_what(value)}; keypoints are a float [N, K, 3] array "
                                    f"(x, y, visibility per keypoint, one set per box)")
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise FieldError(KEYPOINTS, f"has shape {arr.shape}; keypoints are [N, K, 3] (x, y, "
                                    f"visibility per keypoint, one set of K per box)")
    points = arr.astype(np.float32)
    if not np.isfinite(points).all():
        raise FieldError(KEYPOINTS, "holds a value that is not finite")
    return points


def spec_of(name: str, value: Any) -> Spec:
    """The :class:`Spec` a checked value (from :func:`parse_sample`) implies."""
    if name == MASK:
        return Spec(MASKS)
    if name == INSTANCE_MASKS and isinstance(value, np.ndarray) and value.ndim == 3:
        return Spec(INSTANCES, np.dtype(np.uint8))
    if name == KEYPOINTS and isinstance(value, np.ndarray) and value.ndim == 3:
        return Spec(POINTS, np.dtype(np.float32), value.shape[1:])
    if name == BOXES:
        return Spec(BOX_LIST)
    # A numpy array of something else than numbers (objects, strings, dates) is,
    # as any other value, passed through as read.
    if isinstance(value, np.ndarray) and value.dtype.kind in "iufcb":
        if name.startswith(BOX_PREFIX):
            return Spec(PER_BOX, value.dtype, value.shape[1:])
        return Spec(NUMERIC, value.dtype, value.shape)
    return Spec(OBJECT)


def check_sample(sample: Any) -> None:
    """Check that ``sample`` is something a source's ``read`` may return.

    For a source's own tests: the engine makes the same checks on every
    sample, and also checks that every sample has the same fields, of the same
    shapes and dtypes. It does not decode anything.

    Raises:
        feeder.SourceError: not ``(image, label)`` or a dict with an ``"image"``;
            an image that is neither bytes nor a decoded image.
        feeder.FieldError: a field is malformed (an image array that is not
            uint8 or not of an image's shape, boxes not ``[N, 4]`` or not
            finite, a per-box array of another length, a mask that is neither
            bytes nor a uint8/uint16 ``[H, W]`` array or mask image,
            per-instance masks not uint8/bool ``[N, H, W]``, keypoints not
            ``[N, K, 3]``, either without one entry per box).
    """
    parse_sample(sample, None, "index")
