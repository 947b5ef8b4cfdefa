"""feeder: keep the GPU busy. A one-process, multi-threaded replacement for
``torch.utils.data.DataLoader`` in image training loops.

    from feeder import Feeder, ImageFolder, ops

    with Feeder(ImageFolder("data/train"), batch_size=256, shuffle=True,
                transforms=[ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()],
                device="cuda") as feeder:
        for images, labels in feeder:
            ...
"""

from . import _moved, ops
from ._consumer import BatchInfo
from ._dataset import FeederDataset
from ._feeder import Feeder
from .engine.stats import MemoryStats, QueueStats, StageStats, Stats
from .engine.batch_dict import Batch
from .decode import jpeg_decoder as _jpeg_decoder
from .sample.rng import SampleRNG
from .sample import check_sample
from .errors import (ConfigError, DecodeError, FeederError, FeederTimeoutError, FieldError, SampleError,
                     SourceError, StageError, TransformError)
from .mixture import Mixture
from .shards import TarShards
from .sources import DatasetSource, FileList, ImageFolder, Source

__all__ = [
    "Batch",
    "BatchInfo",
    "ConfigError",
    "DatasetSource",
    "DecodeError",
    "Feeder",
    "FeederDataset",
    "FeederError",
    "FeederTimeoutError",
    "FieldError",
    "FileList",
    "ImageFolder",
    "MemoryStats",
    "Mixture",
    "QueueStats",
    "SampleError",
    "SampleRNG",
    "Source",
    "SourceError",
    "StageError",
    "StageStats",
    "Stats",
    "TarShards",
    "TransformError",
    "check_sample",
    "info",
    "ops",
]

__version__ = "0.1.0"


def info() -> dict:
    """What this feeder install runs with.

    Returns:
        ``{"version": ..., "jpeg": {...}}``; ``"jpeg"`` says which JPEG decoder
        runs: ``"decoder"`` is ``"feeder.decode._jpeg"`` (the region decoder built
        against the system's libjpeg-turbo, with its ``"libjpeg_turbo"``
        version) or ``"simplejpeg"`` (a whole-image decode before every crop),
        ``"region_decode"`` whether only the crop is decoded, and ``"reason"``
        why the region decoder is not used (None when it is).
    """
    return {"version": __version__, "jpeg": _jpeg_decoder()}


_moved.install()  # the module paths of earlier releases (feeder._decode...) still import
