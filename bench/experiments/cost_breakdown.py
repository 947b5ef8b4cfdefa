"""Where a Feeder's CPU per sample goes, by component, sampled with ``perf``
over its later epochs: feeder's Huffman decoder, libjpeg-turbo (IDCT, colour
conversion, upsampling), the resize, cv2, the Python interpreter, the kernel
(file reads, wake-ups) and the rest, as shares of the samples and as us of
CPU per image (the share times the run's CPU per image, every thread). For
one or more source trees (``--tree NAME=PATH``), one after the other.

    python bench/experiments/cost_breakdown.py DATA --tree before=OLD --tree after=NEW [--size 224]

Needs ``perf`` (linux-perf) and the extension built in each tree.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
from feeder import Feeder, ImageFolder, ops
root, size, batch, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
n = 0
with Feeder(ImageFolder(root), batch, [ops.RandomResizedCrop(size), ops.RandomHorizontalFlip()],
            seed=0, shuffle=True) as f:
    for epoch in range(epochs):
        f.set_epoch(epoch)
        if epoch == 1:
            t0, c0, n = time.perf_counter(), time.process_time(), 0
        for x, y in f:
            n += x.shape[0]
print(json.dumps({"img_s": n / (time.perf_counter() - t0),
                  "cpu_us": 1e6 * (time.process_time() - c0) / n,
                  "feeder": __import__("feeder").__file__}), flush=True)
# Out without the interpreter's teardown: its last collection of every object
# would be sampled as the pipeline's Python time.
__import__("os")._exit(0)
"""

HUFFMAN = {"decode_one", "own_decode_mcu", "slow_symbol", "refill_slow", "build_table", "build_skip",
           "cached_table", "cached_lookup", "skip_block", "decode_block",
           "entropy_install", "catch_up", "restore_point", "save_point", "bytes_sig",
           "give_source_back", "restart", "entropy_crop"}


def component(dso: str, symbol: str) -> str:
    if "_jpeg" in dso:
        if symbol in HUFFMAN:
            return "Huffman decoding (feeder's decoder)"
        if "blend" in symbol or "resize" in symbol or "area" in symbol or symbol == "axis":
            return "resize (bilinear, area shrink)"
        return "extension, other (headers, draws, read, memory)"
    if "libjpeg" in dso:
        return "libjpeg-turbo (IDCT, colour, upsampling)"
    if "cv2" in dso:
        return "cv2 (resize, flip)"
    if "python" in dso:
        return "Python interpreter"
    if "kernel" in dso:
        return "kernel (file reads, wake-ups)"
    if dso.startswith("libc"):
        return "libc (memcpy, malloc)"
    return "other (torch, numpy, ...)"


def profile(path: str, args) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        out = subprocess.run(["perf", "record", "-F", "4000", "-D", str(int(args.skip_s * 1000)), "-o", data,
                              sys.executable, "-c", CHILD, args.data, str(args.size),
                              str(args.batch_size), str(args.epochs)],
                             env=dict(os.environ, PYTHONPATH=path), cwd=path, capture_output=True,
                             text=True, timeout=900, check=True)
        result = __import__("json").loads(out.stdout.strip().splitlines()[-1])
        assert result["feeder"].startswith(os.path.abspath(path)), result["feeder"]
        report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,symbol",
                                 "-g", "none"], capture_output=True, text=True, check=True).stdout
    shares: dict[str, float] = {}
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[.\]\s+(\S+)", line)
        if m:
            name = component(m.group(2), m.group(3))
            shares[name] = shares.get(name, 0.0) + float(m.group(1))
    return result, shares


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="an ImageFolder of JPEGs")
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=8, help="passes; the first is not counted")
    p.add_argument("--skip-s", type=float, default=2.5, help="seconds not sampled (start-up, first pass)")
    args = p.parse_args()
    runs = []
    for spec in args.tree:
        name, path = spec.split("=", 1)
        runs.append((name, *profile(path, args)))
    print(f"{args.data}: RandomResizedCrop({args.size}) + flip, batch {args.batch_size}, defaults, "
          f"{args.epochs} passes, perf from {args.skip_s} s; us of CPU per image (every thread) by component")
    names = sorted({k for _, _, s in runs for k in s}, key=lambda k: -max(s.get(k, 0) for _, _, s in runs))
    print(f"{'component':46}" + "".join(f"{name:>20}" for name, _, _ in runs))
    for k in names:
        print(f"{k:46}" + "".join(f"{s.get(k, 0.0) * r['cpu_us'] / 100:12.0f} ({s.get(k, 0.0):4.1f}%)"
                                  for _, r, s in runs))
    print(f"{'all (images/s)':46}" + "".join(f"{r['cpu_us']:12.0f} ({r['img_s']:5.0f}/s)" for _, r, _ in runs))


if __name__ == "__main__":
    main()
