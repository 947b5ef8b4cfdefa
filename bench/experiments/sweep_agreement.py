"""Do sweeps run one after another agree on the best setting within their noise?

Reads the ``sweep.json`` of each sweep (``feeder-bench sweep ... --out DIR``),
and per simulated step prints each sweep's best point and the points it marks
within noise of the best (a point's highest run reaches the best's lowest, as
``feeder-bench sweep`` marks them), then whether every sweep's best lies in
every other sweep's marked set (the best included), and the points all of them
mark::

    feeder-bench sweep DATA --out run1 ...; feeder-bench sweep DATA --out run2 ...; ...
    python bench/experiments/sweep_agreement.py run1/sweep.json run2/sweep.json run3/sweep.json
"""

from __future__ import annotations

import argparse
import json


def name(row: dict) -> str:
    return f"{row['decode_threads']}x{row['augment_threads']} q{row['queue_size']}"


def marked(rows: list[dict]) -> tuple[dict, set[str]]:
    """The best row (highest median) and the names of the rows within its noise."""
    best = max(rows, key=lambda r: r["images_per_s"])
    low = min(best["repeats_images_per_s"])
    return best, {name(r) for r in rows if max(r["repeats_images_per_s"]) >= low}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", nargs="+", help="sweep.json files, in the order they ran")
    args = p.parse_args()
    docs = [json.load(open(path)) for path in args.sweeps]
    steps = sorted({r["step_ms"] for d in docs for r in d["rows"]})
    agree_all = True
    for step in steps:
        bests, sets = [], []
        for k, d in enumerate(docs, 1):
            rows = [r for r in d["rows"] if r["step_ms"] == step]
            best, within = marked(rows)
            runs = best["repeats_images_per_s"]
            bests.append(name(best))
            sets.append(within)
            print(f"step {step:g} ms, sweep {k}: best {name(best)} ({best['images_per_s']:.0f} img/s, "
                  f"runs {min(runs):.0f}-{max(runs):.0f}); within noise: "
                  f"{', '.join(sorted(within - {name(best)})) or '(none)'}")
        agree = all(b in s for b in bests for s in sets)
        agree_all &= agree
        common = set.intersection(*sets)
        print(f"step {step:g} ms: every sweep's best is within every other sweep's marked set: "
              f"{'yes' if agree else 'NO'}; marked in all: {', '.join(sorted(common)) or '(none)'}")
    print(f"all steps agree: {'yes' if agree_all else 'NO'}")


if __name__ == "__main__":
    main()
