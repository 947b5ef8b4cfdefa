"""Remote shards over real HTTP on the loopback interface: range reads, the local
cache (later epochs make no request), retries of transient failures, clear 4xx
errors, cache bounds and eviction, and several processes sharing one cache.

The server is feeder's own (``feeder.bench.httpserver.FileServer``, the
``file_server`` fixture), a threaded
``http.server`` answering HTTP/1.1 with persistent connections, ``Range``
requests (206 with ``Content-Range``, 416 past the end) and ``HEAD``: what
fsspec's HTTP client uses. It is chosen over nginx because these tests need to
inject a status, a dropped connection or a cut body into chosen requests, and
to count every request exactly; nginx can do neither without scripting modules
and is not installed on every machine that runs the tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from feeder import Feeder, SampleError, ops
from feeder.storage.remote import RemoteError, ShardCache
from feeder.shards import TarShards

from tests.support import JOIN_TIMEOUT_S, REPO_DIR, drain, labels_of

T = JOIN_TIMEOUT_S


@pytest.fixture
def server(packed, file_server):
    out, _ = packed
    with file_server(out) as srv:
        yield srv


def shard_gets(srv, whole=True):
    """Requests for shard bodies: whole-shard copies, or range reads."""
    return srv.count(lambda r: r.method == "GET" and r.path.endswith(".tar")
                     and (r.range is None) == whole)


def remote(srv, n, tmp_path, **kw):
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    kw.setdefault("backoff_s", 0.01)
    return TarShards(srv.url + "/train-{000000..%06d}.tar" % (n - 1), **kw)


def test_remote_reads_match_local(packed, server, tmp_path):
    out, n = packed
    local = TarShards(out)
    with remote(server, n, tmp_path, cache_dir=False) as src:
        assert len(src) == len(local) == 60
        assert server.count() == n  # one index request per shard, nothing else yet
        for i in range(len(src)):
            assert src.read(i) == local.read(i)
        assert src.describe(7).startswith(server.url + "/train-") and src.describe(7).endswith(":000000007")
        # No cache: every read is one range request, and no shard is copied.
        assert shard_gets(server, whole=False) == 60 and shard_gets(server) == 0
    # The shard list, as a URL.
    with TarShards(server.url + "/train.json", cache_dir=False) as src:
        assert len(src) == 60 and src.read(59) == local.read(59)


def test_read_threads_auto_reads_a_cached_window_in_the_decode_threads(packed, server, tmp_path):
    """Remote shards get read threads; under the block shuffle their window is
    copied into the cache ahead, so reads are local and the decode threads do
    them (a read stage's hand-over costs CPU per sample), unless nothing caches."""
    out, n = packed
    with remote(server, n, tmp_path) as src:
        assert src.reads_may_block is True and src.window_reads_may_block is False
        with Feeder(src, 8, [ops.CenterCrop(16)], shuffle="shards", decode_threads=2) as f:
            assert f.config.read_threads == 32  # windows of samples: reads by range, ahead
        with Feeder(src, 8, [ops.CenterCrop(16)], shuffle="shards", shuffle_shards=2, seed=1,
                    decode_threads=2) as f:
            assert f.config.read_threads == 0
            batches, err = drain(f, timeout=T)
            assert err is None and sorted(labels_of(batches)) == sorted(
                int(TarShards(out).read(i)[1]) for i in range(len(src)))
        with Feeder(src, 8, [ops.CenterCrop(16)], shuffle="shards", shuffle_shards=2,
                    read_threads="auto", decode_threads=2) as f:
            assert f.config.read_threads == 0
        with Feeder(src, 8, [ops.CenterCrop(16)], shuffle="shards", shuffle_shards=2,
                    read_threads=4, decode_threads=2) as f:
            assert f.config.read_threads == 4  # given: used as given
    with remote(server, n, tmp_path, cache_dir=str(tmp_path / "small"), cache_bytes=1000) as src:
        # Shards larger than the cache are never copied: read by range, by read threads.
        assert src.window_reads_may_block is True
        with Feeder(src, 8, [ops.CenterCrop(16)], shuffle="shards", shuffle_shards=2,
                    decode_threads=2) as f:
            assert f.config.read_threads == 32
    with remote(server, n, tmp_path, cache_dir=False) as src:
        assert src.window_reads_may_block is True  # nothing is copied ahead
        with Feeder(src, 8, [ops.CenterCrop(16)], shuffle="shards", shuffle_shards=2,
                    decode_threads=2) as f:
            assert f.config.read_threads == 32
    local = TarShards(out)
    assert local.reads_may_block is False and local.window_reads_may_block is False


def _epoch(src, epoch, **kw):
    with Feeder(src, 8, [ops.Resize(24), ops.CenterCrop(16)], seed=5, **kw) as f:
        f.set_epoch(epoch)
        batches, err = drain(f)
    assert err is None, err
    return labels_of(batches)


def test_later_epochs_read_the_cache(packed, server, tmp_path):
    _, n = packed
    with remote(server, n, tmp_path) as src:
        assert Counter(_epoch(src, 0)) == Counter(range(60))
        assert src.wait_downloads(T)
        first = server.count()
        assert shard_gets(server) == n  # each shard copied once, in the background
        server.reset_counts()
        for epoch in (1, 2):
            for rank in range(2):  # ranks and epochs: still exactly once
                got = _epoch(src, epoch, rank=rank, world_size=2)
                assert len(got) == 30
        assert server.count() == 0 < first
    # A new reader (a new process of the same job) finds shards and indices cached.
    with remote(server, n, tmp_path) as src:
        assert Counter(_epoch(src, 3)) == Counter(range(60))
    assert server.count() == 0, server.requests


def test_transient_failures_are_retried(packed, server, tmp_path):
    out, n = packed
    local = TarShards(out)
    server.fail("train-000001.idx", 503, "reset")
    with remote(server, n, tmp_path, cache_dir=False, retries=3) as src:
        assert server.count(lambda r: r.path == "/train-000001.idx") == 3
        first = src.shard_ranges()[1][0]
        server.fail("train-000001.tar", 500, "truncate", 502)
        assert src.read(first) == local.read(first)
        tries = [r.status for r in server.requests if r.path == "/train-000001.tar"]
        assert tries == [500, 206, 502, 206]  # the cut body (206, half sent) was retried too
        # Retries run out: the error names the URL and the tries.
        server.fail("train-000001.tar", *[503] * 4)
        with pytest.raises(RemoteError, match=r"train-000001\.tar.*failed after 4 tries"):
            src.read(first)


def test_client_errors_fail_at_once_naming_the_url(packed, server, tmp_path):
    _, n = packed
    with remote(server, n, tmp_path, cache_dir=False) as src:
        server.reset_counts()
        server.fail("train-000002.tar", 403)
        i = src.shard_ranges()[2][0]
        with pytest.raises(RemoteError, match=r"train-000002\.tar: read of bytes .* HTTP 403"):
            src.read(i)
        assert server.count() == 1  # not retried
        # Through the feeder: the sample is named (URL and key); skip counts it.
        server.fail("train-000002.tar", 403)
        with Feeder(src, 8, [ops.Resize(24), ops.CenterCrop(16)], shuffle=False, on_error="skip") as f:
            got = labels_of(drain(f)[0])
            stats = f.stats()
        assert sorted(got) == sorted(set(range(60)) - {i}) and stats.skipped == 1
        assert stats.skipped_paths[0] == f"{server.url}/train-000002.tar:{i:09d}"
        server.fail("train-000002.tar", 403)
        with Feeder(src, 8, [ops.Resize(24), ops.CenterCrop(16)], shuffle=False) as f:
            _, err = drain(f)
        assert isinstance(err, SampleError) and "train-000002.tar" in str(err) and "403" in str(err)
    with pytest.raises(FileNotFoundError, match=r"missing-000000\.tar.*404"):
        TarShards(server.url + "/missing-000000.tar", cache_dir=False)


def test_shard_without_index_is_copied_and_scanned(packed, tmp_path, file_server):
    out, _ = packed
    bare = tmp_path / "bare"
    bare.mkdir()
    os.link(os.path.join(out, "train-000000.tar"), bare / "train-000000.tar")
    local = TarShards(out)
    with file_server(bare) as srv:
        with TarShards(srv.url + "/train-000000.tar", cache_dir=str(tmp_path / "c")) as src:
            assert [src.read(i) for i in range(len(src))] == [local.read(i) for i in range(len(src))]
        assert shard_gets(srv) == 1 and shard_gets(srv, whole=False) == 0
        with TarShards(srv.url + "/train-000000.tar", cache_dir=False) as src:  # no cache: a temp copy
            assert src.read(0) == local.read(0)
        assert not [f for f in os.listdir(tmp_path) if f.startswith("feeder-shard-")]


def test_cache_stays_within_its_bound(packed, server, tmp_path):
    out, n = packed
    sizes = sorted(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".tar"))
    bound = sizes[-1] + sizes[-2] + 4096  # room for about two shards (and the indices)
    with remote(server, n, tmp_path, cache_bytes=bound) as src:
        for epoch in range(2):
            assert Counter(_epoch(src, epoch, shuffle=False)) == Counter(range(60))
            assert src.wait_downloads(T)
            assert ShardCache(str(tmp_path / "cache"), bound).total_bytes() <= bound
    # A shard larger than the whole cache is never copied; reads go by range.
    with remote(server, n, tmp_path / "small", cache_bytes=1000) as src:
        server.reset_counts()
        assert src.read(0)[1] == 0 and src.wait_downloads(T)
        assert shard_gets(server) == 0
        assert src.read(1)[1] == 1


