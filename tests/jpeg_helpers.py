"""JPEG test files of every kind the region decoder handles (tests/test_jpeg.py,
tests/test_jpeg_hostile.py)."""

from __future__ import annotations

import glob
import os

import cv2
import numpy as np

SUBSAMPLING = {"4:4:4": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444, "4:2:2": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422,
               "4:2:0": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420, "4:4:0": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_440,
               "4:1:1": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_411}
KINDS = [*SUBSAMPLING, "gray", "progressive", "restart"]


def jpeg(img: np.ndarray, kind: str = "4:2:0", quality: int = 90, rst: int = 3) -> bytes:
    """A JPEG of RGB ``img``: ``kind`` a subsampling, ``gray``, ``progressive`` or
    ``restart`` (4:2:0 with a restart marker every ``rst`` MCUs)."""
    params = [cv2.IMWRITE_JPEG_QUALITY, quality]
    if kind in SUBSAMPLING:
        params += [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, SUBSAMPLING[kind]]
    elif kind == "progressive":
        params += [cv2.IMWRITE_JPEG_PROGRESSIVE, 1]
    elif kind == "restart":
        params += [cv2.IMWRITE_JPEG_RST_INTERVAL, rst]
    src = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY) if kind == "gray" else img[..., ::-1]
    ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(src), params)
    assert ok
    return buf.tobytes()


def other_libjpeg() -> str | None:
    """A libjpeg-turbo of the same soname as the system's but another release:
    the one Pillow's wheels bundle (3.x), if installed (to preload under the
    extension in a subprocess)."""
    try:
        import PIL
    except ImportError:
        return None
    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(PIL.__file__)),
                                          "pillow.libs", "libjpeg-*.so.62*")))
    return found[0] if found else None
