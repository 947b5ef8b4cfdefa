"""``feeder-pack``: write an image dataset into WebDataset tar shards with offset indices.

::

    feeder-pack SOURCE_DIR OUT_DIR [--shard-size 64MB] [--name train] [--max-side N] [--quality Q]
    python -m feeder.pack ...

``SOURCE_DIR`` is an ImageFolder (``root/<class>/**/<image>``) or a file list
(a text file, one ``path [label]`` per line, paths relative to the list's
folder), or ``module:name`` naming any feeder source (``pack(source, ...)``
from Python). Each sample becomes ``<key>.<ext>`` with the image's bytes (``ext`` is
the file's own extension, lower case, or the format's for a source's bytes) and
``<key>.cls`` with the class index in ASCII (no ``.cls`` for unlabeled samples),
keys numbering the samples (``000000042``). A dict sample's other fields become
members too (:func:`sample_members`: ``mask.png``, ``boxes.npy``,
``box_labels.npy``, ``<name>.npy``/``.txt``/``.bin``/``.json``), which
:class:`feeder.TarShards` reads back to the same sample. ``OUT_DIR`` receives:

* ``<name>-000000.tar``, ... (each at most ``--shard-size``, unless one image is larger),
* ``<name>-000000.idx``, ...: the offset index of each shard, in DALI's
  ``wds2idx`` ``v1.2`` format (see :mod:`feeder.storage.tarindex`),
* ``<name>.json``: the shard list (``wids-shard-index-v1``: ``url`` and
  ``nsamples`` per shard) with the class names (``classes``) and the pack's settings.

Output is atomic: a shard is written under a hidden temporary name and renamed
once complete, after its index; the shard list is written last. A pack that is
killed leaves complete shards and a temporary file; running the same command
again removes the temporary file and continues after the last complete shard.
Running it with other settings refuses, naming them (``--overwrite`` starts over).

``--max-side N`` re-encodes images whose longer side exceeds ``N`` down to it
(area interpolation; JPEG and WebP at ``--quality``, PNG losslessly); others
keep their bytes. Re-encoded images lose their metadata (EXIF orientation
included: pixels stay as stored, feeder's default reading). A dict sample's
mask is resized with its image (nearest neighbour, re-encoded as a lossless
PNG: class ids are never blended) and its boxes scaled by the same factors.

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
