"""Where the feeder's added memory goes: PSS by mapping before and after one
epoch, with the batch and decode buffers it allocated.

    python bench/experiments/memory_breakdown.py DATA_DIR [--queue-size 4]
"""

from __future__ import annotations

import argparse
import collections
import re

import cv2  # noqa: F401 - the libraries every loader imports count as the baseline
import numpy as np  # noqa: F401
import simplejpeg  # noqa: F401
import torch  # noqa: F401

from feeder import Feeder, ImageFolder, ops


def pss_by_mapping() -> collections.Counter:
    res: collections.Counter = collections.Counter()
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif line.startswith("Pss:"):
                res[name] += int(line.split()[1])
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--queue-size", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    src = ImageFolder(args.dir)
    before = pss_by_mapping()
    with Feeder(src, args.batch_size, [ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()],
                queue_size=args.queue_size, seed=0) as f:
        for _ in f:
            pass
        after = pss_by_mapping()
        engine = f._engine
        batch = engine.pool.allocated
        batch_mib = batch * args.batch_size * 224 * 224 * 3 / 2**20
        dbufs = list(engine.decode_buffers._free)
        dec_mib = sum(b.nbytes for b in dbufs) / 2**20
        scratch = list(engine.scratch._free)
        scratch_mib = sum(a.nbytes for a in scratch) / 2**20
    print(f"batch buffers: {batch} ({batch_mib:.1f} MiB); decode buffers: {len(dbufs)} ({dec_mib:.1f} MiB); "
          f"scratch samples: {len(scratch)} ({scratch_mib:.1f} MiB)")
    grew = {k: (after[k] - before[k]) / 1024 for k in set(before) | set(after)}
    anon = grew.pop("[anon]", 0.0)
    code = sum(v for v in grew.values() if v > 0)
    print(f"anonymous memory +{anon:.1f} MiB (buffers, heaps, stacks); "
          f"library pages first touched +{code:.1f} MiB")
    print(f"total added PSS {sum(after.values()) / 1024 - sum(before.values()) / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
