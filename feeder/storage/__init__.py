"""Where samples' bytes come from: local files (``local``), tar shards (``tar``:
the offset index in ``tarindex``, the header scan in ``tarscan``; their indices
loaded in ``index``, the member table in ``members``, a sample's members read in
``tarread``, shards opened in ``access``, shard lists in ``shardlist``, a member
as a field in ``fields``), remote objects (``remote`` through fsspec: ``fetch``,
the local ``cache``, HTTP validators in ``http``), and what ``feeder-pack``
reads and writes (``packinput``, ``packsample`` with ``sizes``, ``packout``).
The public faces are :mod:`feeder.sources`, :mod:`feeder.shards` and
:mod:`feeder.pack`."""
