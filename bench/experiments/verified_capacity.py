"""How many files the verified-JPEG memory keeps (``feeder/decode/verified.py``).

With ``jpeg_verify`` (the default), a file is read to its end the first time
its bytes come, and its fingerprint (length and CRC-32) is remembered so that
later epochs stop after the crop. The memory is a fixed table (16 MiB by
default): past some number of distinct files, entries are pushed out and those
files are read to their end again. This adds N distinct random fingerprints
epoch after epoch, each epoch in a new random order, as a training run would,
and reports the share of files read to their end in each epoch (the first is
100% by definition) and the slots in use.

    python bench/experiments/verified_capacity.py [N ...] [--epochs 3] [--slots 2097152]
"""

from __future__ import annotations

import argparse
import random

from feeder.decode.verified import VerifiedJpegs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=int, default=[500_000, 1_281_167, 1_600_000, 1_900_000])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--slots", type=int, default=VerifiedJpegs.SLOTS)
    args = p.parse_args()
    print(f"verified-JPEG memory: {args.slots} slots ({args.slots * 8 / 2**20:.0f} MiB), "
          f"{args.epochs} epochs, files in a new random order each epoch")
    for n in args.files:
        rng = random.Random(0)
        # Real fingerprints: a JPEG's length (here 60-300 KB) and a CRC-32.
        fps = [(rng.randrange(60_000, 300_000) << 32) | rng.getrandbits(32) for _ in range(n)]
        memo = VerifiedJpegs(args.slots)
        shares = []
        for _ in range(args.epochs):
            rng.shuffle(fps)
            again = 0
            for fp in fps:
                if not memo.seen(fp):
                    again += 1
                    memo.add(fp)
            shares.append(again / n)
        print(f"  {n:>9} files ({n / args.slots:.0%} of the slots): read to their end per epoch "
              + ", ".join(f"{s:.1%}" for s in shares) + f"; slots in use {len(memo)}")


if __name__ == "__main__":
    main()
