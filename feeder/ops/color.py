"""Photometric transforms on uint8 [H, W, 3] RGB images: :class:`ColorJitter`, and
the per-image adjustments (torchvision's ``adjust_*``, ``posterize``, ``solarize``,
``autocontrast``, ``equalize``) that it and the automatic augmentation policies use.

Each adjustment follows torchvision's definition for uint8 tensors and runs as
OpenCV calls, which release the GIL, or a 256-entry lookup table wherever the map
is per value (StringZilla's SIMD byte translation when it is installed, as it is
with the albumentations extra; else cv2.LUT, same results). Where torchvision
truncates a blended value and OpenCV rounds (saturation, hue) the result may
differ by one level, two for sharpness (blended with a rounded 3x3 box mean); the
tests hold every adjustment to a numpy transcription of torchvision's formulas.
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np

from ..sample.rng import SampleRNG
from .base import Photometric, _into, check_number, check_range

try:  # optional: installed with albumentations (the albumentations extra)
    import stringzilla as _sz
except ImportError:  # pragma: no cover - cv2.LUT then, same results
    _sz = None


def _sz_has_out() -> bool:
    """Whether this StringZilla's translate writes into a given buffer (``out=``,
    in recent releases): one pass instead of a copy then an in-place pass."""
    if _sz is None:
        return False
    try:
        dst = bytearray(1)
        _sz.translate(memoryview(b"\x00"), memoryview(bytes(range(256))), out=memoryview(dst))
        return True
    except TypeError:  # pragma: no cover - older StringZilla: copy, then in place
        return False


_SZ_OUT = _sz_has_out()

_ARANGE = np.arange(256, dtype=np.float64)
# torchvision's rgb_to_grayscale weights.
_GRAY = (0.2989, 0.587, 0.114)


def _lut(img: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``table[img]`` through cv2.LUT: ``table`` is 256 values, or [256, 3] per channel."""
    t = np.clip(table, 0, 255).astype(np.uint8)  # astype truncates, as torchvision's .to(uint8)
    if t.ndim == 2:
        return cv2.LUT(img, np.ascontiguousarray(t.reshape(1, 256, 3)))
    if img.flags.c_contiguous:
        if _sz is not None:
            # StringZilla's byte translation (SIMD) is faster than cv2.LUT here,
            # though it holds the GIL while it runs (bench/experiments/aug_cost.py
            # times the ops: bench/results/aug_cost.txt).
            if _SZ_OUT:
                out = np.empty_like(img)
                _sz.translate(memoryview(img.reshape(-1)), memoryview(t), out=memoryview(out.reshape(-1)))
                return out
            out = img.copy()
            _sz.translate(memoryview(out.reshape(-1)), memoryview(t), inplace=True)
            return out
        # One table for every channel: a single-channel view of the same bytes is
        # faster through cv2.LUT than the three-channel image.
        return cv2.LUT(img.reshape(img.shape[0], -1), t).reshape(img.shape)
    return cv2.LUT(img, t)


def adjust_brightness(img: np.ndarray, factor: float) -> np.ndarray:
    """``img * factor``, clamped (torchvision's ``adjust_brightness``)."""
    return _lut(img, _ARANGE * factor)


def _gray_mean(img: np.ndarray) -> float:
    """The mean of the grayscale image: mean(gray) = gray(mean), from the
    per-channel sums (cv2.sumElems is faster than cv2.mean here)."""
    s = cv2.sumElems(img)
    return (_GRAY[0] * s[0] + _GRAY[1] * s[1] + _GRAY[2] * s[2]) / (img.shape[0] * img.shape[1])


def adjust_contrast(img: np.ndarray, factor: float) -> np.ndarray:
    """Blend with the mean of the grayscale image (torchvision's ``adjust_contrast``)."""
    # The blend with a constant is a per-value map: one lookup-table pass.
    return _lut(img, factor * _ARANGE + (1.0 - factor) * _gray_mean(img))


def _blend(img: np.ndarray, other: np.ndarray, factor: float) -> np.ndarray:
    # factor * img + (1 - factor) * other, saturated to uint8 (OpenCV rounds).
    return cv2.addWeighted(img, factor, other, 1.0 - factor, 0.0)


