"""feeder.storage.cache: the local cache of remote shards: names inside the folder,
records, lookups that drop damaged or stale entries, the byte bound and LRU
eviction, copies left by dead processes, the entry locks."""

from __future__ import annotations

import json
import os

import pytest

from feeder.storage.cache import DEFAULT_CACHE_BYTES, ShardCache, cache_limit, cache_root
from feeder.storage.http import Validator



def test_eviction_removes_least_recently_used_and_dead_temporaries(tmp_path):
    cache = ShardCache(str(tmp_path), 250)
    for k, name in enumerate(["a", "b", "c"]):
        p = cache.put_bytes(f"http://h/{name}", b"x" * 100)
        os.utime(p, (1000 + k, 1000 + k))
    # put_bytes evicts on each commit: 300 > 250, so "a" (the oldest) went.
    assert cache.lookup("http://h/a") is None
    assert cache.lookup("http://h/b") and cache.lookup("http://h/c")
    cache.touch(cache.lookup("http://h/b"))  # b used now: c is the oldest
    cache.put_bytes("http://h/d", b"y" * 100)
    assert cache.lookup("http://h/c") is None and cache.lookup("http://h/b")
    dead = cache.path("http://h/e") + ".part-999999999-abcd"  # no such process
    mine = cache.temp("http://h/f")
    for p in (dead, mine):
        open(p, "wb").close()
    cache.evict()
    assert not os.path.exists(dead) and os.path.exists(mine)



def test_partial_copies_of_dead_processes_are_removed_at_open(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)
    dead = cache.path("http://h/x.tar") + ".part-999999999-abcd"
    mine = cache.temp("http://h/y.tar")
    for p in (dead, mine):
        with open(p, "wb") as f:
            f.write(b"z" * 1000)
    assert cache.partial_bytes() == 2000
    ShardCache(str(tmp_path), 1 << 20)  # a new run opens the cache
    assert not os.path.exists(dead) and os.path.exists(mine)
    assert cache.partial_bytes() == 1000



def test_cache_names_cannot_escape_the_cache_folder(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)
    for url in ("http://h/../../etc/passwd", "http://h/a/..", "http://h/x\x00y", "http://h/.hidden",
                "http://h/a?b=/../../c"):
        p = cache.path(url)
        assert os.path.dirname(p) == cache.dir and not os.path.basename(p).startswith(".")
        assert "\x00" not in p



