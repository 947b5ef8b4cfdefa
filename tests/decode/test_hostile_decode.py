"""Hostile input to the decoder: formats whose size cannot be checked before
decoding, headers that lie or break off, EXIF orientation tags, and file
names that are not valid UTF-8.

* Only formats whose size is read from the header are decoded; the rest are
  refused with a :class:`DecodeError` naming the format, before any decoder runs.
* A header that cannot be read is refused as corrupt, never decoded unchecked.
* EXIF orientation is ignored by default for every format (stored pixels), and
  applied the same way for every format with ``exif_orientation=True``.
* Error messages and log lines about a badly named file always encode as UTF-8.
"""

from __future__ import annotations

import io
import logging
import os
import struct
import zlib

import cv2
import numpy as np
import pytest
import simplejpeg

import feeder.decode as decode_mod
from tests.support import MemorySource, drain, encode_jpeg, encode_png
from tests.support.faults import cmyk_jpeg, distinct_jpegs, smooth_rgb, tiff_header
from tests.support.jpeg import LOSSLESS, lossless_shown, other_process
from feeder import DecodeError, Feeder, FileList, ImageFolder, SampleError, ops
from feeder.engine.config import DEFAULTS, Config
from feeder.decode import SUPPORTED_FORMATS, decode_image, header_size


@pytest.fixture
def no_pixel_decode(monkeypatch):
    """Fail the test if any decoder is asked for pixels: rejection must come from the header."""
    def forbidden(*args, **kwargs):
        raise AssertionError("pixel decode attempted")

    monkeypatch.setattr(decode_mod.cv2, "imdecode", forbidden)
    monkeypatch.setattr(decode_mod.simplejpeg, "decode_jpeg", forbidden)


def cv2_encode(ext: str, img: np.ndarray) -> bytes | None:
    try:
        ok, buf = cv2.imencode(ext, img)
    except cv2.error:
        return None
    return buf.tobytes() if ok else None


# -- formats outside the allow-list ------------------------------------------------------

def _refused_files() -> dict[str, tuple[bytes, str]]:
    img = np.full((10, 20, 3), 128, np.uint8)
    rows = {
        # name: (bytes, format name the error must give)
        "jpeg2000-codestream": (b"\xff\x4f\xff\x51" + bytes(60), "JPEG 2000"),
        "jpeg2000-jp2": (b"\x00\x00\x00\x0cjP  \r\n\x87\n" + bytes(60), "JPEG 2000"),
        "openexr": (b"\x76\x2f\x31\x01" + bytes(60), "OpenEXR"),
        "pam-by-hand": (b"P7\nWIDTH 20000\nHEIGHT 20000\nDEPTH 3\nMAXVAL 255\n"
                        b"TUPLTYPE RGB\nENDHDR\n" + bytes(64), "PAM"),
    }
    for ext, name in ((".hdr", "Radiance HDR"), (".pfm", "PFM"), (".ras", "Sun raster"),
                      (".sr", "Sun raster"), (".pam", "PAM"), (".avif", "AVIF")):
        data = cv2_encode(ext, img.astype(np.float32) / 255 if ext in (".hdr", ".pfm") else img)
        if data is not None:  # cv2 builds differ in the writers they have
            rows[f"cv2{ext}"] = (data, name)
    return rows


REFUSED = _refused_files()


@pytest.mark.parametrize("row", sorted(REFUSED))
def test_unsupported_format_refused_before_decoding(row, no_pixel_decode):
    data, name = REFUSED[row]
    with pytest.raises(DecodeError, match="not supported") as info:
        decode_image(data)
    msg = str(info.value)
    assert name in msg
    assert all(f in msg for f in SUPPORTED_FORMATS), msg


@pytest.mark.parametrize("ext", [".hdr", ".pfm", ".ras", ".pam"])
def test_real_file_of_refused_format_is_not_decoded(ext):
    """A small, valid file OpenCV can decode is still refused: its size was not checked."""
    data = REFUSED[f"cv2{ext}"][0]
    assert cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED) is not None
    with pytest.raises(DecodeError, match="not supported"):
        decode_image(data)


