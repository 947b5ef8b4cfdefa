"""How a shard member becomes a field of a dict sample: its name from its
extension (:func:`field_of`, the table in :mod:`feeder.shards`) and the decoding
of the ``.npy`` and ``.json`` formats, bounded by the member's own bytes."""

from __future__ import annotations

import ast
import io
import struct
import json
import re
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from .tar import IMAGE_EXTS

# Members whose name is not the rule's (see field_of): the image, the label
# and the mask. A JPEG mask is not among them: JPEG blends class ids.
FIELD_NAMES = {
    **{ext: "image" for ext in IMAGE_EXTS},
    "cls": "label",
    "seg.png": "mask", "mask.png": "mask",
}

# How each format's bytes become a value (see _decode_field).
_FORMATS = ("npy", "json", "txt", "cls", "bin")


def field_of(ext: str, label: str | None = "cls") -> tuple[str, str]:
    """``(field name, format)`` of a shard member with extension ``ext``.

    The format (``"npy"``, ``"json"``, ``"txt"``, ``"cls"``, or ``"bytes"``)
    says how its bytes are decoded; ``label`` is the extension holding the
    class index (the ``"label"`` field).
    """
    if ext == label:
        return "label", "cls"
    special = FIELD_NAMES.get(ext)
    if special is not None and special != "label":
        return special, "bytes"
    name, dot, fmt = ext.rpartition(".")
    if fmt in _FORMATS:
        return (name if dot else fmt), ("bytes" if fmt == "bin" else fmt)
    return ext, "bytes"


#: The deepest nesting of a JSON field's arrays and objects.
MAX_JSON_DEPTH = 200
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


def json_value(raw: bytes) -> Any:
    """A JSON field's value. Nesting deeper than :data:`MAX_JSON_DEPTH` raises
    RecursionError before the parser runs, which the caller reports as a bad
    field, naming it: the parser would recurse to the interpreter's limit, where
    any finalizer the garbage collector runs meanwhile (in any of feeder's
    threads) fails for want of stack."""
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        depth = _json_depth(raw)
        if depth > MAX_JSON_DEPTH:
            raise RecursionError(f"nested {depth} levels deep, more than the {MAX_JSON_DEPTH} a "
                                 f"field may be")
    return json.loads(raw)


def _json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (strings left out)."""
    codes = np.frombuffer(_JSON_STRING.sub(b"", raw), np.uint8)
    steps = (np.isin(codes, (ord("["), ord("{"))).astype(np.int64)
             - np.isin(codes, (ord("]"), ord("}"))))
    return int(np.cumsum(steps).max(initial=0))


# numpy's own bound on a .npy header (its max_header_size).
_MAX_NPY_HEADER = 10000
# The header as numpy writes it: keys sorted, one ", " after each value, padded
# with spaces to a line. Read by this pattern, without Python's parser.
_NUMPY_HEADER = re.compile(
    r"\{'descr': '([^'\\]*)', 'fortran_order': (True|False), 'shape': \(((?:\d+, )*(?:\d+,?)?)\), \}"
    r"[ \n\x00]*\Z")
# ast builds its trees with interpreter-wide recursion bookkeeping that threads
# parsing at once can break (CPython 3.11 raises "SystemError: AST constructor
# recursion depth mismatch"): feeder's threads take turns on the rare header
# that needs the parser (a structured dtype, another writer's spacing).
_AST_LOCK = threading.Lock()


def _parse_header(text: str) -> tuple[tuple[int, ...], bool, Any]:
    """``(shape, fortran_order, descr)`` of a ``.npy`` header's text, each checked."""
    m = _NUMPY_HEADER.match(text)
    if m is not None:
        descr, fortran, dims = m.groups()
        return tuple(int(n) for n in dims.split(",") if n.strip()), fortran == "True", descr
    try:
        with _AST_LOCK:
            d = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"a header that is not a Python literal ({type(exc).__name__})") from None
    if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
        raise ValueError("a header without exactly descr, fortran_order and shape")
    shape, fortran = d["shape"], d["fortran_order"]
    if (not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape)
            or not isinstance(fortran, bool)):
        raise ValueError(f"a header with shape {shape!r} and fortran_order {fortran!r}")
    return shape, fortran, d["descr"]


def _read_header(buf: io.BytesIO, major: int) -> tuple[tuple[int, ...], bool, np.dtype]:
    """A ``.npy`` header of version ``major`` (1: a 2-byte length and Latin-1 text;
    2: a 4-byte length; 3: UTF-8 text), read as numpy reads it but in every
    thread at once: its length bounded, its text a literal read without
    evaluating code."""
    width, fmt, encoding = (2, "<H", "latin1") if major == 1 else (4, "<I", "latin1" if major == 2 else "utf-8")
    head = buf.read(width)
    if len(head) != width:
        raise ValueError("cut inside its header")
    (size,) = struct.unpack(fmt, head)
    if size > _MAX_NPY_HEADER:
        raise ValueError(f"a header of {size} bytes (at most {_MAX_NPY_HEADER})")
    text = buf.read(size)
    if len(text) != size:
        raise ValueError("cut inside its header")
    try:
        shape, fortran, descr = _parse_header(text.decode(encoding))
    except UnicodeDecodeError:
        raise ValueError("a header that is not UTF-8 text") from None
    try:
        dtype = np.lib.format.descr_to_dtype(descr)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a header with dtype {descr!r}: {exc}") from None
    return shape, fortran, dtype


