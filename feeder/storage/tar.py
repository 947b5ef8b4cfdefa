"""Tar shards in the WebDataset layout: member names, header scanning, offset index.

A sample is the run of tar members that share a *key*: the member's path up to
the first dot of its file name (``train/n0144_12.seg.png`` has key
``train/n0144_12`` and extension ``seg.png``). Extensions name the fields
(``jpg``, ``png``, ``cls``, ``json``...); they are compared in lower case.

The offset index (:class:`ShardIndex`, DALI's ``wds2idx`` format) is in
:mod:`feeder.storage.tarindex`, the scan of a shard without one (:func:`scan`)
in :mod:`feeder.storage.tarscan`; this module gathers their names with the
bounds on what is read whole.
"""

from __future__ import annotations

import logging
import os

# The names of both modules, importable from here as before they were split.
from .tarindex import (  # noqa: F401
    INDEX_VERSION, SHARD_SIZE_LINE, SIZES_LINE, TRANSPOSED_LINE, ShardFormatError, ShardIndex,
    decode_bits, decode_image_sizes, encode_image_sizes, index_path, split_name)
from .tarscan import (  # noqa: F401
    BLOCK, CHECKED_MEMBERS, MAX_RECORD_BYTES, Scanned, index_mismatch, scan, scan_members)

log = logging.getLogger(__name__)

COMPRESSED = (".gz", ".tgz", ".bz2", ".xz", ".zst", ".lz4")

# Bounds on files read whole into memory, local or remote (bytes): a shard's
# index (about 50 bytes a sample), a shard list.
MAX_INDEX_BYTES = 256 << 20
MAX_LIST_BYTES = 1 << 30


def read_bounded(path: str, limit: int, what: str) -> bytes:
    """The bytes of the local file ``path``, refused past ``limit`` bytes (a
    ShardFormatError naming it) before they are read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise ShardFormatError(f"{path}: {max(size, len(data))} bytes, more than the {limit} "
                               f"a {what} may hold: not a {what} feeder reads")
    return data


#: The member extensions that hold a sample's image (TarShards' default ``image_exts``).
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "pnm", "tif", "tiff", "gif")