def test_radiance_hdr_claiming_17000x17000_refused(no_pixel_decode):
    data = b"#?RADIANCE\nFORMAT=32-bit_rle_rgbe\n\n-Y 17000 +X 17000\n" + b"\x02\x02\x42\x68" * 256
    with pytest.raises(DecodeError, match="Radiance HDR images are not supported"):
        decode_image(data)


def test_unrecognised_bytes_list_the_accepted_formats():
    with pytest.raises(DecodeError, match="not a decodable image") as info:
        decode_image(b"\x00\x01\x02\x03 not any image format " * 4)
    assert all(f in str(info.value) for f in SUPPORTED_FORMATS)


def test_refused_format_named_jpg_through_feeder():
    """Contents are sniffed, so a .hdr renamed .jpg is refused, naming file and format."""
    good = distinct_jpegs(3, seed=11)
    hdr = REFUSED["cv2.hdr"][0]
    src = MemorySource([good[0], hdr, good[1], good[2]], names=["a.jpg", "photo.jpg", "c.jpg", "d.jpg"])
    with Feeder(src, 2, [ops.CenterCrop(32)], shuffle=False) as f:
        batches, err = drain(f, timeout=20)
    assert isinstance(err, SampleError) and err.index == 1 and err.stage == "decode"
    assert "photo.jpg" in str(err) and "Radiance HDR" in str(err)
    with Feeder(src, 2, [ops.CenterCrop(32)], shuffle=False, on_error="skip") as f:
        batches, err = drain(f, timeout=20)
        assert err is None and f.stats().skipped_paths == ("photo.jpg",)
    assert sum(len(y) for _, y in batches) == 3


# -- every accepted format: size from the header ------------------------------------------

