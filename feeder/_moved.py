"""The module paths of earlier releases, importable for one more release.

feeder's modules moved from one flat folder into packages (``engine/``,
``order/``, ``isolation/``, ``storage/``; ``work/``'s then into ``sample/``,
``ops/`` and ``decode/``). Code that imported a private module by its old name
(``feeder._decode``, ``feeder.work.decode``, a monkeypatch target in someone's
tests) gets the module at its new place, the same object, so patching it
patches what feeder runs, with a ``DeprecationWarning`` naming the new place.
A module split in several maps to the one holding its names (a package that
re-exports them). The old names go in the next release (see the changelog).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "feeder._queue": "feeder.engine.queue",
    "feeder._stage": "feeder.engine.stage",
    "feeder._threads": "feeder.engine.threads",
    "feeder._reaper": "feeder.engine.reaper",
    "feeder._stats": "feeder.engine.stats",
    "feeder._tune": "feeder.engine.tune",
    "feeder._sampler": "feeder.engine.sampler",
    "feeder._ranks": "feeder.engine.ranks",
    "feeder._order": "feeder.order.sequence",
    "feeder._group": "feeder.order.group",
    "feeder.engine.order": "feeder.order.sequence",
    "feeder.engine.group": "feeder.order.group",
    "feeder._resume": "feeder.order.cursor",
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
        warnings.warn(f"{spec.name} is now {MOVED[spec.name]}: the old name goes in feeder's next "
                      f"release", DeprecationWarning, stacklevel=2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass  # the module ran at its new place


def install() -> None:
    if not any(isinstance(f, _OldNames) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldNames())
