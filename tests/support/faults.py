"""Helpers shared by the test files: bad-file makers, content hashes of
delivered samples, polling under a deadline, a gate that holds pipeline threads
in user code, Feeder factories with a file's defaults, RSS, and subprocess
plumbing for the signal and interpreter-exit tests.

Samples are identified by a hash of their pixels, never only by their label:
a label survives a swapped or duplicated image, a pixel hash does not.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import inspect
import io
import os
import queue
import struct
import subprocess
import sys
import threading
import time

import cv2
import numpy as np
import simplejpeg

from feeder import Feeder
from feeder.synthetic import make_image
from tests.support import (REPO_DIR, encode_jpeg, encode_png, feeder_threads,  # noqa: F401 - re-exported
                           wait_no_feeder_threads)


# Every image of the suite is exactly SIDE x SIDE, and the feeders run
# CenterCrop(SIDE): the crop is then the identity, so a delivered sample's
# pixels are exactly its decoded pixels and can be hashed against a reference
# decoded independently of the engine.
SIDE = 32


# -- content hashes -------------------------------------------------------------------

def pixel_hash(img: np.ndarray) -> str:
    """Hash of an HWC uint8 image."""
    img = np.ascontiguousarray(img)
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3, (img.dtype, img.shape)
    return hashlib.sha1(img.tobytes()).hexdigest()


def delivered_hashes(batches) -> list[str]:
    """Pixel hashes of every delivered sample, from drain()'s [B,3,H,W] numpy batches."""
    return [pixel_hash(x[i].transpose(1, 2, 0)) for x, _ in batches for i in range(x.shape[0])]


def reference_hash(blob: bytes) -> str:
    """Hash of ``blob`` decoded without the engine (simplejpeg for JPEG, cv2 otherwise)."""
    if blob[:3] == b"\xff\xd8\xff":
        img = simplejpeg.decode_jpeg(blob, colorspace="RGB")
    else:
        img = cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_COLOR)[..., ::-1]
    return pixel_hash(img)


def distinct_jpegs(n: int, seed: int = 0, side: int = SIDE, quality: int = 90) -> list[bytes]:
    """``n`` JPEGs of ``side`` x ``side`` whose decoded pixels all differ."""
    blobs = [encode_jpeg(make_image(side, side, seed=seed + i), quality) for i in range(n)]
    hashes = [reference_hash(b) for b in blobs]
    assert len(set(hashes)) == n, "generated images must be distinguishable by content"
    return blobs


def assert_exactly_once(got: list[str], expected: list[str]) -> None:
    """Every expected hash delivered exactly once, and nothing else."""
    got_c, exp_c = collections.Counter(got), collections.Counter(expected)
    dup = {h: n for h, n in got_c.items() if n > 1}
    missing = exp_c - got_c
    extra = got_c - exp_c
    assert not dup and not missing and not extra, (
        f"exactly-once violated: {len(dup)} duplicated, {sum(missing.values())} missing, "
        f"{sum(extra.values())} unexpected samples")


def batch_sizes(batches) -> list[int]:
    return [len(y) for _, y in batches]


def expected_sizes(n: int, batch_size: int, drop_last: bool) -> list[int]:
    full, rest = divmod(n, batch_size)
    return [batch_size] * full + ([rest] if rest and not drop_last else [])


# -- bad and unusual files --------------------------------------------------------------

def jpeg_segments(data: bytes):
    """(marker, offset) of each JPEG segment up to the start of scan."""
    i = 2
    while i + 4 <= len(data):
        assert data[i] == 0xFF, f"no marker at {i}"
        marker = data[i + 1]
        yield marker, i
        if marker == 0xDA:
            return
        i += 2 + struct.unpack(">H", data[i + 2:i + 4])[0]


def jpeg_with_size(data: bytes, height: int, width: int) -> bytes:
    """The JPEG with its SOF header claiming ``height`` x ``width`` (a decompression bomb)."""
    for marker, i in jpeg_segments(data):
        if marker in (0xC0, 0xC1, 0xC2):
            return data[:i + 5] + struct.pack(">HH", height, width) + data[i + 9:]
    raise ValueError("no SOF segment")


def png_with_size(data: bytes, height: int, width: int) -> bytes:
    """The PNG with its IHDR claiming ``height`` x ``width`` (CRC left stale)."""
    assert data[12:16] == b"IHDR"
    return data[:16] + struct.pack(">II", width, height) + data[24:]


def ppm_header(height: int, width: int, payload: int = 64) -> bytes:
    """A binary PPM whose header claims ``height`` x ``width`` followed by a few bytes."""
    return f"P6\n{width} {height}\n255\n".encode() + b"\x80" * payload


