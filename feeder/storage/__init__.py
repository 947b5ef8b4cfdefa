"""Where samples' bytes come from: local files (``local``), tar shards
(``tar``, their indices in ``index``, shard lists in ``shardlist``, a member as a
field in ``fields``), remote objects (``remote`` through fsspec: ``fetch``, the
local ``cache``, HTTP validators in ``http``), and what ``feeder-pack`` writes
for one sample (``packsample``, with ``sizes``). The public faces are
:mod:`feeder.sources` and :mod:`feeder.shards`."""
