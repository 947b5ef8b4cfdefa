"""feeder.decode.region: EXIF orientation read from every format that carries it,
applied to pixels (orient) and to boxes (orient_box), the TIFF patched to its
stored frame (stored_tiff), and the region decode of a stored JPEG (decode_region)."""

from __future__ import annotations

import struct
import types

import cv2
import numpy as np
import pytest
import simplejpeg

from feeder.ops import SampleContext
from feeder.synthetic import make_image
from feeder import decode as _decode
from feeder.decode.region import decode_region, orient, orient_box, orientation_of, stored_tiff

ext = _decode._jpeg
needs_ext = pytest.mark.skipif(ext is None, reason="the region decoder extension is not built")

ORIENTATIONS = range(1, 9)
IMG = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)


def shown(img: np.ndarray, orientation: int) -> np.ndarray:
    """What a viewer shows for EXIF ``orientation`` (numpy, independently of feeder)."""
    return {
        1: lambda a: a, 2: lambda a: a[:, ::-1], 3: lambda a: a[::-1, ::-1], 4: lambda a: a[::-1],
        5: lambda a: a.transpose(1, 0, 2), 6: lambda a: np.rot90(a, -1),
        7: lambda a: a[::-1, ::-1].transpose(1, 0, 2), 8: lambda a: np.rot90(a, 1),
    }[orientation](img)


def exif_tiff(orientation: int, order: str = "<", kind: int = 3, count: int = 1) -> bytes:
    bo = b"II" if order == "<" else b"MM"
    return (bo + struct.pack(order + "HIH", 42, 8, count)
            + struct.pack(order + "HHIHH", 0x0112, kind, 1, orientation, 0) + struct.pack(order + "I", 0))