def bgr(img: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(img[..., ::-1])


def tiff_image(img: np.ndarray, orientation: int | None = None, order: str = "<",
               big: bool = False, filler: int = 0) -> bytes:
    """An uncompressed TIFF (or BigTIFF) of a gray or RGB uint8 image.

    ``orientation``: an Orientation tag (274); ``filler``: that many extra private
    tags before the image's own (an unsorted, oversized but readable IFD)."""
    h, w = img.shape[:2]
    spp = 1 if img.ndim == 2 else img.shape[2]
    pixels = np.ascontiguousarray(img).tobytes()
    entries = [(256, 4, 1, w), (257, 4, 1, h), (258, 3, 1, 8), (259, 3, 1, 1),
               (262, 3, 1, 1 if spp == 1 else 2), (273, 4, 1, -1), (277, 3, 1, spp),
               (278, 4, 1, h), (279, 4, 1, len(pixels))]
    if orientation is not None:
        entries.append((274, 3, 1, orientation))
    entries.sort()
    entries = [(65000 - k, 3, 1, 0) for k in range(filler)] + entries
    if spp > 1:  # BitsPerSample per channel: more than fits in the entry, stored after the IFD
        entries[[e[0] for e in entries].index(258)] = (258, 3, spp, -2)
    n = len(entries)
    entry_size, count_fmt, head_size = (20, "Q", 16) if big else (12, "H", 8)
    ifd_end = head_size + struct.calcsize(count_fmt) + entry_size * n + (8 if big else 4)
    bps = struct.pack(order + "H" * spp, *([8] * spp)) if spp > 1 else b""
    data_at = ifd_end + (0 if big else len(bps))
    table = struct.pack(order + count_fmt, n)
    for tag, typ, count, value in entries:
        if value == -2 and big:  # three SHORTs fit in a BigTIFF entry's 8 bytes
            field = bps.ljust(8, b"\x00")
        else:  # one SHORT or LONG, or an offset: left-justified in the value field
            value = {-1: data_at, -2: ifd_end}.get(value, value)
            fmt = "H" if typ == 3 and count == 1 else "I"
            field = struct.pack(order + fmt, value).ljust(8 if big else 4, b"\x00")
        table += struct.pack(order + ("HHQ" if big else "HHI"), tag, typ, count) + field
    table += bytes(8 if big else 4)
    bo = b"II" if order == "<" else b"MM"
    head = bo + (struct.pack(order + "HHHQ", 43, 8, 0, head_size) if big
                 else struct.pack(order + "HI", 42, head_size))
    return head + table + (b"" if big else bps) + pixels


def bmp_top_down(img: np.ndarray) -> bytes:
    """A BMP with a negative height: rows stored top first."""
    data = bytearray(cv2_encode(".bmp", bgr(img)))
    (h,) = struct.unpack("<i", data[22:26])
    data[22:26] = struct.pack("<i", -h)
    return bytes(data)


def webp_extended(img: np.ndarray, exif: bytes | None = None) -> bytes:
    """A lossless WebP in the extended (VP8X) container, with an optional EXIF chunk."""
    simple = cv2.imencode(".webp", bgr(img), [cv2.IMWRITE_WEBP_QUALITY, 101])[1].tobytes()
    assert simple[12:16] == b"VP8L"
    h, w = img.shape[:2]
    flags = 0x08 if exif is not None else 0
    vp8x = struct.pack("<I", flags) + (w - 1).to_bytes(3, "little") + (h - 1).to_bytes(3, "little")
    body = b"WEBP" + b"VP8X" + struct.pack("<I", 10) + vp8x + simple[12:]
    if exif is not None:
        body += b"EXIF" + struct.pack("<I", len(exif)) + exif + (b"\x00" if len(exif) & 1 else b"")
    return b"RIFF" + struct.pack("<I", len(body)) + body


def pnm_with_comments(img: np.ndarray) -> bytes:
    h, w = img.shape[:2]
    return (f"P6\n# made by hand\n{w} # width\n# a comment between\n{h}\n255\n".encode()
            + np.ascontiguousarray(img).tobytes())


RGB = smooth_rgb(5)[:24]  # 24 x 32: not square, so a swapped axis shows


def _accepted_files() -> dict[str, tuple[bytes, np.ndarray, int]]:
    """name: (file, expected pixels, max abs error)."""
    return {
        "png": (encode_png(RGB), RGB, 0),
        "bmp": (cv2_encode(".bmp", bgr(RGB)), RGB, 0),
        "bmp-top-down": (bmp_top_down(RGB), RGB[::-1], 0),
        "gif": (cv2_encode(".gif", bgr(RGB)), RGB, 255),  # palette: only the size is checked
        "webp-lossless": (cv2.imencode(".webp", bgr(RGB), [cv2.IMWRITE_WEBP_QUALITY, 101])[1].tobytes(),
                          RGB, 0),
        "webp-lossy": (cv2.imencode(".webp", bgr(RGB), [cv2.IMWRITE_WEBP_QUALITY, 90])[1].tobytes(),
                       RGB, 40),
        "webp-extended": (webp_extended(RGB), RGB, 0),
        "ppm": (cv2_encode(".ppm", bgr(RGB)), RGB, 0),
        "ppm-comments": (pnm_with_comments(RGB), RGB, 0),
        "pgm": (cv2_encode(".pgm", RGB[..., 1].copy()), np.repeat(RGB[..., 1:2], 3, 2), 0),
        "tiff-cv2": (cv2_encode(".tiff", bgr(RGB)), RGB, 0),
        "tiff-big-endian": (tiff_image(RGB, order=">"), RGB, 0),
        "tiff-700-entries": (tiff_image(RGB, filler=700), RGB, 0),
        "bigtiff": (tiff_image(RGB, big=True), RGB, 0),
        "bigtiff-gray-big-endian": (tiff_image(RGB[..., 0].copy(), big=True, order=">"),
                                    np.repeat(RGB[..., :1], 3, 2), 0),
        "jpeg": (encode_jpeg(RGB, 95), RGB, 40),
    }


ACCEPTED = _accepted_files()


@pytest.mark.parametrize("row", sorted(ACCEPTED))
def test_accepted_format_decodes(row):
    data, expected, max_abs = ACCEPTED[row]
    img, size = decode_image(data)
    assert size == (24, 32) and img.shape == (24, 32, 3) and img.dtype == np.uint8
    assert np.abs(img.astype(int) - expected.astype(int)).max() <= max_abs


@pytest.mark.parametrize("row", sorted(ACCEPTED))
def test_accepted_format_size_checked_from_header(row, no_pixel_decode):
    """One pixel less than the image: refused from the header alone."""
    with pytest.raises(DecodeError, match=r"\(24, 32\) \(height, width\) = 768 pixels exceeds max_pixels=767"):
        decode_image(ACCEPTED[row][0], max_pixels=24 * 32 - 1)


def _bigtiff_bomb() -> bytes:
    data = bytearray(tiff_image(RGB, big=True))
    # ImageWidth and ImageLength are the first two entries; their values start 12 bytes in.
    for k, v in ((0, 60000), (1, 60000)):
        at = 16 + 8 + 20 * k + 12
        data[at:at + 4] = struct.pack("<I", v)
    return bytes(data)


def _bombs() -> dict[str, bytes]:
    out = {"pnm-comments-60000x60000": b"P6\n# w\n60000 # h next\n# x\n60000\n255\n" + bytes(64),
           "bigtiff-60000x60000": _bigtiff_bomb()}
    # TIFF with its size entries behind 700 others.
    t = bytearray(tiff_image(RGB, filler=700))
    table = t[10:10 + 12 * 709]
    for k in range(709):
        tag, _ = struct.unpack("<HH", table[12 * k:12 * k + 4])
        if tag in (256, 257):
            t[10 + 12 * k + 8:10 + 12 * k + 12] = struct.pack("<I", 60000)
    out["tiff-700-entries-60000x60000"] = bytes(t)
    b = bytearray(bmp_top_down(RGB))
    b[18:26] = struct.pack("<ii", 60000, -60000)
    out["bmp-top-down-60000x60000"] = bytes(b)
    w = bytearray(webp_extended(RGB))
    w[24:30] = (59999).to_bytes(3, "little") * 2
    out["webp-extended-60000x60000"] = bytes(w)
    return out


HEADER_BOMBS = _bombs()


@pytest.mark.parametrize("row", sorted(HEADER_BOMBS))
def test_bomb_in_hard_header_rejected_before_decoding(row, no_pixel_decode):
    with pytest.raises(DecodeError, match=r"\(60000, 60000\) \(height, width\) = 3600000000 pixels exceeds max_pixels"):
        decode_image(HEADER_BOMBS[row])


def _truncated_headers() -> dict[str, bytes]:
    """Files cut inside their header, after the magic bytes (so the format is known)."""
    cuts = {"png": (12, 20), "bmp": (10, 20), "gif": (8,), "webp-lossless": (16, 24),
            "webp-lossy": (16, 28), "webp-extended": (16, 28), "tiff-cv2": (6, 12),
            "tiff-big-endian": (6, 20), "bigtiff": (12, 30), "ppm": (3,)}
    out = {f"{name}-{n}-bytes": ACCEPTED[name][0][:n] for name, ns in cuts.items() for n in ns}
    out["tiff-ifd-past-end"] = ACCEPTED["tiff-big-endian"][0][:40]
    out["tiff-ifd-offset-past-end"] = b"II*\x00" + struct.pack("<I", 1 << 30) + bytes(40)
    out["tiff-no-size-tags"] = b"II*\x00" + struct.pack("<IH", 8, 1) + struct.pack("<HHII", 259, 3, 1, 1) + bytes(8)
    out["tiff-65535-entries-claimed"] = b"II*\x00" + struct.pack("<IH", 8, 65535) + bytes(100)
    out["pnm-no-size"] = b"P6\n# only a comment\n"
    out["pnm-long-comment"] = b"P5\n#" + b"x" * 2000 + b"\n10 10\n255\n" + bytes(100)
    out["webp-unknown-chunk"] = b"RIFF" + struct.pack("<I", 40) + b"WEBPABCD" + bytes(40)
    out["webp-bad-vp8-start-code"] = ACCEPTED["webp-lossy"][0][:23] + b"\x00\x00\x00" + bytes(40)
    out["bmp-bad-dib-size"] = b"BM" + bytes(12) + struct.pack("<I", 5) + bytes(20)
    out["bmp-negative-width"] = b"BM" + bytes(12) + struct.pack("<Iii", 40, -10, 10) + bytes(20)
    out["png-no-ihdr"] = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"XXXX" + bytes(20)
    return out


TRUNCATED = _truncated_headers()


@pytest.mark.parametrize("row", sorted(TRUNCATED))
def test_unreadable_header_refused_as_corrupt(row, no_pixel_decode):
    with pytest.raises(DecodeError, match="corrupt"):
        decode_image(TRUNCATED[row])


# -- JPEG coding processes -----------------------------------------------------------


def _sof_at(data: bytes) -> int:
    """Where a test file's SOF marker is (its first marker segment in the range)."""
    pos = 2
    while not (0xC0 <= data[pos + 1] <= 0xCF and data[pos + 1] not in (0xC4, 0xC8, 0xCC)):
        pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])
    return pos


