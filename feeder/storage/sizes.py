"""Byte sizes written as text (``"64MB"``, ``"1GiB"``): ``feeder-pack``'s
``--shard-size`` and the remote cache's bound (``FEEDER_CACHE_BYTES``)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}

def parse_size(text: str) -> int:
    """``"64MB"`` -> 64000000; ``k``/``M``/``G`` are powers of 1000, ``KiB``/``MiB``/``GiB`` of 1024.

    Raises:
        ValueError: not a positive size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 64MB, 1GiB, 500000)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value
