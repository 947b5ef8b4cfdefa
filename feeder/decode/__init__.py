"""Decoding a sample's bytes, and the decode step that binds it to one
feeder's settings.

``headers`` reads what a file is and how large (before any pixel memory is
allocated); ``image`` decodes it (``decode_image``); ``jpeg`` chooses, per
JPEG, between feeder's region decoder (``extension``, ``region``, with the
memory of files read to their end in ``verified``) and simplejpeg; ``masks``
decodes mask PNGs to their class ids; ``status`` says which JPEG decoder runs;
``step`` holds :class:`~feeder.decode.step.SampleWork`, the decode step.

The names below are those of the former ``feeder.work.decode`` module, which
imports this package.
"""

from __future__ import annotations

import cv2  # noqa: F401 - a name of the former module (tests patch cv2.imdecode through it)
import simplejpeg  # noqa: F401 - likewise

from ..sample import DEFAULT_MAX_PIXELS
from .extension import HOW_TO_BUILD, NO_EXTENSION_ENV
from .extension import jpeg as _jpeg, missing as _jpeg_missing  # the former module's names
from .headers import SUPPORTED_FORMATS, header_size
from .image import DecodeBuffers, buffer_of, decode_image, decode_planned, decode_scale, rgb_of_pixels
from .jpeg import MAX_SCANS, USUAL_SAMPLINGS, JpegDecoder, _simplejpeg_says
from .masks import decode_mask
from .status import jpeg_decoder, note_jpeg_decoder
from .step import SampleWork

__all__ = ["DEFAULT_MAX_PIXELS", "HOW_TO_BUILD", "MAX_SCANS", "NO_EXTENSION_ENV", "SUPPORTED_FORMATS",
           "USUAL_SAMPLINGS", "DecodeBuffers", "JpegDecoder", "SampleWork", "buffer_of",
           "decode_image", "decode_mask", "decode_planned", "decode_scale", "header_size",
           "jpeg_decoder", "note_jpeg_decoder", "rgb_of_pixels"]