def _with_sof(data: bytes, marker: int) -> bytes:
    at = _sof_at(data) + 1
    return data[:at] + bytes([marker]) + data[at + 1:]


def _refused_processes() -> dict[str, tuple[bytes, str]]:
    """Valid JPEGs (or valid headers) in processes feeder does not decode: the
    error names what the header says."""
    rows = {
        "12-bit-sequential": (other_process("gray_12bit.jpg"), r"12-bit samples \(SOF1, extended sequential\)"),
        "12-bit-lossless": (other_process("lossless_gray_12bit.jpg"), r"12-bit samples \(SOF3, lossless\)"),
        "16-bit-lossless": (other_process("lossless_gray_16bit.jpg"), r"16-bit samples \(SOF3, lossless\)"),
        "lossless-ycbcr": (other_process("lossless_ycbcr.jpg"), r"lossless JPEG \(SOF3, lossless\) stored as YCbCr"),
    }
    for marker in (0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF):
        rows[f"hierarchical-SOF{marker - 0xC0}"] = (
            _with_sof(other_process("lossless_rgb.jpg"), marker), rf"hierarchical JPEG \(SOF{marker - 0xC0}, differential")
    return rows


REFUSED_PROCESSES = _refused_processes()


@pytest.mark.parametrize("row", sorted(REFUSED_PROCESSES))
@pytest.mark.parametrize("decoder", ["extension", "simplejpeg"])
def test_jpeg_process_feeder_does_not_decode_is_refused_by_name(row, decoder, monkeypatch,
                                                                no_pixel_decode):
    """12- and 16-bit samples, hierarchical frames and lossless YCbCr (which
    libjpeg-turbo cannot convert) are refused from the header with the process
    named, on both decoder paths and by header_size, not as a "corrupt header"
    in one path and "Unsupported color conversion" in the other."""
    if decoder == "extension" and decode_mod._jpeg is None:
        pytest.skip("the extension is not in use")
    if decoder == "simplejpeg":
        monkeypatch.setattr(decode_mod.extension, "jpeg", None)
    data, match = REFUSED_PROCESSES[row]
    with pytest.raises(DecodeError, match=match):
        decode_image(data, hint=lambda h, w, key: (8, 8))
    if not row.startswith("lossless-"):  # the colour space is a decoder's reading
        with pytest.raises(DecodeError, match=match):
            header_size(data)


