"""Untrusted storage: every remote answer, copy, cache entry, shard list and
member size is checked against what it claims before its bytes become a sample.

Each test puts feeder in front of one way storage goes wrong (a server that
ignores ``Range``, a proxy that cuts bodies, a shard re-published under the
same URL, a damaged cache, hostile shard lists and payloads, leaks) and asserts
the outcome: the right bytes, or an error naming the file, and never a hang.
The server is feeder's own loopback HTTP server (see ``tests/storage/test_remote.py``
for why), with ``ETag``/``Last-Modified`` as nginx sends them.

The file is named to run after the start-method tests: fsspec's event-loop
thread, started here, lives as long as the process, and a running thread makes
``start_method="auto"`` spawn.
"""

from __future__ import annotations

import gc
import io
import json
import logging
import os
import shutil
import tarfile
import threading
import time

import numpy as np
import pytest

from feeder import Feeder, SampleError, ops
from feeder.storage.fetch import remote_index_url
from feeder.storage.remote import RemoteError, ShardCache, ShardChangedError
from feeder.storage.tar import ShardFormatError
from feeder.shards import TarShards

from tests.support import JOIN_TIMEOUT_S, drain, labels_of, run_in_thread

T = JOIN_TIMEOUT_S


def _tree(packed, tmp_path, name="srv", index=True):
    """A private copy of the packed shards to serve (tests change files in it)."""
    out, n = packed
    d = tmp_path / name
    d.mkdir()
    for f in os.listdir(out):
        if index or not f.endswith(".idx"):
            shutil.copy2(os.path.join(out, f), d / f)
    return d, n


def _pattern(srv, n):
    return srv.url + "/train-{000000..%06d}.tar" % (n - 1)


def _all(src):
    return [src.read(i) for i in range(len(src))]


# -- a server that ignores ranges ------------------------------------------------

@pytest.mark.parametrize("cache", [True, False])
def test_server_ignoring_ranges_gives_the_right_bytes(packed, tmp_path, caplog, cache, file_server):
    out, _ = packed
    d, n = _tree(packed, tmp_path)
    local = _all(TarShards(out))
    with file_server(d, ignore_ranges=True) as srv:
        cache_dir = str(tmp_path / "cache") if cache else False
        with caplog.at_level(logging.WARNING, logger="feeder.storage.remote"):
            with TarShards(_pattern(srv, n), cache_dir=cache_dir, backoff_s=0.01) as src:
                assert _all(src) == local  # byte for byte, every sample
                told = [r for r in caplog.records if "ignores range requests" in r.getMessage()]
                # Said once per shard's first read, not once per sample.
                assert 1 <= len(told) <= n
                # Each shard was copied whole about once (the first range answer, then the copy).
                whole = srv.count(lambda r: r.method == "GET" and r.path.endswith(".tar"))
                assert whole <= 3 * n
        if not cache:
            assert not [f for f in os.listdir(tmp_path) if f.startswith("feeder-shard-")]


def test_feeder_over_a_range_ignoring_server_delivers_every_sample_once(packed, tmp_path, file_server):
    d, n = _tree(packed, tmp_path)
    with file_server(d, ignore_ranges=True) as srv:
        with TarShards(_pattern(srv, n), cache_dir=str(tmp_path / "c"), backoff_s=0.01) as src:
            with Feeder(src, 8, [ops.Resize(24), ops.CenterCrop(16)], seed=1) as f:
                batches, err = drain(f)
    assert err is None, err
    assert sorted(labels_of(batches)) == list(range(60))


# -- cut copies --------------------------------------------------------------------

def test_a_copy_cut_with_a_matching_length_is_never_cached(packed, tmp_path, file_server):
    """A proxy cuts the whole-shard copy and its Content-Length alike: the copy is
    checked against the shard's size (learned from the range answers) and fetched
    again; the cache never holds the cut copy."""
    out, _ = packed
    d, n = _tree(packed, tmp_path)
    local = TarShards(out)
    with file_server(d) as srv:
        srv.fail("train-000000.tar", "shortlen", whole=True)
        with TarShards(_pattern(srv, n), cache_dir=str(tmp_path / "c"), backoff_s=0.01) as src:
            assert src.read(0) == local.read(0)  # by range; the copy starts behind it
            assert src.wait_downloads(T)
            assert _all(src) == _all(local)
            copies = [r.status for r in srv.requests
                      if r.path == "/train-000000.tar" and r.method == "GET" and r.range is None]
            assert copies == [200, 200]  # the cut copy, then the whole one
        entry = ShardCache(str(tmp_path / "c"), 1 << 30).lookup(f"{srv.url}/train-000000.tar")
        assert open(entry, "rb").read() == open(os.path.join(out, "train-000000.tar"), "rb").read()