def jpeg_with_exif(jpeg: bytes, tiff: bytes) -> bytes:
    payload = b"Exif\x00\x00" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def encode(img: np.ndarray, quality: int = 95) -> bytes:
    ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(img[..., ::-1]), [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return buf.tobytes()


@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_orient_shows_the_image(orientation):
    np.testing.assert_array_equal(orient(IMG, orientation), shown(IMG, orientation))


def test_orient_outside_1_to_8_leaves_pixels_alone():
    for bad in (0, 9, -1):
        assert orient(IMG, bad) is IMG


@pytest.mark.parametrize("orientation", ORIENTATIONS)
@pytest.mark.parametrize("box", [(0, 0, 5, 7), (1, 2, 3, 4), (4, 6, 1, 1), (0, 3, 2, 4)])
def test_orient_box_follows_the_pixels(orientation, box):
    t, l, bh, bw = box
    t2, l2, bh2, bw2 = orient_box(box, IMG.shape[:2], orientation)
    np.testing.assert_array_equal(shown(IMG, orientation)[t2:t2 + bh2, l2:l2 + bw2],
                                  shown(IMG[t:t + bh, l:l + bw], orientation))


@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_orient_box_round_trip(orientation):
    inverse = {6: 8, 8: 6}.get(orientation, orientation)
    box = (1, 2, 3, 4)
    there = orient_box(box, (5, 7), orientation)
    size = (7, 5) if orientation >= 5 else (5, 7)
    assert orient_box(there, size, inverse) == box


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_orientation_of_jpeg(orientation, order):
    plain = encode(IMG)
    assert orientation_of(None, plain) == 1
    data = jpeg_with_exif(plain, exif_tiff(orientation, order))
    assert orientation_of(None, data) == orientation
    assert orientation_of(None, memoryview(data)) == orientation


@pytest.mark.parametrize("tiff", [
    exif_tiff(9), exif_tiff(0), exif_tiff(6, kind=4), b"XX" + exif_tiff(6)[2:],
    exif_tiff(6)[:2] + struct.pack("<H", 41) + exif_tiff(6)[4:],  # not TIFF's magic 42
    exif_tiff(6)[:12],  # cut inside the entry
    b"",
])
def test_broken_exif_reads_as_1(tiff):
    assert orientation_of(None, jpeg_with_exif(encode(IMG), tiff)) == 1


def test_an_ifd_count_past_the_data_is_read_no_further():
    # The tag is found where it is; a count that runs past the data ends the read, not an error.
    assert orientation_of(None, jpeg_with_exif(encode(IMG), exif_tiff(6, count=60000))) == 6
    other = bytearray(exif_tiff(6, count=60000))
    other[10:12] = struct.pack("<H", 0x010F)  # the one entry is Make, not Orientation
    assert orientation_of(None, jpeg_with_exif(encode(IMG), bytes(other))) == 1


def test_jpeg_exif_after_the_scan_is_not_read():
    plain = encode(IMG)
    assert orientation_of(None, plain + jpeg_with_exif(b"\xff\xd8", exif_tiff(6))[2:]) == 1


def _png_with_exif(png: bytes, tiff: bytes) -> bytes:
    import zlib
    chunk = struct.pack(">I", len(tiff)) + b"eXIf" + tiff + struct.pack(">I", zlib.crc32(b"eXIf" + tiff))
    return png[:33] + chunk + png[33:]


def _webp_with_exif(tiff: bytes) -> bytes:
    chunk = b"EXIF" + struct.pack("<I", len(tiff)) + tiff + (b"\0" if len(tiff) & 1 else b"")
    vp8x = b"VP8X" + struct.pack("<I", 10) + bytes(10)
    body = b"WEBP" + vp8x + chunk
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_orientation_of_png_webp_tiff_and_others():
    ok, png = cv2.imencode(".png", IMG)
    png = png.tobytes()
    header = types.SimpleNamespace
    assert orientation_of(header(format="PNG"), _png_with_exif(png, exif_tiff(7))) == 7
    assert orientation_of(header(format="PNG"), png) == 1
    webp = header(format="WebP")
    assert orientation_of(webp, _webp_with_exif(exif_tiff(5))) == 5
    assert orientation_of(webp, _webp_with_exif(b"Exif\x00\x00" + exif_tiff(3, ">"))) == 3
    data = b"pad" + struct.pack(">H", 8)
    tiff = header(format="TIFF", tiff_orientation_at=3, tiff_order=">")
    assert orientation_of(tiff, data) == 8
    assert orientation_of(tiff, b"pad" + struct.pack(">H", 12)) == 1  # out of range
    assert orientation_of(header(format="TIFF", tiff_orientation_at=None, tiff_order="<"), data) == 1
    assert orientation_of(header(format="BMP"), data) == 1


def test_stored_tiff_sets_orientation_to_1():
    header = types.SimpleNamespace(format="TIFF", tiff_orientation_at=4, tiff_order="<")
    data = b"II*\x00" + struct.pack("<H", 6) + b"rest"
    patched = stored_tiff(data, header)
    assert bytes(patched) == b"II*\x00" + struct.pack("<H", 1) + b"rest"
    assert data[4:6] == struct.pack("<H", 6)  # a copy: the input is left as it was
    plain = b"II*\x00" + struct.pack("<H", 1) + b"rest"
    assert stored_tiff(plain, header) is plain
    header.tiff_orientation_at = None
    assert stored_tiff(data, header) is data


class Pool:
    def __init__(self):
        self.taken, self.given = [], []

    def take(self, nbytes):
        self.taken.append(np.empty(nbytes, np.uint8))
        return self.taken[-1]

    def give(self, buf):
        self.given.append(buf)


STORED = make_image(120, 160, 3)
DATA = encode(STORED, 90)
FULL = simplejpeg.decode_jpeg(DATA, colorspace="RGB")


def _ctx(box, size=(120, 160)):
    ctx = SampleContext(size)
    ctx.box = box
    return ctx


@needs_ext
@pytest.mark.parametrize("box", [(0, 0, 120, 160), (17, 33, 40, 51), (100, 150, 20, 10)])
def test_decode_region_full_scale_is_the_crop(box):
    t, l, bh, bw = box
    ctx = _ctx(box)
    pool = Pool()
    img, _ = decode_region(ext, DATA, 120, 160, None, ctx, 1, 1 << 30, pool)
    np.testing.assert_array_equal(img, FULL[t:t + bh, l:l + bw])
    assert ctx.origin == (t, l) and ctx.scaled_size == (120, 160) and ctx.scale == 1.0
    assert len(pool.taken) == 1 and pool.given == []  # the image is the pool buffer's, lent out


@needs_ext
def test_decode_region_reduced_scale_covers_the_box_with_a_margin():
    ctx = _ctx((40, 48, 40, 64))
    img, _ = decode_region(ext, DATA, 120, 160, (30, 40), ctx, 1, 1 << 30, None)
    assert ctx.scale == 0.25 and ctx.scaled_size == (30, 40)
    y0, x0 = ctx.origin
    quarter = simplejpeg.decode_jpeg(DATA, colorspace="RGB", min_height=30, min_width=40)
    np.testing.assert_array_equal(img, quarter[y0:y0 + img.shape[0], x0:x0 + img.shape[1]])
    # One scaled pixel of margin (two, rounded) each side of the box's 10..20 x 12..28.
    assert (y0, x0) == (8, 10) and img.shape[:2] == (14, 20)


@needs_ext
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_decode_region_in_the_shown_frame(orientation):
    view = shown(FULL, orientation)
    h, w = view.shape[:2]
    box = (11, 5, h // 2, w // 3)
    t, l, bh, bw = box
    pool = Pool()
    ctx = _ctx(box, (h, w))
    img, _ = decode_region(ext, DATA, 120, 160, None, ctx, orientation, 1 << 30, pool)
    np.testing.assert_array_equal(img, view[t:t + bh, l:l + bw])
    assert ctx.origin == (t, l) and ctx.scaled_size == (h, w)
    assert pool.given == pool.taken  # oriented: a new array, the buffer went back


@needs_ext
def test_decode_region_error_gives_the_buffer_back():
    pool = Pool()
    with pytest.raises(Exception):
        decode_region(ext, DATA[:len(DATA) // 3], 120, 160, None, _ctx((90, 0, 30, 160)), 1, 1 << 30, pool)
    assert len(pool.taken) == 1 and pool.given == pool.taken