def adjust_saturation(img: np.ndarray, factor: float) -> np.ndarray:
    """Blend with the grayscale image (torchvision's ``adjust_saturation``)."""
    gray = cv2.cvtColor(cv2.cvtColor(img, cv2.COLOR_RGB2GRAY), cv2.COLOR_GRAY2RGB)
    return _blend(img, gray, factor)


def adjust_hue(img: np.ndarray, shift: float) -> np.ndarray:
    """Rotate the hue by ``shift`` turns, in [-0.5, 0.5] (torchvision's
    ``adjust_hue``: through float HSV, so no 8-bit hue quantization)."""
    if shift == 0.0:
        return img.copy()
    # OpenCV's float HSV is scale-free (V is the max, S and H ratios), so the
    # image goes in as 0..255 floats (one conversion pass, no scaling) and the
    # 1/255 is folded into the final conversion.
    hsv = cv2.cvtColor(img.astype(np.float32), cv2.COLOR_RGB2HSV)  # hue in degrees [0, 360)
    # OpenCV's HSV -> RGB wraps a hue in [360, 720) itself (not a negative one):
    # adding the shift taken in [0, 360) is enough. cv2.transform adds it in one
    # pass, faster than cv2.add of a 4-value scalar.
    m = np.array([[1, 0, 0, (shift * 360.0) % 360.0], [0, 1, 0, 0], [0, 0, 1, 0]], np.float32)
    rgb = cv2.cvtColor(cv2.transform(hsv, m), cv2.COLOR_HSV2RGB)
    # torchvision's float -> uint8: scale by 256 - eps and truncate; rounding
    # x * 255.999 - 0.5 is the same but at exact ties, and one pass of OpenCV.
    return cv2.convertScaleAbs(rgb, alpha=255.999 / 255.0, beta=-0.5)


def permute_channels(img: np.ndarray, permutation: Sequence[int]) -> np.ndarray:
    """``img[..., permutation]`` as a new contiguous image (torchvision's
    ``permute_channels``), through OpenCV: numpy's fancy indexing on the last
    axis is much slower."""
    p = list(permutation)
    if p == [0, 1, 2]:
        return img.copy()
    if p == [2, 1, 0]:
        return cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
    # A 0/1 matrix: each output channel is one input channel, exactly.
    return cv2.transform(img, np.eye(3, dtype=np.float32)[p])


def adjust_sharpness(img: np.ndarray, factor: float) -> np.ndarray:
    """Blend with a smoothed copy (torchvision's ``adjust_sharpness``: the 3x3 kernel
    [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13, the border pixels left as they are)."""
    H, W = img.shape[:2]
    if H <= 2 or W <= 2:
        return img.copy()
    # The kernel is (9 * box mean + 4 * centre) / 13, so the blend
    # factor * img + (1 - factor) * smooth is one weighted sum of the image and
    # its 3x3 box mean: two OpenCV passes, a third of filter2D's time.
    box = cv2.blur(img, (3, 3), borderType=cv2.BORDER_REPLICATE)
    w = (1.0 - factor) * 9.0 / 13.0
    out = cv2.addWeighted(img, 1.0 - w, box, w, 0.0)
    out[0], out[-1], out[:, 0], out[:, -1] = img[0], img[-1], img[:, 0], img[:, -1]
    return out


def posterize(img: np.ndarray, bits: int) -> np.ndarray:
    """Keep the ``bits`` high bits of every value (torchvision's ``posterize``)."""
    mask = (0xFF << (8 - bits)) & 0xFF
    return _lut(img, np.arange(256) & mask)


def solarize(img: np.ndarray, threshold: float) -> np.ndarray:
    """Invert every value ``>= threshold`` (torchvision's ``solarize``)."""
    return _lut(img, np.where(_ARANGE >= threshold, 255 - _ARANGE, _ARANGE))


def autocontrast(img: np.ndarray) -> np.ndarray:
    """Stretch each channel to [0, 255]; a constant channel is left as it is
    (torchvision's ``autocontrast``)."""
    # Per channel through OpenCV: numpy's min over the two leading axes of an
    # HWC image is an order of magnitude slower.
    ranges = [cv2.minMaxLoc(c)[:2] for c in cv2.split(img)]
    lo = np.array([r[0] for r in ranges])
    hi = np.array([r[1] for r in ranges])
    flat = hi == lo
    scale = np.where(flat, 1.0, 255.0 / np.where(flat, 1.0, hi - lo))
    lo = np.where(flat, 0.0, lo)
    return _lut(img, (_ARANGE[:, None] - lo) * scale)


