"""How many cores the feeder engine gets, and its CPU per image, for one chain.

    PYTHONPATH=. python bench/experiments/engine_cores.py DIR [--threads auto] [--chain train|full|eval]

One warm-up epoch, then ``--epochs`` timed ones: images/s, the process's CPU ms
per image, the cores it used (CPU seconds over wall seconds) and the cores
other processes used meanwhile (``/proc/stat``), and the stages' busy/wait
seconds from ``stats()``. Its CPU per image against the one-thread cost of the
same work (``feeder-bench region-decode``'s stage table) is the engine's
overhead; the cores it used against the machine's is what the machine let it
have. ``FEEDER_NO_JPEG_EXT=1`` in the environment runs the simplejpeg path.
"""

from __future__ import annotations

import argparse
import os
import time

from feeder import Feeder, ImageFolder
from feeder.bench.loaders import eval_transforms, full_decode_transforms, transforms


def busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--threads", default="auto", help="decode_threads (default auto)")
    ap.add_argument("--chain", choices=("train", "full", "eval"), default="train")
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    threads = args.threads if args.threads == "auto" else int(args.threads)
    chain = {"train": transforms, "full": full_decode_transforms, "eval": eval_transforms}[args.chain]()
    with Feeder(ImageFolder(args.dir), 64, chain, decode_threads=threads, shuffle=True, seed=0) as f:
        for _ in f:  # warm-up epoch
            pass
        n = 0
        b0, t0, c0 = busy_s(), time.perf_counter(), time.process_time()
        for e in range(args.epochs):
            f.set_epoch(e + 1)
            for _, labels in f:
                n += len(labels)
        wall, cpu, busy = time.perf_counter() - t0, time.process_time() - c0, busy_s() - b0
        s = f.stats()
    stages = " ".join(f"{st.name}:busy={st.busy_s:.2f}s,wait_in={st.wait_input_s:.2f}s" for st in s.stages)
    print(f"{args.dir} {args.chain} decode_threads={threads}: {n / wall:.0f} img/s, CPU {cpu / n * 1e3:.2f} "
          f"ms/img, cores used {cpu / wall:.2f}, other processes {max(0.0, (busy - cpu) / wall):.2f} "
          f"cores; bottleneck {s.bottleneck}; {stages}")


if __name__ == "__main__":
    main()