def test_a_cut_range_answer_is_read_again(packed, tmp_path, file_server):
    out, _ = packed
    d, n = _tree(packed, tmp_path)
    local = TarShards(out)
    with file_server(d) as srv:
        with TarShards(_pattern(srv, n), cache_dir=False, backoff_s=0.01) as src:
            srv.fail("train-000003.tar", "shortlen")
            first = src.shard_ranges()[3][0]
            assert src.read(first) == local.read(first)
            tries = [r.status for r in srv.requests if r.path == "/train-000003.tar"]
            assert tries == [206, 206]


def test_a_cut_copy_of_a_shard_without_index_is_fetched_again(packed, tmp_path, file_server):
    out, _ = packed
    d, _ = _tree(packed, tmp_path, index=False)
    local = TarShards(os.path.join(out, "train-000001.tar"))
    with file_server(d) as srv:
        url = srv.url + "/train-000001.tar"
        # The list says how large the shard is and what it hashes to: the cut
        # copy (with a matching Content-Length) fails those checks and is retried.
        listing = {"shardlist": [{"url": "train-000001.tar", "nsamples": len(local),
                                  "filesize": os.path.getsize(os.path.join(out, "train-000001.tar"))}]}
        (d / "one.json").write_text(json.dumps(listing))
        srv.fail("train-000001.tar", "shortlen", whole=True)
        with TarShards(srv.url + "/one.json", cache_dir=str(tmp_path / "c"), backoff_s=0.01) as src:
            assert _all(src) == _all(local)
        gets = [r.status for r in srv.requests if r.path == "/train-000001.tar" and r.method == "GET"]
        assert gets[:2] == [200, 200]  # the cut copy, then the whole one
        # Without a list, the cut copy's missing tar end marker gives it away: an
        # error naming the shard, and no cache entry left behind.
        srv.fail("train-000001.tar", "shortlen", whole=True)
        with pytest.raises(ShardFormatError, match=r"train-000001\.tar.*(end-of-archive|inside member)"):
            TarShards(url, cache_dir=str(tmp_path / "c2"), backoff_s=0.01)
        cache = ShardCache(str(tmp_path / "c2"), 1 << 30)
        assert cache.lookup(url) is None


def test_copy_whose_hash_differs_from_the_list_is_refused(packed, tmp_path, file_server):
    out, _ = packed
    d, _ = _tree(packed, tmp_path)
    doc = json.loads(open(os.path.join(out, "train.json")).read())
    entry = doc["shardlist"][0]
    assert len(entry["sha256"]) == 64 and entry["filesize"] > 0  # feeder-pack writes both
    entry["sha256"] = "0" * 64
    (d / "bad.json").write_text(json.dumps(doc))
    with file_server(d) as srv:
        with TarShards(srv.url + "/bad.json", cache_dir=str(tmp_path / "c"), retries=1,
                       backoff_s=0.01) as src:
            src.read(0)  # by range, while the copy is checked
            assert src.wait_downloads(T)
            with pytest.raises(ShardChangedError, match=r"train-000000\.tar.*sha256"):
                src.read(1)
            assert ShardCache(str(tmp_path / "c"), 1 << 30).lookup(src.shards[0]) is None


# -- re-published shards -------------------------------------------------------------

