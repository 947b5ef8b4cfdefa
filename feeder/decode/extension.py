"""Loading feeder's optional C extension ``feeder.decode._jpeg`` (the region JPEG
decoder and the CRC-32C of the verified-JPEG memory), once for the modules
that use it."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from ..ops.resize import use_native_draws

#: Setting this environment variable to 1 (before feeder is imported) makes
#: feeder decode JPEGs with simplejpeg even when its extension is built.
NO_EXTENSION_ENV = "FEEDER_NO_JPEG_EXT"

#: What to do to get the extension, for the log line that says it is missing.
HOW_TO_BUILD = ("install libjpeg-turbo's headers and a C compiler (apt-get install gcc libjpeg-dev, "
                 "or libjpeg62-turbo-dev / libjpeg-turbo8-dev; dnf install gcc libjpeg-turbo-devel; "
                 "conda install libjpeg-turbo) and reinstall feeder (pip install -e .)")


def load() -> tuple[Any, str | None]:
    """The region decoder, or None and why it is not used."""
    if os.environ.get(NO_EXTENSION_ENV, "") not in ("", "0"):
        return None, f"{NO_EXTENSION_ENV}={os.environ[NO_EXTENSION_ENV]} is set"
    if importlib.util.find_spec("feeder.decode._jpeg") is None:
        return None, "the extension feeder.decode._jpeg is not built"
    try:
        from . import _jpeg
    except ImportError as exc:  # built, but its libjpeg is gone (or another ABI)
        return None, f"the extension feeder.decode._jpeg could not be loaded ({exc})"
    return _jpeg, None


#: The extension module, or None; and why it is not used (None when it is).
jpeg, missing = load()
# RandomResizedCrop's draws and bilinear resize in C where the extension has them
# (ops is a layer below).
use_native_draws(getattr(jpeg, "rrc_draws", None), getattr(jpeg, "resize", None))
