"""JPEG test files of every kind the region decoder handles (tests/decode/test_jpeg.py,
tests/decode/test_jpeg_hostile.py), and of the other coding processes (lossless,
12/16-bit: tests/data/jpeg_lossless)."""

from __future__ import annotations

import glob
import os
import pathlib

import cv2
import numpy as np

from tests.support import REPO_DIR, TESTS_DIR

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


#: JPEGs in the other coding processes (lossless, 12/16-bit), made
#: by tests/data/jpeg_lossless/make_jpegs.c (see the README there).
OTHER_PROCESSES = pathlib.Path(TESTS_DIR) / "data" / "jpeg_lossless"


def write_files(folder: str | os.PathLike, blobs: list[bytes]) -> list[str]:
    """Each blob as a file ``NNN.jpg`` in ``folder``, in order; their paths, as str."""
    paths = []
    for i, blob in enumerate(blobs):
        path = pathlib.Path(folder) / f"{i:03d}.jpg"
        path.write_bytes(blob)
        paths.append(str(path))
    return paths


def other_process(name: str) -> bytes:
    """The bytes of ``tests/data/jpeg_lossless/<name>``."""
    return (OTHER_PROCESSES / name).read_bytes()


def stored_scene(h: int, w: int, components: int) -> np.ndarray:
    """The 8-bit samples make_jpegs.c writes (its ``scene``, computed the same
    way in doubles): what a lossless file of that size stores, exactly."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    ramps = [x / w, y / h, (x + y) / (w + h)]
    planes = []
    for c in range(components):
        v = 0.15 + 0.6 * ramps[0 if c % 3 == 0 else c]
        v = np.where(((x // 9 + y // 7) % 5) == 0, v + 0.2, v)
        v = np.where((x > w // 2) & (y > h // 3), 0.9 - 0.5 * v, v)
        planes.append(np.minimum((v * 255 + 0.5).astype(np.int64), 255))
    return np.stack(planes, -1).astype(np.uint8)


def lossless_shown(name: str) -> np.ndarray:
    """The RGB a lossless test file shows, from the samples it stores exactly."""
    h, w = (6, 8) if name.endswith("8x6.jpg") else (45, 62)
    if "gray" in name:
        return np.repeat(stored_scene(h, w, 1), 3, axis=2)
    if "cmyk" in name:  # Adobe (inverted) ink, as every CMYK JPEG: R = C * K / 255
        ink = stored_scene(h, w, 4).astype(np.uint16)
        return ((ink[..., :3] * ink[..., 3:] + 127) // 255).astype(np.uint8)
    return stored_scene(h, w, 3)


#: The lossless files feeder decodes (8-bit RGB, gray and CMYK).
LOSSLESS = ["lossless_rgb.jpg", "lossless_rgb_8x6.jpg", "lossless_gray.jpg", "lossless_cmyk.jpg"]


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


def run_on_other_libjpeg(script: str) -> str:
    """Run ``script`` (``python -c``) with :func:`other_libjpeg` preloaded, its
    arguments the repository's folder and that library's file name; skip the calling
    test where none is installed. Returns its standard output (it must exit 0)."""
    import subprocess
    import sys

    import pytest

    other = other_libjpeg()
    if other is None:
        pytest.skip("no other libjpeg-turbo release (Pillow's bundled one) installed")
    proc = subprocess.run([sys.executable, "-c", script, REPO_DIR, os.path.basename(other)],
                          env={**os.environ, "LD_PRELOAD": other}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout
