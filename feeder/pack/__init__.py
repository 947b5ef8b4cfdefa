"""``feeder-pack``: write an image dataset into WebDataset tar shards with offset indices.

::

    feeder-pack SOURCE_DIR OUT_DIR [--shard-size 64MB] [--name train] [--max-side N] [--quality Q]
    python -m feeder.pack ...

``SOURCE_DIR`` is an ImageFolder, a file list (one ``path [label]`` per line) or
``module:name`` naming any feeder source (``pack(source, ...)`` from Python).
``OUT_DIR`` receives the shards (``<name>-000000.tar``...), each with its offset
index in DALI's ``wds2idx`` format (``.idx``), and the shard list
(``<name>.json``), written atomically, so that a killed pack continues where it
stopped; :class:`feeder.TarShards` reads them back to the same samples. The
members, the options and the files: [feeder-pack](../guides/shards.md#feeder-pack)
and [Packing any source](../guides/shards.md#packing-any-source).

The packer is :mod:`feeder.pack.packer`, the command :mod:`feeder.pack.cli`,
what is written to disk :mod:`feeder.storage.packout`.
"""

from __future__ import annotations

# Every name the module gave before it was split stays importable from it.
from ..errors import UserCodeError, call_user, error_line  # noqa: F401
from ..sources import ImageFolder  # noqa: F401
from ..storage.packinput import read_input as _read_input, read_list  # noqa: F401
from ..storage.packout import is_transposed  # noqa: F401
from ..storage.packsample import (  # noqa: F401
    PackError, image_ext, image_size_of, name_sample, sample_members, shrink)
from ..storage.sizes import parse_size
from ..storage.tar import IMAGE_EXTS, ShardIndex, index_path  # noqa: F401
from .cli import build_parser, load_source, main  # noqa: F401
from .packer import PackResult, pack

# With the three helpers the module defined before it was split, so the API
# page lists them as before.
__all__ = ["PackError", "PackResult", "image_ext", "is_transposed", "load_source", "main", "pack",
           "parse_size", "read_list", "sample_members"]
