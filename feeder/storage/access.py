"""A source's shards opened in one process, for :class:`feeder.shards.TarShards`.

:func:`open_shards` makes each shard's object (local shards read through one
:class:`~feeder.storage.local.FilePool`, remote ones through one
:class:`~feeder.storage.remote.RemoteStore`); :func:`release` closes both
(what the source's finalizer and ``close()`` call). :func:`reads_may_block`
and :func:`window_reads_may_block` tell whether reads may wait on a network.
"""

from __future__ import annotations

import os
from typing import Any

from .index import LocalShard
from .local import FilePool, on_network_storage
from .shardlist import is_url
from .tar import COMPRESSED


def release(files: FilePool, store: Any, wait: bool = False) -> None:
    """Stop ``store``'s copies (``wait``: until they stopped) and close ``files``."""
    if store is not None:
        store.close(wait)
    files.close()


def open_shards(names: list[str], remote_options: tuple) -> tuple[FilePool, Any, list[Any]]:
    """``(files, store, shards)``: the descriptors' pool, the remote store (None
    when every shard is local; ``remote_options`` are its arguments after the
    pool) and each shard's object, in order.

    Raises:
        ValueError: a shard is a compressed tar (it cannot be read by offset).
    """
    for name in names:
        if name.lower().endswith(COMPRESSED):
            raise ValueError(f"TarShards: {name} is compressed: a compressed tar cannot be "
                             f"read by offset; decompress it (the images inside are "
                             f"compressed already, so little space is lost)")
    files = FilePool()
    store = None
    shards: list[Any] = []
    for name in names:
        if is_url(name):
            if store is None:
                from .remote import RemoteStore  # noqa: PLC0415 - fsspec only when remote

                store = RemoteStore(files, *remote_options)
            shards.append(store.shard(name))
        else:
            shards.append(LocalShard(name, files))
    return files, store, shards


def note_facts(shards: list[Any], facts: dict[str, dict]) -> None:
    """Give each remote shard what the shard list says of it (its sha256 and size,
    which its copy into the cache is checked against)."""
    for shard in shards:
        fact = facts.get(shard.name, {})
        if shard.remote:
            shard.sha256 = fact.get("sha256")
            shard.list_size = fact.get("filesize")


def reads_may_block(shards: list[Any]) -> bool:
    """Whether a shard is remote or on a network or FUSE file system."""
    return any(s.remote for s in shards) or on_network_storage(
        [os.path.dirname(os.path.abspath(s.name)) for s in shards])


def window_reads_may_block(shards: list[Any], store: Any) -> bool:
    """Whether reads may block once the block shuffle's window is copied: shards
    on a network or FUSE file system, or remote shards not all known to fit the
    cache."""
    return (any(s.remote for s in shards) and (store is None or not store.copies_all(shards))) \
        or on_network_storage([os.path.dirname(os.path.abspath(s.name)) for s in shards
                               if not s.remote])
