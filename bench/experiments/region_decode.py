"""Region decode (``feeder._jpeg``) against the simplejpeg path and the baselines,
in alternating rounds of fresh child processes; ratios within each round, then
the median.

    PYTHONPATH=. python bench/experiments/region_decode.py IMAGENET_LIKE LARGE --rounds 3

Rows on IMAGENET_LIKE (RandomResizedCrop(224) + flip, batch 64, 2 epochs, uint8):
feeder with the region decoder, feeder on the simplejpeg path
(FEEDER_NO_JPEG_EXT=1), DataLoader + the same per-sample work on the simplejpeg
path (as the project's targets define it) and with the region decoder,
DataLoader + PIL, and the 1-thread ceilings (full decode + crop + resize; and
the simplejpeg path's own work, with its reduced-scale hint) times the cores.
On LARGE (about 1500x1100): feeder region, simplejpeg path (reduced scale when
it covers) and forced full decode, for RandomResizedCrop(224) + flip and for
Resize(256) + CenterCrop(224).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from feeder._threads import available_cores
from feeder.bench.measure import run_child

NO_EXT = {"FEEDER_NO_JPEG_EXT": "1"}


def rows(small: str, large: str, epochs: int, large_epochs: int, limit: int) -> dict[str, dict]:
    base = {"mode": "loader", "batch_size": 64, "seed": 0, "decode_threads": "auto",
            "augment_threads": "auto"}
    s = {**base, "root": small, "epochs": epochs}
    big = {**base, "root": large, "epochs": large_epochs}
    return {
        "feeder region": {**s, "kind": "feeder"},
        "feeder simplejpeg": {**s, "kind": "feeder", "env": NO_EXT},
        "DataLoader+cv2 simplejpeg": {**s, "kind": "dl-cv2", "workers": 4, "env": NO_EXT},
        "DataLoader+cv2 region": {**s, "kind": "dl-cv2", "workers": 4},
        "DataLoader+PIL": {**s, "kind": "dl-pil", "workers": 2, "env": NO_EXT},
        "ceiling full decode": {"mode": "ceiling", "root": small, "limit": limit, "full_decode": True,
                                "env": NO_EXT},
        "ceiling simplejpeg work": {"mode": "ceiling", "root": small, "limit": limit, "env": NO_EXT},
        "ceiling region work": {"mode": "ceiling", "root": small, "limit": limit},
        "large: feeder region": {**big, "kind": "feeder"},
        "large: feeder simplejpeg": {**big, "kind": "feeder", "env": NO_EXT},
        "large: feeder full decode": {**big, "kind": "feeder", "full_decode": True, "env": NO_EXT},
        "large eval: feeder region": {**big, "kind": "feeder", "evaluation": True},
        "large eval: feeder simplejpeg": {**big, "kind": "feeder", "evaluation": True, "env": NO_EXT},
        "large eval: feeder full decode": {**big, "kind": "feeder", "evaluation": True, "full_decode": True,
                                           "env": NO_EXT},
    }


RATIOS = [
    ("feeder region / ceiling full decode (1-thread x cores)", "feeder region", "ceiling full decode", 1.2),
    ("feeder region / ceiling simplejpeg work", "feeder region", "ceiling simplejpeg work", None),
    ("feeder region / feeder simplejpeg", "feeder region", "feeder simplejpeg", None),
    ("feeder region / DataLoader+cv2 simplejpeg", "feeder region", "DataLoader+cv2 simplejpeg", 1.5),
    ("feeder region / DataLoader+cv2 region", "feeder region", "DataLoader+cv2 region", None),
    ("feeder region / DataLoader+PIL", "feeder region", "DataLoader+PIL", 3.5),
    ("large: region / full decode", "large: feeder region", "large: feeder full decode", 2.0),
    ("large: region / simplejpeg (reduced scale)", "large: feeder region", "large: feeder simplejpeg", None),
    ("large eval: region / full decode", "large eval: feeder region", "large eval: feeder full decode", 1.3),
    ("large eval: region / simplejpeg", "large eval: feeder region", "large eval: feeder simplejpeg", None),
]


def rate(res, cores: int) -> float:
    if res.spec.get("mode") == "ceiling":
        return cores * 1e3 / res.extra["per_image_ms"]
    return res.images_per_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("small")
    ap.add_argument("large")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--large-epochs", type=int, default=2)
    ap.add_argument("--ceiling-images", type=int, default=400)
    ap.add_argument("--out", default="bench/results/region_decode")
    args = ap.parse_args()
    cores = available_cores()
    specs = rows(args.small, args.large, args.epochs, args.large_epochs, args.ceiling_images)
    names = list(specs)
    rounds: list[dict] = []
    for r in range(args.rounds):
        got = {}
        order = names[r % len(names):] + names[:r % len(names)]  # rotated: drift lands on all rows
        for name in order:
            res = run_child(specs[name], memory=False)
            if not res.ok:
                print(f"{name}: FAILED {res.error[:400]}", file=sys.stderr)
                continue
            got[name] = {"img_s": rate(res, cores),
                         "cpu_ms": 1e3 * res.cpu_per_image_s if res.cpu_per_image_s else None}
            print(f"round {r + 1} {name}: {got[name]['img_s']:.0f} img/s", file=sys.stderr, flush=True)
        rounds.append(got)
    lines = [f"region_decode: {' '.join(sys.argv)}", f"cores: {cores}; median of {args.rounds} rounds "
             f"(rows in a rotated order each round); ceilings are 1-thread rates x {cores} cores", ""]
    lines.append(f"{'row':<34} {'img/s':>7} {'CPU ms/img':>10}")
    for name in names:
        vals = [g[name]["img_s"] for g in rounds if name in g]
        if not vals:
            lines.append(f"{name:<34} {'failed':>7}")
            continue
        cpu = [g[name]["cpu_ms"] for g in rounds if name in g and g[name]["cpu_ms"]]
        lines.append(f"{name:<34} {statistics.median(vals):>7.0f} "
                     f"{(statistics.median(cpu) if cpu else float('nan')):>10.2f}")
    lines += ["", f"{'ratio (median of per-round ratios)':<58} {'measured':>8} {'target':>7} met",
              ]
    summary = {}
    for label, a, b, target in RATIOS:
        rs = [g[a]["img_s"] / g[b]["img_s"] for g in rounds if a in g and b in g]
        m = statistics.median(rs) if rs else float("nan")
        summary[label] = {"median": m, "rounds": rs, "target": target}
        met = "" if target is None else ("yes" if m >= target else "NO")
        lines.append(f"{label:<58} {m:>7.2f}x {('>= %.1fx' % target) if target else '':>7} {met}")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".txt", "w") as f:
        f.write(text + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"argv": sys.argv, "cores": cores, "rounds": rounds, "ratios": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