def _republish(d, name, other):
    """Replace shard ``name`` (and its index) in the served tree by shard ``other``'s."""
    for ext in (".tar", ".idx"):
        tmp = d / f".{name}{ext}"
        shutil.copy(d / f"{other}{ext}", tmp)
        os.replace(tmp, d / f"{name}{ext}")
    st = os.stat(d / f"{name}.tar")
    os.utime(d / f"{name}.tar", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_a_shard_republished_mid_run_is_reported_not_read_with_old_offsets(packed, tmp_path, file_server):
    out, _ = packed
    d, n = _tree(packed, tmp_path)
    local = TarShards(out)
    with file_server(d) as srv:
        with TarShards(_pattern(srv, n), cache_dir=False, backoff_s=0.01) as src:
            assert src.read(0) == local.read(0)
            _republish(d, "train-000000", "train-000002")
            with pytest.raises(ShardChangedError, match=r"train-000000\.tar.*re-published"):
                src.read(1)
            # Through a feeder: the sample is named; skip counts the shard's samples.
            first, stop = src.shard_ranges()[0]
            with Feeder(src, 8, [ops.Resize(24), ops.CenterCrop(16)], on_error="skip") as f:
                got = labels_of(drain(f)[0])
                stats = f.stats()
            assert sorted(got) == sorted(set(range(60)) - set(range(first, stop)))
            assert stats.skipped == stop - first
        # Built again, the source indexes the shard as it is now.
        with TarShards(_pattern(srv, n), cache_dir=False) as src:
            assert len(src) == len(local) - (stop - first) + len(TarShards(os.path.join(out, "train-000002.tar")))
            assert src.read(0) == TarShards(os.path.join(out, "train-000002.tar")).read(0)


def test_a_new_run_with_a_cached_index_sees_the_republished_shard(packed, tmp_path, file_server):
    """The index is cached with the version of the shard it was read against; the
    next run, reading the shard by range, compares: old offsets are never used on
    new bytes, and the stale index leaves the cache."""
    out, _ = packed
    d, n = _tree(packed, tmp_path)
    cache = str(tmp_path / "c")
    with file_server(d) as srv:
        # cache_bytes fits the indices (with their image sizes) but not the shards: reads stay by range.
        with TarShards(_pattern(srv, n), cache_dir=cache, cache_bytes=8000) as src:
            src.read(0)
            assert src.wait_downloads(T)
        _republish(d, "train-000000", "train-000002")
        with TarShards(_pattern(srv, n), cache_dir=cache, cache_bytes=8000) as src:
            with pytest.raises(ShardChangedError, match=r"train-000000\.tar"):
                src.read(0)
        with TarShards(_pattern(srv, n), cache_dir=cache, cache_bytes=8000) as src:
            assert src.read(0) == TarShards(os.path.join(out, "train-000002.tar")).read(0)


def _smaller_shard(out, samples=1):
    """``(k, shard k's name, a larger shard's name, their sizes)``: the first shard
    of at least ``samples`` samples that some other shard is larger than."""
    local = TarShards(out)
    names = [os.path.basename(p)[:-4] for p in local.shards]
    sizes = [os.path.getsize(p) for p in local.shards]
    k = next(k for k, (a, b) in enumerate(local.shard_ranges())
             if b - a >= samples and sizes[k] < max(sizes))
    big = sizes.index(max(sizes))
    return k, names[k], names[big], sizes[k], sizes[big]


def _swap_bytes(d, name, other):
    """Shard ``name``'s bytes replaced by shard ``other``'s, its index left as it was."""
    shutil.copy(d / f"{other}.tar", d / ".swap")
    os.replace(d / ".swap", d / f"{name}.tar")


@pytest.mark.parametrize("cache", [False, True])
def test_a_shard_republished_before_its_first_read_without_validators_is_an_error(
        packed, tmp_path, cache, file_server):
    """A server that sends no ETag or Last-Modified, and a shard re-published
    between the source's construction and its first read: the first answer's
    size is checked against the size the index was made from, so every sample
    of the shard is an error naming the URL and both sizes, never another
    shard's sample under this one's number."""
    out, _ = packed
    d, n = _tree(packed, tmp_path)
    k, victim, other, size, other_size = _smaller_shard(out)
    with file_server(d, validators=False) as srv:
        with TarShards(_pattern(srv, n), cache_dir=str(tmp_path / "c") if cache else False,
                       backoff_s=0.01) as src:
            first, stop = src.shard_ranges()[k]
            _swap_bytes(d, victim, other)
            for i in range(first, stop):
                with pytest.raises(ShardChangedError,
                                   match=rf"{victim}\.tar: the server says it holds "
                                         rf"{other_size} bytes, but its index was made "
                                         rf"from a shard of {size} bytes"):
                    src.read(i)


def test_a_range_answer_of_another_size_mid_run_is_a_changed_shard(packed, tmp_path, file_server):
    """Without validators, a later range answer whose total differs from the
    first's is the shard re-published: a ShardChangedError naming both sizes,
    not a transient cut retried and reported as one."""
    out, _ = packed
    d, n = _tree(packed, tmp_path)
    k, victim, other, size, other_size = _smaller_shard(out, samples=2)
    idx = d / f"{victim}.idx"
    idx.write_text("".join(line for line in idx.read_text().splitlines(True)  # another tool's:
                           if not line.startswith("#")))  # no shard size
    with file_server(d, validators=False) as srv:
        with TarShards(_pattern(srv, n), cache_dir=False, backoff_s=0.01) as src:
            first, _ = src.shard_ranges()[k]
            assert src.read(first)[1] == first
            _swap_bytes(d, victim, other)
            with pytest.raises(ShardChangedError, match=rf"{victim}\.tar: the server says it "
                                                        rf"holds {other_size} bytes, but it held "
                                                        rf"{size}"):
                src.read(first + 1)


@pytest.mark.parametrize("listed", [False, True])
def test_a_cached_copy_is_not_read_with_the_index_of_a_newer_version(packed, tmp_path, caplog, listed, file_server):
    """The cache kept a shard's copy but not its index (evicted first), and the shard
    was re-published since: the next run fetches the new index, and must not read
    the old copy at its offsets. With a shard list, its sha256 tells; without one,
    the server is asked which version it serves."""
    out, _ = packed
    d, n = _tree(packed, tmp_path)
    cache_dir = str(tmp_path / "c")
    with file_server(d) as srv:
        url = srv.url + "/train.json" if listed else _pattern(srv, n)
        with TarShards(url, cache_dir=cache_dir) as src:
            _all(src)
            assert src.wait_downloads(T)
            shard0 = src.shards[0]
        cache = ShardCache(cache_dir, 1 << 30)
        cache.remove(remote_index_url(shard0))  # as the cache's eviction may do
        assert cache.lookup(shard0) is not None
        _republish(d, "train-000000", "train-000002")
        if listed:  # the list re-written with the shards, as feeder-pack would
            doc = json.loads((d / "train.json").read_text())
            doc["shardlist"][0].update({k: doc["shardlist"][2][k]
                                        for k in ("nsamples", "filesize", "sha256")})
            (d / "train.json").write_text(json.dumps(doc))
        want = TarShards(os.path.join(out, "train-000002.tar"))
        with caplog.at_level(logging.WARNING, logger="feeder.storage.remote"):
            with TarShards(url, cache_dir=cache_dir) as src:
                assert [src.read(i) for i in range(len(want))] == _all(want)
        assert ("another version" in caplog.text or "the shard list says" in caplog.text
                or "its index was made from a shard of" in caplog.text)


def test_a_local_shard_replaced_under_its_old_index_is_indexed_again(packed, tmp_path, caplog):
    """A shard replaced by a copy that keeps its timestamps (cp -p, rsync -a), its old
    index left beside it: the index's headers do not match, so the shard is indexed
    from its own headers (with a warning), and its samples are the new ones."""
    out, _ = packed
    d, _ = _tree(packed, tmp_path)
    old_index = (d / "train-000000.idx").read_bytes()
    stamp = os.stat(d / "train-000000.tar").st_mtime_ns
    shutil.copy(d / "train-000002.tar", d / "train-000000.tar")
    os.utime(d / "train-000000.tar", ns=(stamp, stamp))  # the copy kept the old shard's time
    (d / "train-000000.idx").write_bytes(old_index)
    want = _all(TarShards(os.path.join(out, "train-000002.tar")))
    with caplog.at_level(logging.WARNING, logger="feeder.shards"):
        src = TarShards(str(d / "train-000000.tar"))
    assert _all(src) == want
    assert any("does not describe" in w and "train-000000.tar" in w for w in src.warnings)


@pytest.mark.parametrize("kind", ["index", "list"])
def test_local_index_and_list_files_are_bounded(packed, tmp_path, kind):
    """A local .idx or shard list is refused past its bound (256 MiB, 1 GiB) before
    it is read, as a remote one is (a sparse file: no disk used)."""
    d, _ = _tree(packed, tmp_path)
    path = d / ("train-000000.idx" if kind == "index" else "train.json")
    with open(path, "r+b") as f:
        f.truncate((3 << 30) if kind == "list" else (300 << 20))
    os.utime(d / "train-000000.idx", ns=(time.time_ns() + 10**10,) * 2)  # the index is the newer
    what = "shard index" if kind == "index" else "shard list"
    with pytest.raises(ShardFormatError, match=rf"{path.name}: \d+ bytes, more than the \d+ a {what} may hold"):
        run_in_thread(lambda: TarShards(str(d / "train.json") if kind == "list"
                                        else str(d / "train-000000.tar")))


# -- damaged cache entries ---------------------------------------------------------------

def test_a_truncated_cache_entry_is_fetched_again(packed, tmp_path, file_server):
    out, _ = packed
    d, n = _tree(packed, tmp_path)
    cache_dir = str(tmp_path / "c")
    local = _all(TarShards(out))
    with file_server(d) as srv:
        with TarShards(_pattern(srv, n), cache_dir=cache_dir) as src:
            assert _all(src) == local and src.wait_downloads(T)
            shard0 = src.shards[0]
        cache = ShardCache(cache_dir, 1 << 30)
        entry = cache.lookup(shard0)
        assert entry is not None
        with open(entry, "r+b") as f:  # damaged outside feeder
            f.truncate(os.path.getsize(entry) // 2)
        srv.reset_counts()
        with TarShards(_pattern(srv, n), cache_dir=cache_dir) as src:
            assert _all(src) == local
            assert src.wait_downloads(T)
        assert srv.count(lambda r: r.path == "/train-000000.tar") >= 1  # fetched again
        assert open(cache.lookup(shard0), "rb").read() == open(os.path.join(out, "train-000000.tar"), "rb").read()


def test_a_cache_entry_damaged_while_in_use_is_replaced_once(packed, tmp_path, file_server):
    out, _ = packed
    d, n = _tree(packed, tmp_path)
    local = _all(TarShards(out))
    with file_server(d) as srv:
        with TarShards(_pattern(srv, n), cache_dir=str(tmp_path / "c")) as src:
            assert _all(src) == local and src.wait_downloads(T)
            entry = ShardCache(str(tmp_path / "c"), 1 << 30).lookup(src.shards[0])
            with open(entry, "r+b") as f:
                f.truncate(100)
            assert _all(src) == local  # the short read is noticed, the shard read again


# -- hostile shard lists ----------------------------------------------------------------

@pytest.mark.parametrize("entry", ["/etc/passwd", "file:///etc/passwd", "~/x.tar", "c:x.tar"])
def test_a_remote_list_may_not_name_local_files(packed, tmp_path, entry, file_server):
    d, _ = _tree(packed, tmp_path)
    (d / "evil.json").write_text(json.dumps({"shardlist": [{"url": entry}]}))
    with file_server(d) as srv:
        with pytest.raises(ShardFormatError, match=r"evil\.json.*(local file|not a relative name)"):
            TarShards(srv.url + "/evil.json", cache_dir=False)


def test_remote_list_entries_resolve_against_the_list(packed, tmp_path, jpeg_blobs, file_server):
    out, _ = packed
    d, _ = _tree(packed, tmp_path)
    (d / "sub").mkdir()
    (d / "sub" / "up.json").write_text(json.dumps({"shardlist": [{"url": "../train-000001.tar"}]}))
    with file_server(d) as srv:
        with TarShards(srv.url + "/sub/up.json", cache_dir=False) as src:
            assert src.shards == [srv.url + "/train-000001.tar"]
            assert _all(src) == _all(TarShards(os.path.join(out, "train-000001.tar")))


def test_list_counts_are_checked(packed, tmp_path):
    out, _ = packed
    doc = json.loads(open(os.path.join(out, "train.json")).read())
    doc["shardlist"][1]["nsamples"] += 1
    bad = tmp_path / "train.json"
    for f in os.listdir(out):
        if f.endswith((".tar", ".idx")):
            os.link(os.path.join(out, f), tmp_path / f)
    bad.write_text(json.dumps(doc))
    with pytest.raises(ShardFormatError, match=r"train-000001\.tar: holds \d+ samples but the shard list says"):
        TarShards(str(bad))


def test_hostile_list_documents(packed, tmp_path, file_server):
    d, _ = _tree(packed, tmp_path)
    (d / "deep.json").write_text("[" * 100_000)
    (d / "notlist.json").write_text(json.dumps({"shardlist": [{"url": 5}]}))
    (d / "hash.json").write_text(json.dumps({"shardlist": [{"url": "train-000000.tar", "sha256": "zz"}]}))
    with file_server(d) as srv:
        with pytest.raises(ShardFormatError, match=r"deep\.json.*nested too deeply"):
            TarShards(srv.url + "/deep.json", cache_dir=False)
        with pytest.raises(ShardFormatError, match=r"notlist\.json.*non-empty string"):
            TarShards(srv.url + "/notlist.json", cache_dir=False)
        with pytest.raises(ShardFormatError, match=r"hash\.json.*sha256 'zz'"):
            TarShards(srv.url + "/hash.json", cache_dir=False)


# -- object-store ways: queries, 403, redirects, stalls ---------------------------------

def test_presigned_urls_keep_their_query_and_a_forbidden_index_means_scan(packed, tmp_path, file_server):
    out, _ = packed
    d, _ = _tree(packed, tmp_path)
    with file_server(d) as srv:
        url = srv.url + "/train-000002.tar?X-Signature=abc%2Fdef&Expires=9"
        srv.fail("train-000002.idx", 403)  # the signature covers the shard only
        with TarShards(url, cache_dir=str(tmp_path / "c"), backoff_s=0.01) as src:
            assert _all(src) == _all(TarShards(os.path.join(out, "train-000002.tar")))
        paths = [r.path for r in srv.requests]
        assert "/train-000002.idx?X-Signature=abc%2Fdef&Expires=9" in paths
        assert all("X-Signature" in p for p in paths)
        cached = os.listdir(tmp_path / "c" / "shards")
        assert not [f for f in cached if "?" in f or "&" in f]


def test_a_redirect_loop_says_redirect(packed, tmp_path, file_server):
    d, _ = _tree(packed, tmp_path)
    with file_server(d) as srv:
        srv.fail("train-000000.idx", *["redirect"] * 30)
        with pytest.raises(RemoteError, match=r"train-000000\.idx.*redirect loop"):
            TarShards(srv.url + "/train-000000.tar", cache_dir=False, backoff_s=0.01)


def test_a_stalled_index_request_ends_at_the_construction_deadline(packed, tmp_path, file_server):
    d, n = _tree(packed, tmp_path)
    with file_server(d) as srv:
        srv.fail("train-000001.idx", "stall")
        # A deadline that leaves the other shards' index requests time to be answered
        # on a busy machine, so that the stalled one is the one named.
        with pytest.raises(RemoteError, match=r"train-000001.*deadline"):
            run_in_thread(lambda: TarShards(_pattern(srv, n), cache_dir=False, deadline_s=5.0))


def test_deadline_is_checked(tmp_path):
    for bad in (0, -1, "60", True):
        with pytest.raises(ValueError, match="deadline_s"):
            TarShards(str(tmp_path), deadline_s=bad)


# -- damaged and hostile shards -----------------------------------------------------------

def _tar(path, members):
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_shards_that_are_not_whole_tars_are_errors_naming_the_file(tmp_path, jpeg_blobs):
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(ShardFormatError, match=r"empty\.tar: empty file"):
        TarShards(str(tmp_path / "empty.tar"))
    (tmp_path / "page.tar").write_bytes(b"<!DOCTYPE html><html>404 Not Found</html>" * 40)
    with pytest.raises(ShardFormatError, match=r"page\.tar: not a tar shard.*DOCTYPE"):
        TarShards(str(tmp_path / "page.tar"))
    # Cut at a member boundary: the samples after the cut would vanish without a word.
    _tar(tmp_path / "whole.tar", [(f"{k}.jpg", jpeg_blobs[k]) for k in range(4)]
         + [(f"{k}.cls", b"1") for k in range(4)])
    data = open(tmp_path / "whole.tar", "rb").read()
    ix = TarShards(str(tmp_path / "whole.tar"), label=None)
    boundary = 512 + -(-len(jpeg_blobs[0]) // 512) * 512  # after the first member
    assert boundary < len(data) and len(ix) == 4
    (tmp_path / "cut.tar").write_bytes(data[:boundary + 512 + -(-len(jpeg_blobs[1]) // 512) * 512])
    with pytest.raises(ShardFormatError, match=r"cut\.tar: ends at byte \d+ after member '1\.jpg' "
                                               r"without the tar end-of-archive marker"):
        TarShards(str(tmp_path / "cut.tar"), label=None)


def test_oversized_members_are_refused_before_reading(tmp_path, jpeg_blobs, caplog):
    path = tmp_path / "big.tar"
    big = bytes(3 << 20)  # an "image" of 3 MiB: more than max_pixels=100 allows (4 bytes a pixel + 1 MiB)
    _tar(path, [("a.jpg", jpeg_blobs[0]), ("a.cls", b"1"), ("a.json", b"{}"),
                ("b.jpg", big), ("b.cls", b"2")])
    src = TarShards(str(path))
    assert src.read(0)["label"] == 1  # readable as written
    with pytest.raises(ShardFormatError, match=r"big\.tar:b: field 'image' \(\.jpg\) holds "
                                               r"3145728 bytes.*max_pixels") as err:
        TarShards(str(path), max_pixels=100, max_field_bytes=1).read(1)
    assert err.value.field == "image"
    # The bound is an option: a smaller one refuses the JSON member as written.
    with pytest.raises(ShardFormatError, match=r"field 'json' \(\.json\) holds 2 bytes.*max_field_bytes"):
        TarShards(str(path), max_field_bytes=1).read(0)
    # An index claiming members past the shard's end (10**15 bytes) is not the
    # shard's: it is read by its headers instead, as written.
    ix = src._indices[0]
    offs = {(ix.keys[k], ix.exts[m]): int(ix.offsets[m]) for k in range(len(ix)) for m in ix.members(k)}
    idx = tmp_path / "big.idx"
    idx.write_text(f"v1.2 1\njpg {offs['a', 'jpg']} {10**15} a.jpg cls {offs['a', 'cls']} 1 a.cls "
                   f"json {offs['a', 'json']} 2 a.json\n")
    os.utime(idx, (os.path.getmtime(path) + 5,) * 2)
    again = TarShards(str(path))
    assert again.read(0) == src.read(0) and len(again) == 2
    assert any("does not describe" in w and "the shard holds" in w for w in again.warnings)


def test_huge_header_records_are_refused(tmp_path):
    block = bytearray(tarfile.TarInfo("x" * 10).tobuf(format=tarfile.USTAR_FORMAT))
    block[156:157] = b"x"  # a pax record...
    block[124:136] = b"%011o\0" % (5 << 30)  # ...claiming 5 GB
    chk = sum(block[:148]) + 8 * 32 + sum(block[156:512])
    block[148:156] = b"%06o\0 " % chk
    (tmp_path / "pax.tar").write_bytes(bytes(block) + bytes(2048))
    with pytest.raises(ShardFormatError, match=r"pax\.tar: the 'x' header record at byte 0 claims "
                                               r"5368709120 bytes"):
        TarShards(str(tmp_path / "pax.tar"), label=None)


def _with_checksum(block: bytearray) -> bytes:
    block[148:156] = b"        "
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


@pytest.mark.parametrize("how", ["base-256", "pax"])
def test_a_negative_member_size_is_an_error_not_a_scan_backwards(tmp_path, how):
    """A GNU base-256 size field (or a pax size) can be negative, and Python's
    tarfile accepts it: indexing must fail naming the shard and the byte, not step
    back to the same header forever."""
    first = tarfile.TarInfo("a.cls")
    first.size = 1
    second = tarfile.TarInfo("b.jpg")
    second.size = 600
    head = first.tobuf(format=tarfile.GNU_FORMAT) + b"1".ljust(512, b"\0")
    block = bytearray(second.tobuf(format=tarfile.GNU_FORMAT))
    records = b""
    if how == "base-256":
        block[124:136] = b"\xff" + ((-1024) & ((1 << 88) - 1)).to_bytes(11, "big")
    else:
        record = b"size=-1000\n"
        line = b"%d %s" % (len(record) + 3, record)  # "NN size=-1000\n", NN counting itself
        pax = bytearray(tarfile.TarInfo("././@PaxHeader").tobuf(format=tarfile.USTAR_FORMAT))
        pax[156:157] = b"x"
        pax[124:136] = b"%011o\0" % len(line)
        records = _with_checksum(pax) + line.ljust(512, b"\0")
    body = head + records + _with_checksum(block) + bytes(1024) + bytes(1024)
    (tmp_path / "neg.tar").write_bytes(body)
    at = 1024 + len(records)
    with pytest.raises(ShardFormatError, match=rf"neg\.tar: .*header at byte {at} gives .*negative size"):
        run_in_thread(lambda: TarShards(str(tmp_path / "neg.tar"), label=None))


def test_npy_and_json_bombs_name_the_field(tmp_path, jpeg_blobs):
    buf = io.BytesIO()
    np.save(buf, np.zeros(4, np.float32))
    raw = buf.getvalue()
    header_end = raw.index(b"\n") + 1
    # The same bytes, the header claiming 8 TB (shape 2**41 float32).
    claim = raw[:header_end].replace(b"(4,)", b"(2199023255552,)")
    pad = len(raw[:header_end]) - len(claim)
    bomb = claim[:-1] + b" " * pad + b"\n" + raw[header_end:] if pad >= 0 else claim + raw[header_end:]
    _tar(tmp_path / "b.tar", [("a.jpg", jpeg_blobs[0]), ("a.boxes.npy", bomb), ("a.meta.json", b"[" * 100_000),
                              ("b.jpg", jpeg_blobs[1]), ("b.boxes.npy", b"\x93NUMPY garbage"),
                              ("b.meta.json", b"{}")])
    src = TarShards(str(tmp_path / "b.tar"), fields=["boxes.npy"], label=None)
    with pytest.raises(ShardFormatError, match=r"b\.tar:a: field 'boxes' \(\.boxes\.npy\) is not a "
                                               r"\.npy array.*claims shape \(2199023255552,\)") as err:
        src.read(0)
    assert err.value.field == "boxes"
    with pytest.raises(ShardFormatError, match=r"b\.tar:b: field 'boxes'"):
        src.read(1)
    src = TarShards(str(tmp_path / "b.tar"), fields=["meta.json"], label=None)
    with pytest.raises(ShardFormatError, match=r"b\.tar:a: field 'meta' \(\.meta\.json\) is not JSON "
                                               r"\(RecursionError") as err:
        src.read(0)
    assert err.value.field == "meta" and src.read(1)["meta"] == {}


def test_a_json_field_nested_too_deep_is_refused_before_the_parser_recurses():
    """The parser would recurse to the interpreter's limit, where a finalizer the
    garbage collector runs meanwhile fails for want of stack: the depth is
    measured first (brackets inside strings do not count)."""
    from feeder.storage.fields import MAX_JSON_DEPTH, json_value

    deepest = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert json_value(deepest) is not None
    with pytest.raises(RecursionError, match=f"nested {MAX_JSON_DEPTH + 1} levels deep"):
        json_value(b"[" + deepest + b"]")
    text = "[" * 5000 + '\\"{' * 10
    assert json_value(json.dumps({"caption": text}).encode()) == {"caption": text}
    assert json_value(json.dumps([[1, [2]]] * 500).encode())[0] == [1, [2]]


def test_hostile_members_are_counted_skips_in_a_feeder(tmp_path, jpeg_blobs):
    members = []
    for k in range(6):
        members += [(f"{k}.jpg", jpeg_blobs[k]), (f"{k}.cls", b"%d" % k),
                    (f"{k}.meta.json", b"[" * 50_000 if k == 2 else b"{}")]
    _tar(tmp_path / "h.tar", members)
    src = TarShards(str(tmp_path / "h.tar"), fields=["cls", "meta.json"])
    with Feeder(src, 2, [ops.Resize(24), ops.CenterCrop(16)], shuffle=False, on_error="skip") as f:
        labels = run_in_thread(lambda: [int(v) for b in f for v in b["label"]])
        stats = f.stats()
    assert sorted(labels) == [0, 1, 3, 4, 5]  # each once; a skip refills its batch
    assert stats.skipped == 1 and any("h.tar:2" in p for p in stats.skipped_paths)


# -- resources ------------------------------------------------------------------------------

def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_dropped_sources_release_their_descriptors(packed):
    out, n = packed
    TarShards(out).read(0)  # warm imports and lazily opened files
    gc.collect()
    before = _fds()
    for _ in range(40):
        src = TarShards(out)
        for i in range(0, len(src), 7):
            src.read(i)  # one descriptor per shard touched
        del src
    gc.collect()
    assert _fds() <= before + 2  # flat: not one per shard per cycle


def test_closing_a_remote_source_mid_copy_returns(packed, tmp_path, file_server):
    d, n = _tree(packed, tmp_path)
    with file_server(d, latency_s=0.0) as srv:
        src = TarShards(_pattern(srv, n), cache_dir=str(tmp_path / "c"))
        for i in range(0, len(src), 5):
            src.read(i)
        done = threading.Event()

        def close():
            src.close()
            done.set()

        threading.Thread(target=close, daemon=True).start()
        assert done.wait(T)
        assert src.read(0)[1] == 0  # reads after close reopen what they need
        src.close()
