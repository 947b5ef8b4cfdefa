"""feeder: keep the GPU busy. A one-process, multi-threaded replacement for
``torch.utils.data.DataLoader`` in image training loops.

    from feeder import Feeder, ImageFolder, ops

    with Feeder(ImageFolder("data/train"), batch_size=256,
                transforms=[ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()],
                device="cuda") as feeder:
        for images, labels in feeder:
            ...
"""

from . import ops
from ._feeder import BatchInfo, Feeder
from ._rng import SampleRNG
from ._sample import check_sample
from ._stats import QueueStats, StageStats, Stats
from .errors import (ConfigError, DecodeError, FeederError, FeederTimeoutError, FieldError, SampleError,
                     SourceError, StageError, TransformError)
from .shards import TarShards
from .sources import FileList, ImageFolder, Source

__all__ = [
    "BatchInfo",
    "ConfigError",
    "DecodeError",
    "Feeder",
    "FeederError",
    "FeederTimeoutError",
    "FieldError",
    "FileList",
    "ImageFolder",
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
    "ops",
]

__version__ = "0.1.0"
