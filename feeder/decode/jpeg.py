"""Decoding a JPEG: :class:`JpegDecoder`, the choice between the region decoder
(feeder's extension: only the rows and columns the first transform reads, at
DCT scale 1/1 to 1/8) and simplejpeg (the whole image, at a reduced scale when
it covers), made per file from its header and the transforms' plan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cv2
import numpy as np
import simplejpeg

from ..errors import DecodeError
from ..sample import DEFAULT_MAX_PIXELS, SampleContext
from . import extension
from .extension import HOW_TO_BUILD
from .headers import _MAX_HEADER_STEPS, JpegFrame, check_pixels, jpeg_frame
from .region import decode_region, orient, orientation_of
from .verified import VerifiedJpegs

__all__ = ["MAX_SCANS", "USUAL_SAMPLINGS", "JpegDecoder", "Plan"]

#: ``plan(height, width, key) -> (need, planned)``: the transforms' smallest
#: decoded size for the sample and what they drew to compute it (see
#: ``Chain.plan``).
Plan = Callable[[int, int, Any], "tuple[tuple[int, int] | None, Any]"]

#: The chroma layouts (the extension's header names them) that libjpeg-turbo's
#: partial decode (rows skipped, columns cropped) and simplejpeg handle. Other
#: sampling factors are valid JPEG and rare (a 4x4 luma, a 2x1 Cr beside a 1x1
#: Cb): libjpeg-turbo 2.1's row skipping loops forever on some of them and its
#: column cropping gives wrong pixels at reduced scales, and simplejpeg refuses
#: them all, so the extension decodes them whole (``decode_region(whole=True)``).
USUAL_SAMPLINGS = frozenset(("gray", "4:4:4", "4:2:2", "4:2:0", "4:4:0", "4:1:1"))


def _simplejpeg_whole(data: bytes | memoryview, colorspace: str, frame: JpegFrame,
                      stored: str) -> np.ndarray:
    """The whole image at full size through simplejpeg (no scaling asked for)."""
    try:
        return simplejpeg.decode_jpeg(data, colorspace=colorspace)
    except ValueError as exc:
        raise DecodeError(f"corrupt JPEG ({frame.process}, {stored}): {exc}") from exc


def _simplejpeg_says(exc: Exception) -> str:
    """simplejpeg's error, with what it means when the file is valid but has sampling
    factors it cannot decode (TurboJPEG's API knows the usual layouts only)."""
    text = str(exc)
    if "subsampling level" in text:
        return (f"{text} (the file's chroma sampling factors are not one of the usual layouts, "
                f"which simplejpeg alone decodes; feeder's JPEG extension decodes them: "
                f"{HOW_TO_BUILD})")
    return text


# The region decoder's bound on a progressive file's scans (each a pass over the
# whole coefficient buffer: a small hostile file with thousands takes seconds;
# real encoders write about ten), held on the simplejpeg path too, so that a
# file is accepted or refused whatever the transforms and the decoder.
MAX_SCANS = 500


def check_scans(data: bytes | memoryview, frame: JpegFrame) -> None:
    """Refuse a progressive JPEG of more than :data:`MAX_SCANS` scans.

    A progressive frame's scans are counted as the ``FF DA`` pairs from its
    first scan on: inside entropy-coded data an ``FF`` byte is always followed
    by ``00`` or a restart marker, so every such pair is a scan."""
    if frame.progressive and (data if type(data) is bytes else bytes(data)).count(
            b"\xff\xda", frame.scan_at) > MAX_SCANS:
        raise DecodeError(f"corrupt JPEG: more than {MAX_SCANS} scans (a real encoder writes "
                          f"about ten)")


class JpegDecoder:
    """How one feeder decodes JPEGs: through the region decoder (``ext``, the
    extension) when it is built, else simplejpeg; at the reduced scale or the
    region the transforms' plan allows; read to the file's end once per
    distinct file (``verify``, ``verified``), every time for a small one off
    the fused path (:data:`SMALL_BYTES`).

    Build one per set of settings and call :meth:`decode` per file; thread-safe
    (it holds settings, and ``verified`` locks itself).

    Args:
        max_pixels: Largest accepted ``width * height``, from the header.
        buffers: Where output memory comes from (a ``DecodeBuffers``), or None.
        exif_orientation: Apply the EXIF orientation.
        verify: Entropy-decode a region-decoded file to its end, so damage
            anywhere fails it as a full decode would (``Feeder(jpeg_verify=)``).
        verified: The files already read to their end (with ``verify``, only
            the first read of the same bytes goes to the end) and their row
            indexes (see :class:`~feeder.decode.verified.VerifiedJpegs`), or None.
        ext: The region decoder; by default the built extension (None when it is
            not in use: simplejpeg alone).
        small_bytes: Files of fewer bytes are decoded without ``verified``
            where the memory is read in Python (default :data:`SMALL_BYTES`;
            0: none).
    """

    #: Files of fewer bytes are region-decoded without :attr:`verified` where
    #: the memory would be read in Python (:meth:`decode`; :meth:`fused` reads
    #: it in the extension, for every file): each decode reads them to their
    #: end (with ``verify``) and no row index is kept, because for them the
    #: memory's per-file Python cost (fingerprints, lookups, adds, all with the
    #: GIL held) exceeds what stopping after the crop saves (measured:
    #: ``bench/results/small_images.txt``).
    SMALL_BYTES = 12 << 10

    def __init__(self, max_pixels: int = DEFAULT_MAX_PIXELS, buffers: Any = None,
                 exif_orientation: bool = False, verify: bool = True,
                 verified: VerifiedJpegs | None = None, ext: Any = ...,
                 small_bytes: int | None = None) -> None:
        self.max_pixels = max_pixels
        #: See :data:`SMALL_BYTES` (0: every file goes through the memory).
        self.small_bytes = self.SMALL_BYTES if small_bytes is None else small_bytes
        self.buffers = buffers
        self.exif_orientation = exif_orientation
        self.verify = verify
        self.verified = verified
        self._ext = ext  # ... (a singleton, so it survives a pickle): not given

    @property
    def ext(self) -> Any:
        """The region decoder in use (None: simplejpeg alone); unless one was
        given, the extension as :mod:`feeder.decode.extension` holds it now."""
        return extension.jpeg if self._ext is ... else self._ext

    @ext.setter
    def ext(self, ext: Any) -> None:
        self._ext = ext

    def decode(self, data: bytes | memoryview, plan: Plan | None, key: Any,
               fuse: tuple[Any, np.ndarray] | None = None) -> tuple[np.ndarray | None, tuple[int, int], Any]:
        """Decode JPEG ``data`` with the transforms' ``plan`` (see
        ``feeder.decode.image.decode_planned``) for the sample of ``key``.

        ``fuse``: (the chain's ``FusedCrop``, the sample's batch slot): where the
        region decoder takes the sample, it also crops, resizes and flips it
        into the slot (see ``decode_region``) and the image returned is None.

        Returns:
            The image (None: fused into the slot), its full (oriented) size, and
            what ``plan`` drew (None when it was not called).

        Raises:
            DecodeError: corrupt, truncated, unsupported or oversized.
        """
        frame = jpeg_frame(data)  # the process first: it decides how the file may be decoded
        lossless = frame is not None and frame.lossless
        ext = self.ext  # once: a property
        h, w, colorspace, sampling, scans = self._header(data, lossless, ext)
        if frame is None:  # the decoder read a header that the marker walk could not
            raise DecodeError("corrupt JPEG header: no frame header (SOF) in a walk of its marker "
                              "segments (bytes between them?)")
        if h <= 0 or w <= 0 or h * w > self.max_pixels:
            check_pixels(h, w, self.max_pixels)  # raises, saying which
        orientation = orientation_of(None, data) if self.exif_orientation else 1
        swap = orientation >= 5  # transposing orientations: the shown image is w x h
        size = (w, h) if swap else (h, w)
        if colorspace in ("CMYK", "YCCK"):
            return orient(self._ink(data, frame, colorspace), orientation), size, None
        if lossless:
            return orient(self._lossless(data, frame, colorspace), orientation), size, None
        own = ext is not None and colorspace in ("Gray", "YCbCr", "RGB")
        # Chroma sampling factors other than the usual ones (valid JPEG, rare):
        # libjpeg-turbo's partial decode can loop forever or give wrong pixels on
        # them, and simplejpeg refuses them; the extension decodes them whole.
        unusual = own and sampling not in USUAL_SAMPLINGS
        need = planned = None
        if plan is not None:
            need, planned = plan(size[0], size[1], key)
        box = getattr(planned, "box", None)
        if unusual or (own and need is None and box is None):
            # The whole image at the largest reduction that covers need; a chain that
            # planned a box gets its context filled in as for a region decode. A
            # whole image at full size goes through the extension too, so that one
            # Huffman decoder judges damaged data whether a crop is drawn or not
            # (feeder's reports the junk bytes before a marker that libjpeg-turbo's
            # read-ahead, and so simplejpeg's, can pass over). A hint without a box
            # stays with simplejpeg, whose 3/8, 5/8... scales the extension has not.
            ctx = planned if box is not None else SampleContext(size)
            img, _ = decode_region(ext, data, h, w, need, ctx, orientation, self.max_pixels,
                                   self.buffers, True, whole=True)
            return img, size, planned
        if own and box is not None:
            into = (None if fuse is None or not hasattr(ext, "resize")
                    else (fuse[0], key, fuse[1]))
            if len(data) < self.small_bytes:
                # A small file: its region decoded as on a first read, reading to
                # its end with ``verify`` (the same pixels and verdict), and no
                # memory of it kept (see SMALL_BYTES).
                img, _ = decode_region(ext, data, h, w, need, planned, orientation,
                                       self.max_pixels, self.buffers, self.verify, fuse=into)
                return img, size, planned
            return self._region(data, h, w, need, planned, orientation, scans, into), size, planned
        min_h = min_w = 0
        if need is not None and swap:
            need = (need[1], need[0])
        # Reduced-scale IDCT pays off from 1/2 down; scales between 1/2 and 1
        # are slower than a full decode in libjpeg-turbo, so they are not used.
        if need is not None and 2 * need[0] <= h and 2 * need[1] <= w:
            min_h, min_w = need
        return self._scaled(data, frame, h, w, min_h, min_w, orientation), size, planned

    def fused(self, data: bytes, key: int, fused: Any, out: np.ndarray) -> bool:
        """:meth:`decode` with ``fuse=(fused, out)`` for the usual file, in one call
        of the extension without the GIL (its ``fused``): a JPEG of the
        usual kind (8-bit Huffman DCT, gray/YCbCr/RGB, usual chroma sampling,
        within ``max_pixels``), no EXIF orientation applied, whose crop the
        bilinear resize takes. The extension runs the arithmetic of ``decode``,
        the chain's plan, ``decode_region`` and ``FusedCrop.spec``, and consults
        :attr:`verified` as :meth:`_region` does (its fingerprint, whether the
        bytes were read to their end, their row index), so that any file, small
        or large, takes the memory with no Python per sample; only adding to the
        memory comes back here. Without the memory in the extension (a CPU
        without the CRC-32C instruction, or none kept), only files under
        :attr:`small_bytes` take this path, as on their first read. Returns
        False, having done nothing, for anything else: ``decode`` then takes
        it, and reports what is wrong with it. Tests check that both give the
        same bytes and the same verdicts.

        Raises:
            DecodeError: the decode failed, as :meth:`decode` would say.
        """
        ext = self.ext
        if ext is None or self.exif_orientation or type(data) is not bytes:
            return False  # (a mutable buffer could change between the fingerprint and the decode)
        verified = self.verified
        memory = None if verified is None else verified.native
        if memory is None and len(data) >= self.small_bytes:
            return False
        return self._fuse(ext, data, key, fused, out, memory)  # bytes: they cannot change meanwhile

    def fused_path(self, path: str, key: int, fused: Any, out: np.ndarray) -> bool | bytes:
        """:meth:`fused` of the file at ``path``, read in the same extension call
        (as ``sources._read_file`` reads it). Returns True when ``out`` holds the
        sample, else the file's bytes for :meth:`decode` to take; None, having
        read nothing, where the call cannot read the memory (see :meth:`fused`).

        Raises:
            OSError: the file could not be read (naming ``path``).
            DecodeError: the decode failed, as :meth:`decode` would say.
        """
        memory = self._path_memory()
        if memory is False:
            return None
        return self._fuse(self.ext, path, key, fused, out, memory)

    def fused_run(self, paths: list[str], keys: list[int], fused: Any, outs: list[np.ndarray],
                  at: np.ndarray | None = None) -> list[bool | bytes | None] | None:
        """:meth:`fused_path` on each of a run of files, in one extension call that
        lets go of the GIL once for all of them (``at``: a one-int64 array where
        the call writes the position of the file in work). Per file: True when
        its ``out`` holds the sample, its bytes for :meth:`decode` to take, or
        None where the call read nothing usable (not a regular file, a read or
        decode error, a file not taken over 1 MiB, which a run does not hold
        for its other files): :meth:`fused_path` then takes that file alone,
        and raises what it raises. None, having read nothing, where :meth:`fused_path`
        would return None."""
        memory = self._path_memory()
        if memory is False:
            return None
        got = self.ext.fused_run(paths, keys, outs, at, *fused.call_args, self.verify, _MAX_HEADER_STEPS,
                                 self.max_pixels, memory)
        for i, done in enumerate(got):
            if type(done) is tuple:
                got[i] = self._learn(done)
        return got

    def _path_memory(self) -> tuple | None | bool:
        """The memory the extension reads for a fused call on a path (None:
        none kept), or False where that call cannot be made: no extension,
        EXIF orientation applied, or a memory the extension cannot read."""
        verified = self.verified
        memory = None if verified is None else verified.native
        if self.ext is None or self.exif_orientation or (verified is not None and memory is None):
            return False
        return memory

    def _learn(self, done: tuple) -> bool:
        """What the extension's fused call found for the verified-JPEG memory
        (fingerprints, read to the end, the index made), added to it."""
        fp, check, read_to_end, index = done
        if read_to_end:
            self.verified.add(fp, index, check)  # type: ignore[union-attr]
        else:
            self.verified.keep_index(fp, index, check)  # type: ignore[union-attr]
        return True

    def _fuse(self, ext: Any, source: str | bytes, key: int, fused: Any, out: np.ndarray,
              memory: tuple | None) -> bool | bytes:
        """The extension's fused call on ``source`` (bytes, or a path it reads),
        and what it found for the verified-JPEG memory added to it: what
        :meth:`fused` and :meth:`fused_path` return."""
        done = ext.fused(source, key, *fused.call_args, self.verify, _MAX_HEADER_STEPS, self.max_pixels,
                         out, memory)
        return done if type(done) is not tuple else self._learn(done)

    def _header(self, data: bytes | memoryview, lossless: bool, ext: Any) -> tuple[int, int, str, Any, Any]:
        """(height, width, colorspace, sampling, scans) by ``ext`` (:attr:`ext`); the
        last two None from simplejpeg."""
        if ext is not None and not lossless:
            w, h, _, colorspace, sampling, scans = ext.header(data)  # raises DecodeError("corrupt JPEG header: ...")
            return h, w, colorspace, sampling, scans
        # A lossless file is read by simplejpeg whatever the path: the system's
        # libjpeg-turbo before 3.0 knows no lossless process.
        try:
            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as exc:
            needs = " (lossless JPEGs need libjpeg-turbo 3.0 or later)" if lossless else ""
            raise DecodeError(f"corrupt JPEG header: {_simplejpeg_says(exc)}{needs}") from exc
        return h, w, colorspace, None, None

    @staticmethod
    def _ink(data: bytes | memoryview, frame: JpegFrame, colorspace: str) -> np.ndarray:
        """A CMYK or YCCK file as RGB.

        libjpeg-turbo cannot convert CMYK to RGB: decode the (Adobe, inverted)
        ink values with simplejpeg, whose corrupt-data warnings are errors as
        for every other JPEG (OpenCV's reader only prints them), and convert
        as browsers and OpenCV do: R = C * K / 255, rounded. Rare in datasets.
        Whole, at full size, whatever the transforms need (lossless files too)."""
        check_scans(data, frame)
        ink = _simplejpeg_whole(data, "CMYK", frame, colorspace)
        k = ink[..., 3:4].astype(np.uint16)
        return ((ink[..., :3].astype(np.uint16) * k + 127) // 255).astype(np.uint8)

    @staticmethod
    def _lossless(data: bytes | memoryview, frame: JpegFrame, colorspace: str) -> np.ndarray:
        """A lossless file, whole at full size.

        DCT scaling means nothing to a lossless file, and libjpeg-turbo 3.0 to
        3.1.3 (simplejpeg bundles one) decodes it at full size into the
        output sized for the scale asked for: garbage with a pool buffer,
        a heap overrun without. It is decoded whole at full size, as a PNG
        is, and the transforms draw their crop from that. libjpeg-turbo
        converts no colours in lossless mode: gray is widened here."""
        if colorspace == "Gray":
            return cv2.cvtColor(_simplejpeg_whole(data, "GRAY", frame, colorspace), cv2.COLOR_GRAY2RGB)
        if colorspace == "RGB":
            return _simplejpeg_whole(data, "RGB", frame, colorspace)
        raise DecodeError(f"lossless JPEG ({frame.process}) stored as {colorspace} is not "
                          f"supported: libjpeg-turbo converts no colours in lossless mode "
                          f"(RGB, gray and CMYK lossless JPEGs are decoded)")

    def _region(self, data: bytes | memoryview, h: int, w: int, need: tuple[int, int] | None,
                planned: Any, orientation: int, scans: Any,
                fuse: tuple[Any, Any, np.ndarray] | None = None) -> np.ndarray | None:
        """The planned box through the region decoder, remembering the file.

        Bytes that were read to their end without an error before decode the
        same way again: reading may stop after the crop's last row. (A
        progressive file's scans are all read before any row: its end costs
        nothing more to reach, so it is not remembered.) Every decode also
        records where the rows it passes start (the row index, see
        ``verified.py``: all of them in the read to the end, down to the crop
        otherwise); a later one starts at the row above its crop, and records
        on past the index's last row if it goes further. ``fuse``: see
        ``decode_region``."""
        verified = self.verified
        fp, check = (verified.fingerprints(data) if verified is not None and not scans
                     else (0, 0))
        index = verified.index(fp, check) if fp else None  # type: ignore[union-attr]
        verify = self.verify and not (fp and verified.seen(fp))  # type: ignore[union-attr]
        img, made = decode_region(self.ext, data, h, w, need, planned, orientation, self.max_pixels,
                                  self.buffers, verify, index=index,
                                  record=verified.points_of(len(data)) if fp else 0,  # type: ignore[union-attr]
                                  fuse=fuse)
        # A buffer other than bytes may have changed while it was decoded
        # (the decoder and the CRC release the GIL): remember only bytes
        # that were the same before and after.
        if fp and (verify or made is not None) and (
                type(data) is bytes or verified.fingerprints(data) == (fp, check)):  # type: ignore[union-attr]
            if verify:
                verified.add(fp, made, check)  # type: ignore[union-attr]
            else:
                verified.keep_index(fp, made, check)  # type: ignore[union-attr, arg-type]
        return img

    def _scaled(self, data: bytes | memoryview, frame: JpegFrame, h: int, w: int, min_h: int,
                min_w: int, orientation: int) -> np.ndarray:
        """The whole image through simplejpeg, at the smallest scale of at least
        (``min_h``, ``min_w``) (0: full size)."""
        check_scans(data, frame)
        buffers = self.buffers
        buf = None if buffers is None else buffers.take(h * w * 3)
        try:
            img = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w,
                                         buffer=buf)
        except ValueError as exc:
            if buffers is not None:
                buffers.give(buf)
            raise DecodeError(f"corrupt JPEG: {_simplejpeg_says(exc)}") from exc
        if orientation != 1:
            img = orient(img, orientation)  # a new array: the pool buffer is free again
            if buffers is not None:
                buffers.give(buf)
        return img