def equalize(img: np.ndarray) -> np.ndarray:
    """Equalize each channel's histogram (torchvision's ``equalize``, which is PIL's)."""
    tables = np.empty((256, 3), np.int64)
    for c in range(3):
        hist = cv2.calcHist([img], [c], None, [256], [0, 256]).ravel().astype(np.int64)
        nonzero = hist[hist != 0]
        step = (int(nonzero.sum()) - int(nonzero[-1])) // 255 if nonzero.size else 0
        if step == 0:
            tables[:, c] = np.arange(256)
            continue
        lut = (np.cumsum(hist) + step // 2) // step
        tables[:, c] = np.concatenate(([0], lut[:-1]))
    return _lut(img, tables)


def _range(value: float | Sequence[float], name: str, center: float, low: float,
           high: float) -> tuple[float, float] | None:
    """torchvision's ColorJitter ``_check_input``: a number v gives [center - v, center + v]
    (clipped at ``low``), a pair is taken as is; (center, center) means off (None).
    Both must be finite (an infinite factor fails on every sample)."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        if not value >= 0:  # NaN too
            raise ValueError(f"ColorJitter: {name} must be non-negative, got {value!r}")
        v = check_number(value, name, "ColorJitter", 0.0)
        rng = (max(low, center - v), center + v)
        if not rng[1] <= high:
            raise ValueError(f"ColorJitter: {name}={value!r} gives the range {rng}, outside "
                             f"[{low}, {high}]")
    elif isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"ColorJitter: {name} must be a number or (min, max), got {value!r}")
    else:
        rng = check_range(value, name, "ColorJitter", low, high)
    return None if rng[0] == rng[1] == center else rng


class ColorJitter(Photometric):
    """Randomly change brightness, contrast, saturation and hue, in a random order
    (torchvision's ``ColorJitter``).

    Each factor is drawn uniformly per sample: brightness, contrast and saturation
    from ``[max(0, 1 - v), 1 + v]`` (or the (min, max) given), the hue shift from
    ``[-hue, hue]`` turns. The image keeps its size; a mask and boxes are untouched.

    Args:
        brightness: Amount (>= 0) or (min, max) factor range.
        contrast: As ``brightness``.
        saturation: As ``brightness``.
        hue: Amount in [0, 0.5] or (min, max) in [-0.5, 0.5].

    Raises:
        ValueError: a negative amount, a reversed or out-of-range pair.
    """

    preserves_size = True

    def __init__(self, brightness: float | Sequence[float] = 0, contrast: float | Sequence[float] = 0,
                 saturation: float | Sequence[float] = 0, hue: float | Sequence[float] = 0) -> None:
        inf = float("inf")
        self.brightness = _range(brightness, "brightness", 1.0, 0.0, inf)
        self.contrast = _range(contrast, "contrast", 1.0, 0.0, inf)
        self.saturation = _range(saturation, "saturation", 1.0, 0.0, inf)
        if isinstance(hue, (int, float)) and not isinstance(hue, bool) and hue > 0.5:
            raise ValueError(f"ColorJitter: hue must be in [0, 0.5], got {hue!r}")
        self.hue = _range(hue, "hue", 0.0, -0.5, 0.5)

    def params(self, rng: SampleRNG) -> list[tuple[int, float]]:
        """The (adjustment, factor) pairs for one sample, in the order applied:
        0 brightness, 1 contrast, 2 saturation, 3 hue; the ones left off skipped."""
        order = [0, 1, 2, 3]
        for i in range(3, 0, -1):  # Fisher-Yates: a uniform random order
            j = rng.integers(0, i + 1)
            order[i], order[j] = order[j], order[i]
        ranges = (self.brightness, self.contrast, self.saturation, self.hue)
        return [(k, rng.uniform(*ranges[k])) for k in order if ranges[k] is not None]

    def apply(self, img, rng, out=None, ctx=None):
        fns = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)
        for k, factor in self.params(rng):
            img = fns[k](img, factor)
        return _into(img, out)

    def __repr__(self) -> str:
        return (f"ColorJitter(brightness={self.brightness}, contrast={self.contrast}, "
                f"saturation={self.saturation}, hue={self.hue})")