def tiff_header(height: int, width: int) -> bytes:
    """A minimal little-endian grayscale TIFF claiming ``height`` x ``width`` (16 data bytes)."""
    entries = [(256, 4, width), (257, 4, height), (258, 3, 8), (259, 3, 1), (262, 3, 1),
               (273, 4, 8), (277, 3, 1), (278, 4, height), (279, 4, 16)]
    ifd = struct.pack("<H", len(entries))
    for tag, typ, value in entries:
        if typ == 4:
            ifd += struct.pack("<HHII", tag, typ, 1, value)
        else:
            ifd += struct.pack("<HHIHH", tag, typ, 1, value, 0)
    ifd += struct.pack("<I", 0)
    return b"II*\x00" + struct.pack("<I", 24) + b"\x00" * 16 + ifd


def random_bytes(n: int, seed: int, prefix: bytes = b"") -> bytes:
    return prefix + np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def smooth_rgb(seed: int, side: int = SIDE) -> np.ndarray:
    """A smooth RGB image (lossy codecs reproduce it closely), values kept in [16, 239]."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
    img = np.empty((side, side, 3), np.float32)
    for c in range(3):
        a, b, p = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0), rng.uniform(0, 6.3)
        img[..., c] = 128 + 100 * np.sin(a * x * np.pi + b * y * np.pi + p) * (0.5 + 0.5 * c / 2)
    return np.clip(img, 16, 239).astype(np.uint8)


def pil_jpeg(img: np.ndarray, mode: str, quality: int = 95) -> bytes:
    """A JPEG written by Pillow in ``mode`` ("CMYK": Adobe's inverted CMYK). Pillow is optional:
    callers skip when it is missing."""
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(img).convert(mode).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def cmyk_jpeg(cmyk: np.ndarray, quality: int = 95) -> bytes:
    """A 4-channel JPEG from libjpeg-turbo (stored as YCCK with an Adobe marker)."""
    return simplejpeg.encode_jpeg(np.ascontiguousarray(cmyk), quality=quality, colorspace="CMYK")


def cmyk_to_rgb_reference(data: bytes) -> np.ndarray:
    """The RGB of an Adobe (inverted) CMYK/YCCK JPEG, from its raw CMYK samples: R = C*K/255
    (the naive conversion browsers and OpenCV use; Adobe JPEGs store inverted ink values)."""
    raw = simplejpeg.decode_jpeg(data, colorspace="CMYK").astype(np.float64)
    rgb = raw[..., :3] * raw[..., 3:4] / 255.0
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)


def progressive_jpeg(img: np.ndarray, quality: int = 95) -> bytes:
    ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(img[..., ::-1]),
                           [cv2.IMWRITE_JPEG_QUALITY, quality, cv2.IMWRITE_JPEG_PROGRESSIVE, 1])
    assert ok
    return buf.tobytes()


def raw_png(rows: np.ndarray, color_type: int, bit_depth: int = 8, palette: bytes | None = None) -> bytes:
    """A PNG written by hand (any colour type cv2 cannot write: palette, gray+alpha, 1-bit).

    ``rows``: uint8 [H, row_bytes], already packed to ``bit_depth``; filter 0 on every row."""
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    h = rows.shape[0]
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color_type]
    w = rows.shape[1] * 8 // (bit_depth * channels)
    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 0)
    raw = b"".join(b"\x00" + rows[y].tobytes() for y in range(h))
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
    if palette is not None:
        out += chunk(b"PLTE", palette)
    return out + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def gray_jpeg(gray: np.ndarray, quality: int = 95) -> bytes:
    return simplejpeg.encode_jpeg(np.ascontiguousarray(gray[..., None]), quality=quality,
                                  colorspace="GRAY")


def png16(img16: np.ndarray) -> bytes:
    return encode_png(img16)


# -- waiting without sleeping for threads to "run" -----------------------------------

def wait_until(predicate, timeout: float = 10.0, interval: float = 0.005) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds; return its last value.

    This waits for a *condition* under a deadline (the guide's rule is against
    sleeping in the hope that threads have run by then)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return bool(value)
        time.sleep(interval)


def wait_feeder_threads_within(allowed, timeout: float = 2.0) -> set[str]:
    """Wait until every live feeder thread's name is in ``allowed``; return the live names."""
    allowed = set(allowed)
    wait_until(lambda: {t.name for t in feeder_threads()} <= allowed, timeout)
    return {t.name for t in feeder_threads()}


def stage_waiting(run, stage_name: str, kind: int) -> bool:
    """Every thread of ``stage_name`` in pass ``run`` is blocked in a queue wait of ``kind``
    (1: for input, 2: to output or for a free buffer)."""
    stage = next(s for s in run.stages if s.name == stage_name)
    return bool(stage.counters) and all(c.waiting == kind for c in stage.counters)


class Gate:
    """Blocks every caller until released: a transform (``gate(img, rng) -> img``) or,
    through :meth:`block`, a step of a source's ``read``.

    ``entered`` is set by the first caller, ``callers`` holds the names of the
    threads that came in, and ``release`` lets them all through.

    Args:
        timeout: Longest wait of a caller for ``release``, in seconds.
        fail_on_timeout: Raise AssertionError when the wait runs out (the caller
            then fails as the user's code would); otherwise return normally.
    """

    def __init__(self, timeout: float = 30.0, fail_on_timeout: bool = True):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.timeout = timeout
        self.fail_on_timeout = fail_on_timeout
        self._callers: set[str] = set()
        self._lock = threading.Lock()

    @property
    def callers(self) -> frozenset[str]:
        """A snapshot: the set grows from pipeline threads while the test reads it."""
        with self._lock:
            return frozenset(self._callers)

    def block(self) -> None:
        with self._lock:
            self._callers.add(threading.current_thread().name)
        self.entered.set()
        released = self.release.wait(self.timeout)
        assert released or not self.fail_on_timeout, "gate never released"

    def __call__(self, img, rng):
        self.block()
        return img


# -- feeders with a test file's defaults ------------------------------------------------

def feeder_factory(batch_size: int, transforms=(), wrap=None, **defaults):
    """A ``make(source, transforms=None, **options) -> Feeder`` with a test file's defaults.

    Args:
        batch_size: Batch size unless a call passes ``batch_size``.
        transforms: Transforms of a call that passes none (or None); a function
            is called for a fresh list for each feeder.
        wrap: Applied to each call's ``source`` (e.g. MemorySource, for calls that
            pass a list of blobs).
        **defaults: Feeder options unless a call passes them.
    """
    default_transforms = transforms

    def make(source, transforms=None, **options) -> Feeder:
        options = {**defaults, **options}
        chosen = default_transforms if transforms is None else transforms
        return Feeder(wrap(source) if wrap is not None else source,
                      options.pop("batch_size", batch_size),
                      chosen() if inspect.isfunction(chosen) else chosen, **options)
    return make


# -- memory ------------------------------------------------------------------------------

def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def rss_mb() -> float:
    """Resident set size of this process in MiB, from /proc/self/status (VmRSS).

    glibc first gives back the free memory its per-thread arenas keep (malloc_trim):
    how much of it they keep depends on how threads happened to interleave on a
    loaded machine, and it is not memory anyone holds, so a leak bound must not
    count it."""
    if _TRIM is not None:
        _TRIM(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


# -- subprocesses -------------------------------------------------------------------------

CHILD_PRELUDE = f"""
import json, os, sys, threading, time
sys.path.insert(0, {REPO_DIR!r})
import numpy as np, simplejpeg
from feeder import Feeder, ops
from feeder.synthetic import make_image
from feeder.testing import pass_of, start_pass

class Mem:
    def __init__(self, blobs): self.blobs = blobs
    def __len__(self): return len(self.blobs)
    def read(self, i): return self.blobs[i], i

BLOBS = [simplejpeg.encode_jpeg(make_image(32, 32, seed=i), 90) for i in range(64)]

def live_feeder_threads(timeout, allowed=()):
    deadline = time.monotonic() + timeout
    while True:
        alive = [t for t in threading.enumerate()
                 if t.name.startswith("feeder-") and t.name != "feeder-reaper"]
        if {{t.name for t in alive}} <= set(allowed) or time.monotonic() >= deadline:
            return sorted(t.name for t in alive)
        for t in alive:
            t.join(0.02)

def say(**kw):
    print(json.dumps(kw), flush=True)
"""


class Child:
    """A Python subprocess whose stdout lines are read with a timeout."""

    def __init__(self, code: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + code],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env, cwd=REPO_DIR)
        self._lines: "queue.Queue[str | None]" = queue.Queue()
        self._err: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put),
                         name="test-child-out", daemon=True).start()
        self._err_thread = threading.Thread(target=self._pump, args=(self.proc.stderr, self._err.append),
                                            name="test-child-err", daemon=True)
        self._err_thread.start()

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line)
        sink(None)

    def expect_line(self, timeout: float) -> str:
        """The next stdout line; fails if none comes within ``timeout`` s."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"child printed nothing within {timeout} s; stderr:\n{self.stderr}")
        if line is None:
            self.proc.wait(5)
            raise AssertionError(f"child exited (rc={self.proc.returncode}) before printing; "
                                 f"stderr:\n{self.stderr}")
        return line.strip()

    def wait(self, timeout: float) -> int:
        """Wait for exit; fails (and kills the child) if it has not exited within ``timeout`` s."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"child did not exit within {timeout} s (hang); stderr:\n{self.stderr}")
        self._err_thread.join(5)
        return rc

    def rest_of_stdout(self) -> list[str]:
        out = []
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                return out
            if line is None:
                return out
            out.append(line.strip())

    @property
    def stderr(self) -> str:
        return "".join(x for x in self._err if x)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def consume_in_thread(f):
    """Start next() in a thread on a fresh pass of feeder ``f`` (or on ``f`` itself when it
    is a pass's iterator); returns (thread, result list)."""
    it = iter(f)
    result: list = []

    def run():
        try:
            next(it)
            result.append("batch")
        except StopIteration:
            result.append("stop")
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    t = threading.Thread(target=run, name="test-consumer", daemon=True)
    t.start()
    return t, result