@pytest.mark.parametrize("marker", [0xC3, 0xCB])
def test_lossless_jpeg_is_never_asked_for_a_scale(marker, monkeypatch):
    """SOF3 and SOF11 (lossless, Huffman or arithmetic): simplejpeg is asked
    for the whole image at full size, whatever the transforms need (an SOF11
    made here by relabelling Huffman data decodes to an error or some image,
    never by a scaled call)."""
    monkeypatch.setattr(decode_mod.extension, "jpeg", None)
    calls = []
    real = simplejpeg.decode_jpeg

    def spy(*args, **kwargs):
        calls.append(kwargs)
        if kwargs.get("min_height") or kwargs.get("min_width"):  # would overrun the heap: never run it
            raise AssertionError(f"a scaled decode of a lossless JPEG: {kwargs}")
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_mod.simplejpeg, "decode_jpeg", spy)
    data = _with_sof(other_process("lossless_rgb.jpg"), marker)
    try:
        img, size = decode_image(data, hint=lambda h, w, key: (4, 4))
        assert img.shape == (45, 62, 3) and size == (45, 62)
    except DecodeError:
        pass
    assert calls
    assert header_size(data) == (45, 62)


def test_jpeg_header_walk_is_bounded():
    """The walk to the frame header reads no length past the data and stops
    after a bounded number of steps: every prefix of a file gives an image or
    a DecodeError (never an IndexError), and a header of 5000 empty comments
    or fill bytes before its frame is refused (the walk stops after 4096 steps)."""
    data = encode_jpeg(smooth_rgb(24, 40), 90)
    whole = decode_image(data)[0]
    for n in range(3, len(data), 5):
        try:
            img, _ = decode_image(data[:n], hint=lambda h, w, key: (4, 4))
        except DecodeError:
            continue
        assert img.shape[2] == 3
    padded = data[:2] + b"\xff\xfe\x00\x02" * 5000 + data[2:]
    with pytest.raises(DecodeError, match="more than 4096 marker segments"):
        decode_image(padded)
    with pytest.raises(DecodeError, match="more than 4096 marker segments"):
        header_size(padded)
    fill = data[:2] + b"\xff" * 5000 + data[2:]
    with pytest.raises(DecodeError, match="more than 4096 marker segments"):
        decode_image(fill)
    few = data[:2] + b"\xff\xfe\x00\x02" * 50 + data[2:]  # 50 more steps: a header as any
    np.testing.assert_array_equal(decode_image(few)[0], whole)


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_jpeg_with_exif_orientation(name):
    """A lossless file is oriented as any other image."""
    data = other_process(name)
    exif = (b"Exif\x00\x00" + b"II*\x00" + struct.pack("<IH", 8, 1)
            + struct.pack("<HHIHH", 274, 3, 1, 6, 0) + bytes(4))
    oriented = data[:2] + b"\xff\xe1" + struct.pack(">H", len(exif) + 2) + exif + data[2:]
    img, size = decode_image(oriented, exif_orientation=True, hint=lambda h, w, key: (2, 2))
    want = np.rot90(lossless_shown(name), -1)
    assert size == want.shape[:2]
    np.testing.assert_array_equal(img, want)