def test_cache_root(monkeypatch, tmp_path):
    assert cache_root(False) is None
    assert cache_root(tmp_path) == str(tmp_path)
    monkeypatch.setenv("FEEDER_CACHE", str(tmp_path / "env"))
    assert cache_root(None) == str(tmp_path / "env")
    monkeypatch.delenv("FEEDER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root(None) == str(tmp_path / "xdg" / "feeder")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root(None) == str(tmp_path / "home" / ".cache" / "feeder")


def test_cache_limit(monkeypatch):
    monkeypatch.delenv("FEEDER_CACHE_BYTES", raising=False)
    assert cache_limit(None) == DEFAULT_CACHE_BYTES
    assert cache_limit(0) == 0 and cache_limit(123) == 123
    monkeypatch.setenv("FEEDER_CACHE_BYTES", "2GiB")
    assert cache_limit(None) == 2 << 30
    assert cache_limit(5) == 5  # given wins over the environment
    monkeypatch.setenv("FEEDER_CACHE_BYTES", "lots")
    with pytest.raises(ValueError, match="not a size: 'lots'"):
        cache_limit(None)
    for bad in (-1, True, 1.5, "1GB"):
        with pytest.raises(ValueError, match=f"cache_bytes must be an int >= 0.*got {bad!r}"):
            cache_limit(bad)


def test_path_is_stable_per_url_and_readable(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)
    a = cache.path("https://h/d/train-000001.tar")
    assert a == cache.path("https://h/d/train-000001.tar") and a.endswith("-train-000001.tar")
    # Another URL with the same last name (another folder, another signature): another entry.
    assert cache.path("https://h/e/train-000001.tar") != a
    signed = cache.path("https://h/d/train-000001.tar?sig=abc")
    assert signed != a and signed.endswith("-train-000001.tar")


def test_put_lookup_and_record(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)
    url = "https://h/x.idx"
    assert cache.lookup(url) is None and cache.recorded(url) is None
    p = cache.put_bytes(url, b"hello", Validator(etag='"v1"'), sha256="0" * 64)
    assert open(p, "rb").read() == b"hello" and cache.lookup(url) == p
    # The record merges the size seen with the validator given, and keeps the extras.
    assert cache.recorded(url) == Validator(5, '"v1"', None)
    assert cache.record(p)["sha256"] == "0" * 64 and cache.record(p)["url"] == url
    cache.update_record(p, checked=True)
    assert cache.record(p)["checked"] is True and cache.recorded(url).etag == '"v1"'
    assert cache.lookup(url, expect=Validator(5, '"v1"')) == p
    assert cache.lookup(url, expect=Validator(None, None, "Mon")) == p  # nothing to compare
    assert cache.total_bytes() == 5 and not [f for f in os.listdir(cache.dir) if ".part-" in f]


def test_update_record_without_one_does_nothing(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)
    cache.update_record(cache.path("https://h/none"), checked=True)
    assert os.listdir(cache.meta_dir) == []


@pytest.mark.parametrize("damage, why", [
    ("no record", "has no valid record beside it"),
    ("bad record", "has no valid record beside it"),
    ("other url", "has no valid record beside it"),
    ("cut", "holds 3 bytes, its record says 5"),
    ("new version", "is another version of the file (ETag '\"v1\"' -> '\"v2\"')"),
])
def test_damaged_or_stale_entries_are_removed(tmp_path, caplog, damage, why):
    cache = ShardCache(str(tmp_path), 1 << 20)
    url = "https://h/s.tar"
    p = cache.put_bytes(url, b"12345", Validator(etag='"v1"'))
    meta = cache._meta_path(p)
    expect = None
    if damage == "no record":
        os.unlink(meta)
    elif damage == "bad record":
        with open(meta, "w") as f:
            f.write("{broken")
    elif damage == "other url":
        rec = json.load(open(meta))
        rec["url"] = "https://h/other.tar"
        json.dump(rec, open(meta, "w"))
    elif damage == "cut":
        with open(p, "wb") as f:
            f.write(b"123")
    else:
        expect = Validator(5, '"v2"')
    with caplog.at_level("WARNING", logger="feeder.storage.remote"):
        assert cache.lookup(url, expect=expect) is None
    assert why in caplog.text and url in caplog.text
    if damage == "new version":
        assert '"v1"' in caplog.text and '"v2"' in caplog.text
    assert not os.path.exists(p) and not os.path.exists(meta)


def test_commit_keeps_a_running_total_and_evicts_past_the_bound(tmp_path):
    cache = ShardCache(str(tmp_path), 300)
    for k in range(3):
        p = cache.put_bytes(f"https://h/{k}", b"x" * 100)
        os.utime(p, (1000 + k, 1000 + k))
    assert open(os.path.join(cache.dir, ".total")).read() == "300"
    # Replacing an entry recounts rather than adding its size twice.
    p = cache.put_bytes("https://h/2", b"y" * 100)
    assert cache.total_bytes() == 300 and all(cache.lookup(f"https://h/{k}") for k in range(3))
    # A file larger than the bound is kept (the one just committed); the others go.
    big = cache.put_bytes("https://h/big", b"z" * 400)
    assert cache.lookup("https://h/big") == big and cache.total_bytes() == 400
    assert not any(cache.lookup(f"https://h/{k}") for k in range(3))
    assert open(os.path.join(cache.dir, ".total")).read() == "400"


def test_evict_returns_bytes_removed(tmp_path):
    cache = ShardCache(str(tmp_path), 1000)
    for k in range(4):
        p = cache.put_bytes(f"https://h/{k}", b"x" * 100)
        os.utime(p, (1000 + k, 1000 + k))
    assert cache.evict() == 0
    cache.max_bytes = 150
    assert cache.evict() == 300 and cache.total_bytes() == 100 and cache.lookup("https://h/3")
    cache.max_bytes = 0
    keep = cache.path("https://h/3")
    assert cache.evict(keep=keep) == 0 and os.path.exists(keep)


def test_owning_lock_is_exclusive(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)
    url = "https://h/s.tar"
    with cache.owning(url) as first:
        assert first is True
        with cache.owning(url) as second:
            assert second is False  # another copier holds it
        with cache.owning("https://h/other.tar") as other:
            assert other is True  # one lock per entry
    with cache.owning(url) as again:
        assert again is True  # released when the holder left


def test_remove_and_touch(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)
    p = cache.put_bytes("https://h/a", b"abc")
    os.utime(p, (1000, 1000))
    cache.touch(p)
    assert os.path.getmtime(p) > 1000
    cache.touch(str(tmp_path / "gone"))  # no error for an entry removed meanwhile
    cache.remove("https://h/a")
    assert cache.lookup("https://h/a") is None and os.listdir(cache.meta_dir) == []
    cache.remove("https://h/a")  # twice: no error
