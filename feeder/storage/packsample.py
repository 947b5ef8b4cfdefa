"""What ``feeder-pack`` writes for one sample: its members (the image, shrunk
with ``--max-side`` when larger; the label; a dict sample's mask, boxes and
other fields, each as a member named for :class:`feeder.shards.TarShards`), the
image's format from its bytes, and its size for the shard's index."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from typing import Any

from ..decode.headers import header_size
from .tar import IMAGE_EXTS


class PackError(Exception):
    """A pack cannot run as asked (the message says why and what to do)."""

def shrink(data: bytes, ext: str, max_side: int, quality: int) -> bytes | None:
    """``data`` re-encoded with its longer side at most ``max_side``; the same bytes
    when already small enough; None when it cannot be decoded."""
    out = _shrink_sized(data, ext, max_side, quality)
    return None if out is None else out[0]


def _shrink_sized(data: bytes, ext: str, max_side: int,
                  quality: int) -> tuple[bytes, tuple[int, int], tuple[int, int]] | None:
    """Like :func:`shrink`, with the image's ``(height, width)`` before and after."""
    import cv2  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if img is None:
        return None
    h, w = img.shape[:2]
    if max(h, w) <= max_side:
        return data, (h, w), (h, w)
    scale = max_side / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    img = cv2.resize(img, size, interpolation=cv2.INTER_AREA)
    if ext in ("jpg", "jpeg"):
        params = [cv2.IMWRITE_JPEG_QUALITY, quality]
    elif ext == "webp":
        params = [cv2.IMWRITE_WEBP_QUALITY, quality]
    else:
        params = []
    ok, out = cv2.imencode("." + ext, img, params)
    if not ok:
        ok, out = cv2.imencode(".png", img)
    return out.tobytes(), (h, w), (size[1], size[0])


def image_ext(data: bytes | bytearray | memoryview) -> str | None:
    """The file extension of encoded image bytes, from their first bytes; None
    when they are no format feeder reads."""
    head = bytes(data[:16])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head.startswith(b"BM"):
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):  # TIFF, BigTIFF
        return "tiff"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if len(head) > 2 and head[0:1] == b"P" and head[1:2] in b"123456" and head[2:3] in b" \t\r\n#":
        return "pnm"
    return None


# A field's name becomes part of a member name ``<key>.<name>.<format>``: the
# index format separates by whitespace, tar paths by "/".
_FIELD_NAME = re.compile(r"[^\s/\\]+")


def name_sample(source: Any, i: int) -> str:
    try:
        return f"sample {i} ({source.describe(i)})"
    except Exception:  # noqa: BLE001 - no describe(), or one that fails: the index alone
        return f"sample {i}"


def sample_members(source: Any, i: int, max_side: int | None = None,
                   quality: int = 90) -> tuple[list[tuple[str, bytes]], str]:
    """The shard members (``(extension, bytes)``, image first) of ``source.read(i)``,
    and ``"same"``, ``"reencoded"`` or ``"kept"`` (see :class:`PackResult`).

    A pair becomes ``<ext>`` and ``cls`` (none for the label -1); a dict's fields
    become ``cls`` (an int ``"label"``), ``mask.png``, ``<name>.npy`` (numbers
    and arrays: ``boxes``, ``box_*``...), ``<name>.txt`` (str), ``<name>.bin``
    (bytes) and ``<name>.json`` (anything else), which :class:`feeder.TarShards`
    reads back to the same sample. With ``max_side``, a dict's mask is resized
    with the image (nearest neighbour, as a lossless PNG), its per-instance
    ``masks`` too (nearest, ``masks.npy``), its boxes and keypoints scaled.

    Raises:
        PackError: the sample cannot be packed (names the sample and the field).
    """
    from ..sample import LABEL, parse_sample  # noqa: PLC0415
    from ..errors import FieldError, SourceError  # noqa: PLC0415

    where = name_sample(source, i)
    try:
        data, fields, is_dict = parse_sample(source.read(i), source, i)
    except (SourceError, FieldError) as exc:
        raise PackError(f"{where}: {exc}") from exc
    data = _encoded(data, where)
    ext = image_ext(data)
    if ext is None:
        raise PackError(f"{where}: field 'image' is not an image feeder reads (first bytes "
                        f"{data[:8]!r})")
    status = "same"
    shrunk = None
    if max_side is not None:
        shrunk = _shrink_sized(data, ext, max_side, quality)
        if shrunk is None:
            status = "kept"
        elif shrunk[0] is not data:
            data, status = shrunk[0], "reencoded"
    members = [(ext, data)]
    assert fields is not None
    if not is_dict:
        members.extend(_label_member(fields[LABEL], where))
        return members, status
    resized = shrunk if status == "reencoded" and shrunk is not None else None
    for name, value in fields.items():
        members.append(_field_member(name, value, resized, where))
    return members, status


def _encoded(data: Any, where: str) -> bytes:
    """The image's bytes as a file holds them: encoded bytes as given; an image the
    source gave decoded (an array from ``sample.pixels``) as a lossless PNG of the
    RGB pixels a feeder makes of it (gray widened, alpha dropped), so that the
    shards give back the very pixels the source gave."""
    import numpy as np  # noqa: PLC0415

    if not isinstance(data, np.ndarray):
        return bytes(data)
    import cv2  # noqa: PLC0415

    from ..decode.image import rgb_of_pixels  # noqa: PLC0415

    try:
        rgb = rgb_of_pixels(data)
    except Exception as exc:  # noqa: BLE001 - named with the sample
        raise PackError(f"{where}: field 'image': {exc}") from exc
    ok, out = cv2.imencode(".png", np.ascontiguousarray(rgb[:, :, ::-1]))
    if not ok:
        raise PackError(f"{where}: field 'image': OpenCV could not encode its {rgb.shape} pixels "
                        f"as PNG")
    return out.tobytes()