def test_decoded_size_checked_again(monkeypatch):
    """A file that decodes bigger than its header said (another page, a lying
    header) is still held to max_pixels."""
    real = cv2.imdecode
    monkeypatch.setattr(decode_mod.cv2, "imdecode",
                        lambda buf, flags: np.repeat(np.repeat(real(buf, flags), 4, 0), 4, 1))
    data = ACCEPTED["png"][0]
    with pytest.raises(DecodeError, match=r"\(96, 128\) \(height, width\) = 12288 pixels exceeds max_pixels=1000"):
        decode_image(data, max_pixels=1000)


# -- EXIF orientation ----------------------------------------------------------------------

def exif_tiff(orientation: int, order: str = "<") -> bytes:
    """A minimal EXIF TIFF structure: IFD0 with one entry, Orientation (0x0112)."""
    bo = b"II" if order == "<" else b"MM"
    return (bo + struct.pack(order + "HIH", 42, 8, 1)
            + struct.pack(order + "HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(order + "I", 0))


def jpeg_with_exif(jpeg: bytes, orientation: int, order: str = "<") -> bytes:
    payload = b"Exif\x00\x00" + exif_tiff(orientation, order)
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def png_with_exif(png: bytes, orientation: int) -> bytes:
    body = exif_tiff(orientation)
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(">I", zlib.crc32(b"eXIf" + body))
    return png[:33] + chunk + png[33:]  # right after IHDR


def oriented(img: np.ndarray, orientation: int) -> np.ndarray:
    """What a viewer shows for EXIF ``orientation`` (written with numpy, independently of feeder)."""
    return {
        1: lambda a: a,
        2: lambda a: a[:, ::-1],              # mirrored left-right
        3: lambda a: a[::-1, ::-1],           # rotated 180
        4: lambda a: a[::-1],                 # mirrored top-bottom
        5: lambda a: a.transpose(1, 0, 2),    # transposed
        6: lambda a: np.rot90(a, -1),         # rotated 90 clockwise
        7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),  # transverse
        8: lambda a: np.rot90(a, 1),          # rotated 90 counter-clockwise
    }[orientation](img)


ORIENTATIONS = range(1, 9)


@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_png_exif_orientation_exact(orientation):
    data = png_with_exif(encode_png(RGB), orientation)
    img, size = decode_image(data)
    np.testing.assert_array_equal(img, RGB)  # ignored by default
    assert size == (24, 32)
    img, size = decode_image(data, exif_orientation=True)
    np.testing.assert_array_equal(img, oriented(RGB, orientation))
    assert size == img.shape[:2] and img.flags.c_contiguous


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_jpeg_exif_orientation(orientation, order):
    plain = encode_jpeg(RGB, 95)
    stored = simplejpeg.decode_jpeg(plain, colorspace="RGB")  # same decoder, same pixels
    data = jpeg_with_exif(plain, orientation, order)
    img, size = decode_image(data)
    np.testing.assert_array_equal(img, stored)
    img, size = decode_image(data, exif_orientation=True)
    np.testing.assert_array_equal(img, oriented(stored, orientation))
    assert size == img.shape[:2] and img.flags.c_contiguous


@pytest.mark.parametrize("orientation", ORIENTATIONS)
@pytest.mark.parametrize("kind", ["rgb", "gray"])
def test_tiff_orientation_tag(orientation, kind):
    ref = RGB if kind == "rgb" else np.repeat(RGB[..., :1], 3, 2)
    data = tiff_image(RGB if kind == "rgb" else RGB[..., 0].copy(), orientation=orientation)
    img, size = decode_image(data)
    np.testing.assert_array_equal(img, ref)  # OpenCV alone would have applied the tag
    assert size == (24, 32)
    img, size = decode_image(data, exif_orientation=True)
    np.testing.assert_array_equal(img, oriented(ref, orientation))
    assert size == img.shape[:2]


@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_webp_exif_orientation(orientation):
    for exif in (exif_tiff(orientation), b"Exif\x00\x00" + exif_tiff(orientation, ">")):
        data = webp_extended(RGB, exif)
        np.testing.assert_array_equal(decode_image(data)[0], RGB)
        img, size = decode_image(data, exif_orientation=True)
        np.testing.assert_array_equal(img, oriented(RGB, orientation))


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_rgb_and_cmyk_jpeg_agree_on_orientation(orientation):
    """The same picture as RGB and as CMYK JPEG (decoded by different libraries)
    comes out the same way round, by default and when orientation is applied."""
    k = np.full(RGB.shape[:2] + (1,), 255, np.uint8)
    cmyk = jpeg_with_exif(cmyk_jpeg(np.concatenate([RGB, k], axis=2)), orientation)
    rgb = jpeg_with_exif(encode_jpeg(RGB, 95), orientation)
    for flag in (False, True):
        a, size_a = decode_image(rgb, exif_orientation=flag)
        b, size_b = decode_image(cmyk, exif_orientation=flag)
        assert a.shape == b.shape and size_a == size_b
        assert np.abs(a.astype(int) - b.astype(int)).mean() < 4
        want = oriented(RGB, orientation) if flag else RGB
        assert np.abs(a.astype(int) - want.astype(int)).mean() < 4


def test_orientation_and_reduced_scale_decode():
    """The hint sees the oriented size and its answer is honoured in that frame."""
    from feeder.synthetic import make_image
    big = make_image(1000, 1500, 0)
    data = jpeg_with_exif(encode_jpeg(big, 90), 6)  # shown 1500 high, 1000 wide
    seen = []

    def hint(h, w, key):
        seen.append((h, w))
        return (375, 250)

    img, size = decode_image(data, hint=hint, exif_orientation=True)
    assert seen == [(1500, 1000)] and size == (1500, 1000)
    assert img.shape == (375, 250, 3)  # a 1/4-scale decode, rotated
    small = simplejpeg.decode_jpeg(encode_jpeg(big, 90), colorspace="RGB", min_height=250, min_width=375)
    np.testing.assert_array_equal(img, oriented(small, 6))
    seen.clear()
    img, size = decode_image(data, hint=hint)  # orientation ignored: the stored frame
    assert seen == [(1000, 1500)] and size == (1000, 1500) and img.shape[:2] == (375, 563)


def test_orientation_with_pooled_buffers():
    class Pool(decode_mod.DecodeBuffers):
        def __init__(self):
            super().__init__()
            self.taken, self.given = [], []

        def take(self, nbytes):
            self.taken.append(super().take(nbytes))
            return self.taken[-1]

        def give(self, buf):
            self.given.append(buf)
            super().give(buf)

    buffers = Pool()
    data = jpeg_with_exif(encode_jpeg(RGB, 95), 8)
    img, _ = decode_image(data, buffers=buffers, exif_orientation=True)
    assert decode_mod.buffer_of(img) is None  # a new array, and the pool buffer went back
    assert len(buffers.taken) == 1 and len(buffers.given) == 1 and buffers.given[0] is buffers.taken[0]


def test_broken_exif_is_ignored():
    plain = encode_jpeg(RGB, 95)
    stored = simplejpeg.decode_jpeg(plain, colorspace="RGB")
    for payload in (b"Exif\x00\x00II*\x00\xff\xff\xff\xff", b"Exif\x00\x00XX", b"Exif\x00\x00"):
        data = plain[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + plain[2:]
        np.testing.assert_array_equal(decode_image(data, exif_orientation=True)[0], stored)
    data = jpeg_with_exif(plain, 9)  # not an orientation
    np.testing.assert_array_equal(decode_image(data, exif_orientation=True)[0], stored)


def test_exif_orientation_config():
    assert DEFAULTS["exif_orientation"] is False
    base = dict(DEFAULTS, batch_size=2)
    assert Config.build(**base).exif_orientation is False
    assert Config.build(**dict(base, exif_orientation=True)).exif_orientation is True
    with pytest.raises(ValueError, match="exif_orientation must be True or False, got 'yes'"):
        Config.build(**dict(base, exif_orientation="yes"))


# -- file names that are not valid UTF-8 ------------------------------------------------

class _RecordingHandler(logging.StreamHandler):
    """Writes records as strict UTF-8, and keeps the failures logging would print."""

    def __init__(self) -> None:
        self.raw = io.BytesIO()
        super().__init__(io.TextIOWrapper(self.raw, encoding="utf-8", errors="strict"))
        self.failures: list[BaseException] = []

    def handleError(self, record) -> None:  # noqa: N802 - logging's name
        import sys
        self.failures.append(sys.exc_info()[1])

    def text(self) -> str:
        self.flush()
        return self.raw.getvalue().decode("utf-8")


def _bad_name_sources(tmp_path):
    """The same four files through FileList and ImageFolder; the third has a name
    with an invalid UTF-8 byte and corrupt contents."""
    good = distinct_jpegs(3, seed=21)
    folder = os.fsencode(tmp_path / "data" / "cls")
    os.makedirs(folder)
    names = [b"a.jpg", b"b.jpg", b"c\xff.jpg", b"d.jpg"]
    blobs = [good[0], good[1], b"\xff\xd8\xff\xe0 not really a jpeg" * 10, good[2]]
    for name, data in zip(names, blobs):
        fd = os.open(folder + b"/" + name, os.O_WRONLY | os.O_CREAT, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    bad = os.fsdecode(folder + b"/" + names[2])
    paths = [os.fsdecode(folder + b"/" + n) for n in names]
    return {"FileList": FileList(paths, [0, 0, 0, 0]), "ImageFolder": ImageFolder(tmp_path / "data")}, bad


@pytest.mark.parametrize("kind", ["FileList", "ImageFolder"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_undecodable_file_name_in_messages_and_logs(tmp_path, kind, on_error):
    sources, bad = _bad_name_sources(tmp_path)
    src = sources[kind]
    assert src.paths[2] == bad
    handler = _RecordingHandler()
    logger = logging.getLogger("feeder")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        with Feeder(src, 2, [ops.CenterCrop(32)], shuffle=False, on_error=on_error) as f:
            batches, err = drain(f, timeout=20)
            skipped = f.stats().skipped_paths
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    shown = bad.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    assert "c\\xff.jpg" in shown
    if on_error == "raise":
        assert isinstance(err, SampleError) and err.index == 2
        msg = str(err)
        msg.encode("utf-8")  # must not raise
        assert shown in msg
        assert err.path == bad
        with open(err.path, "rb") as fh:  # the path still opens the file
            assert fh.read(3) == b"\xff\xd8\xff"
    else:
        assert err is None and skipped == (bad,)
        assert sum(len(y) for _, y in batches) == 3
        assert shown in handler.text()
    assert handler.failures == []


def test_safe_text():
    from feeder.errors import safe_text
    assert safe_text("plain é") == "plain é"
    assert safe_text(os.fsdecode(b"x\xff\xfey")) == "x\\xff\\xfey"
    assert safe_text("lone \ud800") == "lone \\ud800"
    for s in (os.fsdecode(b"x\xff"), "lone \ud800"):
        safe_text(s).encode("utf-8")