def npy_array(raw: bytes) -> np.ndarray:
    """One ``.npy`` array from its bytes: the header's shape and dtype are checked
    against the bytes that follow before anything is allocated (``np.load``
    allocates what the header claims first); object arrays (pickles) are refused."""
    buf = io.BytesIO(raw)
    try:
        major, minor = np.lib.format.read_magic(buf)
    except ValueError:
        if raw[:2] == b"PK":
            raise ValueError("an .npz archive, not one .npy array") from None
        raise
    if (major, minor) not in ((1, 0), (2, 0), (3, 0)):
        raise ValueError(f"unknown .npy version {major}.{minor}")
    shape, fortran, dtype = _read_header(buf, major)
    if dtype.hasobject:
        raise ValueError("an object array (a pickle): refused")
    count = 1
    for d in shape:
        count *= int(d)
    need = count * dtype.itemsize
    have = len(raw) - buf.tell()
    if need != have:
        raise ValueError(f"its header claims shape {tuple(shape)} of {dtype} ({need} bytes) but "
                         f"{have} bytes follow")
    arr = np.frombuffer(raw, dtype=dtype, count=count, offset=buf.tell())
    arr = arr.reshape(shape[::-1]).transpose() if fortran else arr.reshape(shape)
    if not arr.dtype.isnative:  # torch takes native byte order only
        arr = arr.astype(arr.dtype.newbyteorder("="))
    else:
        arr = arr.copy()  # writable, and not a view holding the shard's bytes
    return arr


def make_plan(fields: Any, exts_seen: set[str], found: str, image_exts: tuple[str, ...],
              label: str | None, where: str) -> dict[str, tuple[str, str]] | None:
    """What ``TarShards(fields=)`` reads of a dict sample: ``{extension: (field name,
    format)}``, or None for ``(image, label)`` pairs; checked against the
    extensions the shards hold (``exts_seen``, listed as ``found``; ``where``
    names the shards in errors).

    Raises:
        ValueError, TypeError: a ``fields`` that cannot be read as asked.
    """
    images = set(image_exts)
    if fields is None:
        return None
    if isinstance(fields, str):
        if fields != "auto":
            raise ValueError(f"TarShards: fields={fields!r}: give 'auto', None, a list of "
                             f"extensions or a mapping {{extension: field name}}")
        rest = sorted(e for e in exts_seen if e not in images and e != label
                      and not (label is None and e == "cls"))
        if not rest:
            return None
        plan = {e: field_of(e, label) for e in rest}
        if label is not None and label in exts_seen:
            plan[label] = ("label", "cls")
    else:
        if isinstance(fields, dict):
            pairs = [(str(e).lower().lstrip("."), name) for e, name in fields.items()]
        elif isinstance(fields, Iterable):
            pairs = [(str(e).lower().lstrip("."), None) for e in fields]
        else:
            raise TypeError(f"TarShards: fields={fields!r}: give 'auto', None, a list of "
                            f"extensions or a mapping {{extension: field name}}")
        plan = {}
        for ext, name in pairs:
            if ext in images:
                raise ValueError(f"TarShards: fields names .{ext}, an image field: the image "
                                 f"is the first of image_exts present, always read as \"image\"")
            if ext not in exts_seen:
                raise ValueError(f"TarShards: fields names .{ext} but no sample in "
                                 f"{where} has it; fields found: {found}")
            default, fmt = field_of(ext, label)
            if name is not None and not (isinstance(name, str) and name):
                raise TypeError(f"TarShards: fields[{ext!r}] = {name!r}: a field name is a "
                                f"non-empty str")
            if name == "*" and fmt != "json":
                raise ValueError(f"TarShards: fields[{ext!r}] = '*' spreads a JSON object's "
                                 f"keys; .{ext} is not JSON")
            plan[ext] = (name or default, fmt)
    seen: dict[str, str] = {}
    for ext, (name, _) in plan.items():
        if name == "image":
            raise ValueError(f"TarShards: the field .{ext} would be named \"image\", the "
                             f"image's name; give fields={{{ext!r}: '<another name>'}}")
        if name in seen and name != "*":
            raise ValueError(f"TarShards: the fields .{seen[name]} and .{ext} would both be "
                             f"named {name!r}; give fields= to choose (a list of extensions "
                             f"or {{extension: field name}})")
        seen[name] = ext
    return plan