def _label_member(label: Any, where: str) -> list[tuple[str, bytes]]:
    """A pair's label as its ``cls`` member (none for -1, unlabeled)."""
    if label.ndim != 0 or label.dtype.kind != "i":
        raise PackError(f"{where}: its label is {label.dtype.name} of shape {label.shape}; a "
                        f"pair's label is packed as a class index (.cls), so return a dict "
                        f"{{\"image\": ..., \"label\": ...}} to pack other labels (as label.npy)")
    if int(label) < -1:
        raise PackError(f"{where}: label {int(label)} is negative (-1 means unlabeled)")
    return [("cls", str(int(label)).encode("ascii"))] if int(label) >= 0 else []


def _field_member(name: str, value: Any, resized: Any, where: str) -> tuple[str, bytes]:
    """A dict sample's field as its shard member; ``resized``: the image's
    ``(bytes, size, new size)`` when it was made smaller (the geometry moves with it)."""
    import numpy as np  # noqa: PLC0415

    from ..sample import BOXES, INSTANCE_MASKS, KEYPOINTS, LABEL, MASK  # noqa: PLC0415

    if not _FIELD_NAME.fullmatch(name):
        raise PackError(f"{where}: field {name!r}: a packed field's name has no whitespace, "
                        f"'/' or '\\'")
    if name == MASK:
        return "mask.png", _pack_mask(value, resized, where)
    if name == LABEL and isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind == "i":
        return "cls", str(int(value)).encode("ascii")
    if isinstance(value, np.ndarray):
        if resized is not None and name == BOXES:
            (h, w), (h2, w2) = resized[1], resized[2]
            value = (value * np.array([w2 / w, h2 / h, w2 / w, h2 / h], np.float32)).astype(np.float32)
        elif resized is not None and name == KEYPOINTS:
            (h, w), (h2, w2) = resized[1], resized[2]
            value = value * np.array([w2 / w, h2 / h, 1], np.float32)
        elif resized is not None and name == INSTANCE_MASKS:
            value = _resize_instances(value, resized[2])
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return f"{name}.npy", buf.getvalue()
    if isinstance(value, str):
        try:
            return f"{name}.txt", value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PackError(f"{where}: field {name!r} is not valid text ({exc})") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{name}.bin", bytes(value)
    try:
        return f"{name}.json", json.dumps(value).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise PackError(f"{where}: field {name!r} is {type(value).__name__}, which is "
                        f"packed as JSON, but {exc}") from None


def _resize_instances(masks: Any, size: tuple[int, int]) -> Any:
    """Per-instance masks ``[N, H, W]`` resized to ``size`` (height, width), each
    pixel the one under its centre (as feeder's transforms resample masks)."""
    import cv2  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    out = np.zeros((len(masks), *size), np.uint8)
    for k, m in enumerate(masks):
        out[k] = cv2.resize(np.ascontiguousarray(m), (size[1], size[0]),
                            interpolation=cv2.INTER_NEAREST_EXACT)
    return out


def _pack_mask(value: Any, shrunk: Any, where: str) -> bytes:
    """A mask as PNG bytes: as given when nothing is resized, else decoded,
    resized to the re-encoded image's size by nearest neighbour and re-encoded
    losslessly (a palette PNG becomes a gray PNG of its indices)."""
    import cv2  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from ..decode.masks import decode_mask  # noqa: PLC0415
    from ..errors import DecodeError  # noqa: PLC0415

    if isinstance(value, (bytes, bytearray, memoryview)):
        if shrunk is None:
            if not bytes(value[:8]) == b"\x89PNG\r\n\x1a\n":
                raise PackError(f"{where}: field 'mask' is not a PNG (a mask is a single-channel "
                                f"PNG; first bytes {bytes(value[:8])!r})")
            return bytes(value)
        try:
            mask = decode_mask(value)
        except DecodeError as exc:
            raise PackError(f"{where}: field 'mask': {exc}") from None
    else:
        mask = value
    if shrunk is not None:
        (h, w), (h2, w2) = shrunk[1], shrunk[2]
        if mask.shape != (h, w):
            raise PackError(f"{where}: field 'mask' is {mask.shape[:2]} but its image is "
                            f"({h}, {w}) (height, width), so it cannot be resized with it")
        mask = cv2.resize(mask, (w2, h2), interpolation=cv2.INTER_NEAREST)
    ok, out = cv2.imencode(".png", np.ascontiguousarray(mask))
    if not ok:
        raise PackError(f"{where}: field 'mask' could not be encoded as PNG")
    return out.tobytes()


def image_size_of(fields: Sequence[tuple[str, Any]],
                  exif_orientation: bool = False) -> tuple[int, int]:
    """The (height, width) of a sample's image (its first member with an image
    extension, as TarShards picks it by default), from the header, after its
    EXIF orientation with ``exif_orientation``; (-1, -1) when it has none or it
    cannot be read (the sample then fails when it is decoded)."""
    for ext, data in fields:
        if ext in IMAGE_EXTS:
            try:
                return header_size(data, exif_orientation)
            except Exception:  # noqa: BLE001 - reported when the sample is decoded
                return -1, -1
    return -1, -1
    return -1, -1