def test_processes_share_one_cache(packed, server, tmp_path):
    """Two processes reading the same shards at once: each shard is copied once,
    no partial file is ever seen, both read every sample right."""
    _, n = packed
    script = textwrap.dedent(f"""
        import sys
        from feeder.shards import TarShards
        src = TarShards({server.url!r} + "/train-{{000000..{n - 1:06d}}}.tar",
                        cache_dir={str(tmp_path / 'cache')!r}, backoff_s=0.01)
        for i in range(len(src)):
            data, label = src.read(i)
            assert label == i, (i, label)
        assert src.wait_downloads(60)
        for i in range(len(src)):
            assert src.read(i)[1] == i
        src.close()
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": REPO_DIR}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err
    assert shard_gets(server) <= n  # one copy per shard at most, whichever process made it
    files = os.listdir(tmp_path / "cache" / "shards")
    assert not [f for f in files if ".part-" in f]
    out, _ = packed
    cache = ShardCache(str(tmp_path / "cache"), 1 << 30)
    for k in range(n):
        name = f"train-{k:06d}.tar"
        cached = cache.lookup(f"{server.url}/{name}")
        if cached is not None:
            assert open(cached, "rb").read() == open(os.path.join(out, name), "rb").read()


def test_remote_source_pickles(packed, server, tmp_path):
    import pickle

    out, n = packed
    with remote(server, n, tmp_path, cache_dir=False) as src:
        with pickle.loads(pickle.dumps(src)) as copy:
            server.reset_counts()
            assert copy.read(5) == TarShards(out).read(5)
            assert server.count() == 1  # the indices came along: one range request


def test_an_index_that_is_another_shards_fails_its_samples_by_name(packed, file_server, tmp_path):
    """A remote index is not checked against its shard when it is loaded (that
    would take reads of every shard): each read takes the tar header before the
    sample's first member in the same request. Two shards' indexes swapped: the
    samples whose offsets land elsewhere fail, naming the shard, the sample and
    the index; none is delivered with another sample's bytes or label."""
    import shutil

    out, n = packed
    copy = tmp_path / "served"
    shutil.copytree(out, copy)
    a, b = copy / "train-000000.idx", copy / "train-000001.idx"
    text_a, text_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(text_b)
    b.write_bytes(text_a)
    local = TarShards(out)
    with file_server(str(copy)) as srv, remote(srv, n, tmp_path, cache_dir=False) as src:
        ranges = src.shard_ranges()
        swapped = range(ranges[0][0], ranges[1][1])
        delivered = {}
        for i in swapped:
            try:
                delivered[i] = src.read(i)
            except Exception as exc:  # noqa: BLE001 - the failure the test looks for
                assert "the shard's index does not describe it" in str(exc), exc
                assert "/train-00000" in str(exc) and ":" in str(exc)
        # What a read gives is a whole sample, its own label with its own bytes.
        everything = [local.read(k) for k in range(len(local))]
        assert all(got in everything for got in delivered.values())
        assert len(delivered) < len(swapped)
        # Every sample of the shards not touched is read as it is.
        ranges = src.shard_ranges()
        for s in range(2, n):
            for i in range(*ranges[s]):
                assert src.read(i) == local.read(i)
