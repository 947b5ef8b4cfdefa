"""The former home of the per-sample modules, kept so that their old paths
import: ``feeder.work.sample`` and ``feeder.work.rng`` are in
:mod:`feeder.sample`, ``feeder.work.augment`` is :mod:`feeder.ops.chain`,
``feeder.work.decode`` (and ``region``, ``verified``, ``extension``,
``_jpeg``) are in :mod:`feeder.decode` (see ``feeder/_moved.py``)."""
