"""The synthetic shard server and ``feeder-bench scale`` (tiny sizes)."""

from __future__ import annotations

import io
import json
import os
import random
import tarfile

import numpy as np

from feeder.storage.tar import ShardIndex
from feeder.bench.synth import SynthServer, SynthShards
from feeder.shards import TarShards

from feeder.synthetic import make_image
from tests.support import encode_jpeg


def test_synthesized_shards_are_tars_their_index_describes(tmp_path):
    image = encode_jpeg(make_image(20, 24, seed=1))
    synth = SynthShards(7, 30, image, classes=3)
    whole = synth.read(4, 0, synth.size)
    assert len(whole) == synth.size
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        members = tar.getmembers()
        got = {m.name: tar.extractfile(m).read() for m in members}
    assert len(members) == 60
    ix = ShardIndex.from_text(synth.index_text(4), "synth.idx")
    assert len(ix) == 30
    for m in members:
        k = ix.names.index(m.name)
        assert int(ix.offsets[k]) == m.offset_data and int(ix.sizes[k]) == m.size
    assert got["s0000007.jpg"] == image
    assert int(got["s0000007.cls"]) == synth.label(4, 7)
    rng = random.Random(0)
    for _ in range(50):  # any range is the whole shard's slice
        a = rng.randrange(synth.size)
        b = rng.randrange(a, synth.size + 10)
        assert synth.read(4, a, b) == whole[a:b]
    assert synth.read(3, 0, 100) != synth.read(4, 0, 100) or synth.label(3, 0) == synth.label(4, 0)


def test_a_source_over_the_synthetic_server(tmp_path):
    image = encode_jpeg(make_image(20, 24, seed=1))
    synth = SynthShards(100, 20, image, classes=5)
    with SynthServer(synth) as server:
        with TarShards(server.url + "/train.json", cache_dir=str(tmp_path / "cache")) as src:
            counts = server.counts()
            assert counts == {"list_requests": 1, "list_bytes": len(synth.shard_list()),
                              "idx_requests": 1, "idx_bytes": len(synth.index_text(0))}
            assert len(src) == 2000 and src.indices_loaded == 1
            assert src.read(20 * 57 + 3) == (image, synth.label(57, 3))


def test_scale_benchmark_runs(tmp_path):
    from feeder.bench.cli import main

    out = str(tmp_path / "out")
    assert main(["-q", "scale", "--shards", "40", "--per", "50", "--world-size", "4",
                 "--window", "2", "--batch-size", "16", "--local-batches", "5",
                 "--seconds", "60", "--image-px", "16", "--out", out]) == 0
    doc = json.load(open(os.path.join(out, "scale.json")))
    meta = doc["meta"]
    assert meta["samples"] == 2000 and meta["rank_shards"] == 10
    assert meta["remote"]["epoch_done"] and meta["remote"]["samples"] == 496
    # 2000 samples: the bitmap format (format 2 is for sources of more than 2^19).
    assert meta["remote"]["state_version"] == 1 and meta["remote"]["state_bytes"] < 65536
    assert sum(v for k, v in meta["construction_requests"].items() if k.endswith("requests")) == 2
    assert meta["fetched"]["tar_bytes"] >= meta["rank_shard_bytes"] * 0.5
    assert {r["order"] for r in doc["quality"]} >= {"shuffle_shards=1", "global shuffle"}
    assert os.path.isfile(os.path.join(out, "scale.txt"))
    assert np.isfinite(meta["remote_over_local"])


def test_the_synthetic_server_as_an_s3_endpoint(tmp_path):
    import pytest

    pytest.importorskip("s3fs")
    image = encode_jpeg(make_image(20, 24, seed=1))
    synth = SynthShards(100, 20, image, classes=5)
    with SynthServer(synth) as server:
        options = {"client_kwargs": {"endpoint_url": server.url}, "key": "k", "secret": "s"}
        with TarShards("s3://synth/train.json", storage_options=options,
                       cache_dir=str(tmp_path / "cache")) as src:
            assert len(src) == 2000 and src.indices_loaded == 1
            assert src.read(20 * 57 + 3) == (image, synth.label(57, 3))
        counts = server.counts()
        # No request per shard (100 here): two indices (the first, and the one read;
        # s3fs asks HeadObject before and between GETs, 3 requests each at most),
        # and the shard read (HeadObject, the ranged GET, then its copy's HEAD and GET).
        assert counts["idx_requests"] <= 2 * 3 and counts.get("tar_requests", 0) <= 4


def test_the_long_run_samples_rss_and_counts_bytes_per_epoch(tmp_path):
    from feeder.bench.cli import main

    out = str(tmp_path / "long")
    # 40 shards of 50 samples, 4 ranks: 10 shards (500 samples) per epoch, several
    # epochs in the 4 seconds.
    assert main(["-q", "scale", "--shards", "40", "--per", "50", "--world-size", "4",
                 "--window", "2", "--batch-size", "16", "--image-px", "16",
                 "--seconds", "4", "--rss-every", "0.5", "--out", out]) == 0
    doc = json.load(open(os.path.join(out, "scale_long.json")))
    summary = doc["meta"]["summary"]
    assert summary["epochs_complete"] >= 1 and summary["samples"] > 0
    assert 0 < summary["rss_at_1min_mb"] <= summary["rss_max_mb"]
    rows = open(os.path.join(out, "scale_rss.csv")).read().splitlines()
    assert rows[0].startswith("t_s,epoch,samples,rss_mb") and len(rows) >= 4
    epochs = [r for r in doc["rows"] if r["complete"]]
    # The first epoch fetches its 10 shards (plus the ranges read before their
    # copies land, a large share of shards this small); later ones find some
    # in the cache still.
    assert 1.0 <= epochs[0]["fetched_over_shard_bytes"] < 1.5
    assert all(0 <= e["fetched_over_shard_bytes"] < 1.5 for e in epochs)
    assert all(e["samples"] == 496 for e in epochs)  # 500 // 16 batches of 16
