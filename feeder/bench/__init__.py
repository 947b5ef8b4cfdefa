"""feeder's benchmark suite: ``feeder-bench`` / ``python -m feeder.bench``.

Subcommands: ``make-data``, ``compare``, ``ceiling``, ``sweep``, ``scaled-decode``,
``overlap``, ``read-latency``, ``remote``, ``shards``, ``interference``
(see ``bench/README.md``). Needs the ``bench`` extra for the PIL baseline, and
matplotlib for plots; tables, CSV and JSON work without either.
"""

from .cli import main

__all__ = ["main"]
