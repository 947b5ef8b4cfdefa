"""Small images through a Feeder with the files read by the extension's one call
or by Python's four system calls: images/s, the process's voluntary context
switches per sample (each a thread that blocked, mostly on the GIL) and CPU
per sample, over epochs 1-3 (epoch 0 warms the page cache).

    python bench/experiments/read_native.py DATA --rounds 5

Alternates the two ways in one process per run, DATA an ImageFolder of small
JPEGs (feeder-bench make-data DATA --small).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time


def one(data: str, way: str) -> dict[str, float]:
    from feeder import Feeder, ImageFolder, ops, sources

    if way == "python":
        sources._native_read = None
    elif sources._native_read is None:
        sys.exit("feeder's C extension is not built")
    src = ImageFolder(data)
    with Feeder(src, 256, [ops.RandomResizedCrop(64), ops.RandomHorizontalFlip()], seed=0,
                decode_threads=2, augment_threads=0) as f:
        f.set_epoch(0)
        for _ in f:
            pass
        r0, t0, n = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), 0
        for epoch in range(1, 4):
            f.set_epoch(epoch)
            for x, _ in f:
                n += x.shape[0]
        r1, dt = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return {"img_s": n / dt, "switches": (r1.ru_nvcsw - r0.ru_nvcsw) / n, "cpu_us": cpu / n * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--one", choices=["python", "extension"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(repr(one(args.data, args.one)))
        return
    got: dict[str, list[dict[str, float]]] = {"python": [], "extension": []}
    for r in range(args.rounds):
        for way in got:
            out = subprocess.run([sys.executable, __file__, args.data, "--one", way], check=True,
                                 capture_output=True, text=True).stdout
            got[way].append(eval(out))  # noqa: S307  (our own repr of a dict of floats)
            g = got[way][-1]
            print(f"round {r + 1}, load {os.getloadavg()[0]:.2f}: {way:9s} {g['img_s']:6.0f} img/s, "
                  f"{g['switches']:.2f} voluntary switches/sample, {g['cpu_us']:.0f} us CPU/sample")
    for way, rows in got.items():
        print(f"median {way:9s} " + ", ".join(f"{k} {statistics.median(x[k] for x in rows):.2f}" for k in rows[0]))
    ratios = [e["img_s"] / p_["img_s"] for p_, e in zip(got["python"], got["extension"])]
    print("extension/python images/s, same round: median "
          f"{statistics.median(ratios):.3f} (rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
