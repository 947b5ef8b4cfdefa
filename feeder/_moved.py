"""The module paths of earlier releases, still importable.

feeder's modules moved from one flat folder into ``engine/``, ``isolation/``,
``work/`` and ``storage/``, and ``work/``'s then into ``sample/``, ``ops/`` and
``decode/``. Code that imported a module by its old name (``feeder._decode``,
``feeder.work.decode``, a monkeypatch target in someone's tests) gets the module
at its new place, the same object, so patching it patches what feeder runs. A
module split in several maps to the one holding its names (a package that
re-exports them).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "feeder._queue": "feeder.engine.queue",
    "feeder._stage": "feeder.engine.stage",
    "feeder._threads": "feeder.engine.threads",
    "feeder._reaper": "feeder.engine.reaper",
    "feeder._stats": "feeder.engine.stats",
    "feeder._tune": "feeder.engine.tune",
    "feeder._sampler": "feeder.engine.sampler",
    "feeder._ranks": "feeder.engine.ranks",
    "feeder._order": "feeder.engine.order",
    "feeder._group": "feeder.engine.group",
    "feeder._read": "feeder.engine.read",
    "feeder._batch": "feeder.engine.batch",
    "feeder._collate": "feeder.engine.collate",
    "feeder._pipeline": "feeder.engine.pipeline",
    "feeder._transfer": "feeder.engine.transfer",
    "feeder._on_device": "feeder.engine.on_device",
    "feeder._work": "feeder.engine.steps",
    "feeder._engine": "feeder.engine.engine",
    "feeder._config": "feeder.engine.config",
    "feeder._sample": "feeder.sample",
    "feeder._rng": "feeder.sample.rng",
    "feeder._decode": "feeder.decode",
    "feeder._region": "feeder.decode.region",
    "feeder._jpeg": "feeder.decode._jpeg",
    "feeder._augment": "feeder.ops.chain",
    "feeder.work.sample": "feeder.sample",
    "feeder.work.rng": "feeder.sample.rng",
    "feeder.work.augment": "feeder.ops.chain",
    "feeder.work.decode": "feeder.decode",
    "feeder.work.region": "feeder.decode.region",
    "feeder.work.verified": "feeder.decode.verified",
    "feeder.work.extension": "feeder.decode.extension",
    "feeder.work._jpeg": "feeder.decode._jpeg",
    "feeder._storage": "feeder.storage.local",
    "feeder._tar": "feeder.storage.tar",
    "feeder._remote": "feeder.storage.remote",
    "feeder._http": "feeder.storage.http",
    "feeder._fetch": "feeder.storage.fetch",
    "feeder._cache": "feeder.storage.cache",
    "feeder._index": "feeder.storage.index",
    "feeder._shardlist": "feeder.storage.shardlist",
    "feeder._fields": "feeder.storage.fields",
    "feeder._packsample": "feeder.storage.packsample",
    "feeder._sizes": "feeder.storage.sizes",
}


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass  # the module ran at its new place


def install() -> None:
    if not any(isinstance(f, _OldNames) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldNames())
