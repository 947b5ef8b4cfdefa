"""One cold epoch of the block shuffle (``shuffle_shards=2``) over remote shards
served with a latency per request (and optionally a bandwidth cap), with
``read_threads`` as given: how long the epoch and its first batch take when no
shard is in the cache yet, and when the cache is too small for a shard.

The shards (4000 samples of 64 px JPEGs in shards of about 1 MB) are packed
once under ``--data`` by ``feeder-pack``; the cache starts empty for every run.

    python bench/experiments/cold_window.py --latency-ms 50 --read-threads auto,32
    python bench/experiments/cold_window.py --latency-ms 100 --bandwidth 2e6
    python bench/experiments/cold_window.py --latency-ms 50 --cache-bytes 500000
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile
import time

import simplejpeg

from feeder import Feeder, TarShards, ops
from feeder.bench.httpserver import FileServer
from feeder.pack import pack, parse_size
from feeder.synthetic import make_image


def shards(folder: str, samples: int = 4000) -> str:
    """The packed shards under ``folder/out`` (made once)."""
    out = os.path.join(folder, "out")
    if glob.glob(os.path.join(out, "*.tar")):
        return out
    os.makedirs(folder, exist_ok=True)
    lines = []
    for i in range(samples):
        path = os.path.join(folder, f"{i}.jpg")
        with open(path, "wb") as f:
            f.write(simplejpeg.encode_jpeg(make_image(64, 64, seed=i % 50), quality=85, colorspace="RGB"))
        lines.append(f"{i}.jpg {i}")
    with open(os.path.join(folder, "list.txt"), "w") as f:
        f.write("\n".join(lines))
    pack(os.path.join(folder, "list.txt"), out, shard_size=parse_size("1MB"))
    return out


def epoch(out: str, read_threads: int | str, latency_s: float, bandwidth: float,
          cache_bytes: int | None) -> dict[str, float]:
    count = len(glob.glob(os.path.join(out, "*.tar")))
    cache = tempfile.mkdtemp(prefix="feeder-cold-")
    try:
        with FileServer(out, latency_s=latency_s, bandwidth=bandwidth) as srv:
            with TarShards(srv.url + "/train-{000000..%06d}.tar" % (count - 1), cache_dir=cache,
                           cache_bytes=cache_bytes) as src:
                t0 = time.monotonic()
                first = None
                n = 0
                with Feeder(src, 64, [ops.CenterCrop(32)], shuffle="shards", shuffle_shards=2, seed=1,
                            decode_threads=2, read_threads=read_threads) as f:
                    resolved = f.config.read_threads
                    for images, _ in f:
                        n += images.shape[0]
                        if first is None:
                            first = time.monotonic() - t0
                took = time.monotonic() - t0
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {"resolved": resolved, "samples": n, "seconds": took, "first_batch_s": first or 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "feeder-cold-window"),
                   help="where the shards are packed (once)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="latency of every request, ms (default 50)")
    p.add_argument("--bandwidth", type=float, default=0.0, help="bytes/s of all bodies together (default: no cap)")
    p.add_argument("--cache-bytes", type=int, default=None, help="the cache's bound (default: feeder's)")
    p.add_argument("--read-threads", default="auto,32", help="settings to run in turn (default auto,32)")
    args = p.parse_args()
    out = shards(args.data)
    print(f"latency {args.latency_ms:g} ms, bandwidth {args.bandwidth or 'no cap'}, cache_bytes "
          f"{args.cache_bytes or 'default'}; one cold epoch each, shuffle_shards=2, 2 decode threads")
    for setting in args.read_threads.split(","):
        rt: int | str = setting if setting in ("auto", "tune") else int(setting)
        r = epoch(out, rt, args.latency_ms / 1e3, args.bandwidth, args.cache_bytes)
        print(f"  read_threads={setting} (resolved {r['resolved']}): {r['samples']} samples in "
              f"{r['seconds']:.2f} s ({r['samples'] / r['seconds']:.0f}/s), first batch {r['first_batch_s']:.2f} s")


if __name__ == "__main__":
    main()
