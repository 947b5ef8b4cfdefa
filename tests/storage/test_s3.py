"""Shards on object storage through fsspec (``s3://``), against a real
S3-compatible server on the loopback interface: moto in server mode, started by
the test. Reads must match the local shards, a bucket without ``.idx`` files
is indexed by scanning, and a shard replaced in the bucket is reported."""

from __future__ import annotations

import os

import pytest

moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (the test extra)")
pytest.importorskip("s3fs", reason="needs s3fs (the test extra)")
boto3 = pytest.importorskip("boto3")

from feeder import Feeder, ops  # noqa: E402
from feeder.storage.remote import ShardChangedError  # noqa: E402
from feeder.shards import TarShards  # noqa: E402

from tests.support import drain, labels_of  # noqa: E402


@pytest.fixture(scope="module")
def s3(packed):
    """A moto S3 server with two buckets: ``indexed`` (shards, indices, list) and
    ``bare`` (shards only)."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    out, _ = packed
    for bucket in ("indexed", "bare"):
        client.create_bucket(Bucket=bucket)
        for f in sorted(os.listdir(out)):
            if bucket == "bare" and not f.endswith(".tar"):
                continue
            client.upload_file(os.path.join(out, f), bucket, f)
    options = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing",
               "skip_instance_cache": True}
    try:
        yield client, options
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _all(src):
    return [src.read(i) for i in range(len(src))]


@pytest.mark.parametrize("bucket", ["indexed", "bare"])
def test_s3_shards_read_as_local(packed, s3, tmp_path, bucket):
    out, n = packed
    _, options = s3
    local = _all(TarShards(out))
    spec = f"s3://{bucket}/train-{{000000..{n - 1:06d}}}.tar"
    with TarShards(spec, cache_dir=str(tmp_path / "c"), storage_options=options, backoff_s=0.01) as src:
        assert _all(src) == local
        assert src.wait_downloads(30)
        with Feeder(src, 8, [ops.Resize(24), ops.CenterCrop(16)], seed=2) as f:
            batches, err = drain(f)
        assert err is None, err
        assert sorted(labels_of(batches)) == list(range(60))
    # Without a cache: range reads only, each checked for its length.
    with TarShards(spec, cache_dir=False, storage_options=options) as src:
        assert _all(src) == local


def test_s3_shard_list_and_a_replaced_object(packed, s3, tmp_path):
    out, n = packed
    client, options = s3
    with TarShards("s3://indexed/train.json", cache_dir=False, storage_options=options) as src:
        assert len(src) == 60 and src.read(0) == TarShards(out).read(0)
        # The object is replaced (another shard's bytes under this key): its ETag
        # changes, and the next read of it says so instead of using old offsets.
        client.upload_file(os.path.join(out, "train-000002.tar"), "indexed", "train-000000.tar")
        try:
            with pytest.raises(ShardChangedError, match=r"s3://indexed/train-000000\.tar"):
                # A copy (the cache is off: a private copy, as for a server without
                # ranges) compares the store's answer with the version read before.
                src._store.copy_now(src._shards[0])
        finally:
            client.upload_file(os.path.join(out, "train-000000.tar"), "indexed", "train-000000.tar")


def test_s3_object_replaced_before_its_first_read_is_an_error(packed, s3):
    """An object replaced by one of another size between the source's construction
    and its first read: its size (asked once, when first read) is checked against
    the size its index was made from, so each of its samples is an error naming
    the key and both sizes, not another shard's sample."""
    out, n = packed
    client, options = s3
    shards = TarShards(out).shards
    sizes = [os.path.getsize(p) for p in shards]
    k = next(k for k, size in enumerate(sizes) if size < max(sizes))
    victim, other = os.path.basename(shards[k]), shards[sizes.index(max(sizes))]
    client.create_bucket(Bucket="swap")
    for f in sorted(os.listdir(out)):
        client.upload_file(os.path.join(out, f), "swap", f)
    with TarShards("s3://swap/train-{000000..%06d}.tar" % (n - 1), cache_dir=False,
                   storage_options=options) as src:
        first, stop = src.shard_ranges()[k]
        client.upload_file(other, "swap", victim)
        for i in range(first, stop):
            with pytest.raises(ShardChangedError, match=rf"s3://swap/{victim}: .* holds "
                                                        rf"{max(sizes)} bytes, but its index was "
                                                        rf"made from a shard of {sizes[k]} bytes"):
                src.read(i)
