"""Which JPEG decoder this process runs (:func:`jpeg_decoder`), said once in
the log by the first Feeder (:func:`note_jpeg_decoder`)."""

from __future__ import annotations

import logging
from typing import Any

from . import extension
from .extension import HOW_TO_BUILD, NO_EXTENSION_ENV

log = logging.getLogger(__name__)

__all__ = ["jpeg_decoder", "note_jpeg_decoder"]

_noted = False




def jpeg_decoder() -> dict[str, Any]:
    """Which JPEG decoder feeder uses in this process.

    Returns:
        ``{"decoder": "feeder.decode._jpeg" or "simplejpeg", "region_decode": bool,
        "libjpeg_turbo": version or None, "huffman": "feeder" (its own Huffman
        decoder, with the row index) or "libjpeg-turbo" (the running library's
        entropy-decoder layout is not one it knows) or None, "reason": why the
        extension is not used, or None}``.
    """
    ext, missing = extension.jpeg, extension.missing
    if ext is not None:
        own = getattr(ext, "ENTROPY_LAYOUT", None) is not None
        return {"decoder": "feeder.decode._jpeg", "region_decode": True,
                "libjpeg_turbo": ext.LIBJPEG_TURBO_VERSION,
                "huffman": "feeder" if own else "libjpeg-turbo", "reason": None}
    return {"decoder": "simplejpeg", "region_decode": False, "libjpeg_turbo": None,
            "huffman": None, "reason": missing}


def note_jpeg_decoder() -> None:
    """Log once per process which JPEG decoder runs (called by the first Feeder)."""
    global _noted
    if _noted:
        return
    _noted = True
    ext, missing = extension.jpeg, extension.missing
    if ext is not None:
        log.debug("JPEG decoding: feeder.decode._jpeg (libjpeg-turbo %s), region + DCT-scaled",
                  ext.LIBJPEG_TURBO_VERSION)
    elif missing is not None and missing.startswith(NO_EXTENSION_ENV):
        log.info("JPEG decoding: simplejpeg (whole image before every crop): %s", missing)
    else:
        log.warning("JPEG decoding: simplejpeg, which decodes the whole image before every crop: %s. "
                    "For the faster region decoder, %s.", missing, HOW_TO_BUILD)
