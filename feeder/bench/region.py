"""``region-decode``: feeder's JPEG region decoder (``feeder.decode._jpeg``) against the
simplejpeg path, DataLoader and the full-decode ceiling, with where the time goes.

Two parts, both in one run:

* **Throughput**, in rounds of fresh child processes, the rows in a rotated
  order each round, ratios taken within a round and their median reported. On
  the ImageNet-like set (RandomResizedCrop(224) + flip, batch 64): feeder with
  the region decoder, feeder on the simplejpeg path (``FEEDER_NO_JPEG_EXT=1``),
  DataLoader with the same per-sample work on either path, DataLoader + PIL,
  and the 1-thread ceilings times the cores (full decode + crop + resize; the
  simplejpeg path's work; the region path's work). On large photos: feeder
  region, simplejpeg (reduced scale when it covers) and forced full decode, for
  training and for the evaluation transform (Resize(256) + CenterCrop(224)).
  Each row also records the cores it used (its CPU seconds over its wall time)
  and the cores *other* processes used meanwhile (the machine's busy time from
  ``/proc/stat`` less the row's own): on a machine shared with other work, a
  multi-thread row is slowed by that load while a 1-thread ceiling is not, so
  the table says how loaded each round was. A ceiling's rate is taken from its
  thread's CPU time per image (its wall time would also count other processes'
  turns on its core), and every ratio is printed in CPU per image too.
* **Stages**, in this process, one thread, per image: the region path's header
  + plan, the file's CRC-32C, the C decode and the rest (crop, resize into the
  output, flip, Python), in the first epoch (``jpeg_verify`` reads each file
  to its end) and after it (the same bytes stop after the crop: see
  :mod:`feeder.decode.verified`), next to a full decode + crop + resize; the
  feeder rows run several epochs, the first of them reading each file to its
  end, and the ceilings time an epoch after the first; and the entropy (Huffman)
  decoding down to the crop's last row, measured with the extension itself by
  decoding one pixel on that row: from the first row (every row above it is
  entropy-decoded and discarded without IDCT), and from the checkpoints before
  the crop that the index (recorded in the first epoch) gives. The C
  decode after the first epoch is also timed without the index and with
  libjpeg-turbo's own Huffman decoder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import ImageFolder, ops
from ..ops.chain import Chain
from ..sample.rng import sample_key
from ..decode.verified import VerifiedJpegs
from ..engine.threads import available_cores
from ..engine.steps import SampleWork
from . import report
from .loaders import eval_transforms, full_decode_transforms, transforms
from .measure import run_child

NO_EXT = {"FEEDER_NO_JPEG_EXT": "1"}


def add_parser(sub: Any, common: Callable[..., None]) -> None:
    """The ``region-decode`` subcommand's arguments."""
    p = sub.add_parser("region-decode", help="JPEG region decoder vs simplejpeg, DataLoader and the "
                                             "full-decode ceiling; per-stage cost")
    common(p)
    p.add_argument("--large", default=None, help="ImageFolder of large photos (make-data --large); "
                                                 "required unless --report")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every row (default 3)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run on DIR (default 2)")
    p.add_argument("--large-epochs", type=int, default=2, help="epochs per run on --large (default 2)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader num_workers, cv2 rows (default 4)")
    p.add_argument("--pil-workers", type=int, default=2, help="DataLoader num_workers, PIL row (default 2)")
    p.add_argument("--ceiling-images", type=int, default=400,
                   help="images timed by each 1-thread ceiling (default 400)")
    p.add_argument("--only", type=lambda t: [x.strip() for x in t.split(",") if x.strip()], default=None,
                   help="comma-separated row names to run (default: every row)")
    p.add_argument("--report", default=None,
                   help="print the tables of a saved region_decode.json instead of measuring")
    p.add_argument("--stage-images", type=int, default=300,
                   help="images timed per stage, in process (default 300; 0: no stage table)")


UNVERIFIED = {"jpeg_verify": False}


def specs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every throughput row's child spec, by row name."""
    base = {"mode": "loader", "batch_size": args.batch_size, "seed": args.seed,
            "decode_threads": "auto", "augment_threads": "auto"}
    s = {**base, "root": args.dir, "epochs": args.epochs}
    big = {**base, "root": args.large, "epochs": args.large_epochs}
    ceiling = {"mode": "ceiling", "root": args.dir, "limit": args.ceiling_images}
    return {
        "feeder region": {**s, "kind": "feeder"},
        # Reading stops after the crop's last row: damage above or inside the
        # crop can go unseen (see Feeder's jpeg_verify).
        "feeder region (jpeg_verify=False)": {**s, "kind": "feeder", "feeder_options": UNVERIFIED},
        "feeder simplejpeg": {**s, "kind": "feeder", "env": NO_EXT},
        "DataLoader+cv2 simplejpeg": {**s, "kind": "dl-cv2", "workers": args.workers, "env": NO_EXT},
        "DataLoader+cv2 region": {**s, "kind": "dl-cv2", "workers": args.workers},
        "DataLoader+PIL": {**s, "kind": "dl-pil", "workers": args.pil_workers, "env": NO_EXT},
        "ceiling full decode": {**ceiling, "full_decode": True, "env": NO_EXT},
        "ceiling simplejpeg work": {**ceiling, "env": NO_EXT},
        "ceiling region work": {**ceiling},
        # Both cores at once, one process each on its own share of the images:
        # what two cores really give this work (their shared cache and memory
        # cost a few percent against one thread on an idle machine).
        "parallel ceiling full decode": {**ceiling, "mode": "ceiling-parallel", "full_decode": True,
                                         "env": NO_EXT},
        "parallel ceiling region work": {**ceiling, "mode": "ceiling-parallel"},
        "large: feeder region": {**big, "kind": "feeder"},
        "large: feeder region (jpeg_verify=False)": {**big, "kind": "feeder", "feeder_options": UNVERIFIED},
        "large: feeder simplejpeg": {**big, "kind": "feeder", "env": NO_EXT},
        "large: feeder full decode": {**big, "kind": "feeder", "full_decode": True, "env": NO_EXT},
        "large eval: feeder region": {**big, "kind": "feeder", "evaluation": True},
        "large eval: feeder simplejpeg": {**big, "kind": "feeder", "evaluation": True, "env": NO_EXT},
        "large eval: feeder full decode": {**big, "kind": "feeder", "evaluation": True,
                                           "full_decode": True, "env": NO_EXT},
    }


#: (label, numerator row, denominator row, the issue's target or None).
RATIOS = [
    ("feeder region / ceiling full decode (1-thread x cores)", "feeder region", "ceiling full decode", 1.2),
    ("feeder region / ceiling region work (1-thread x cores)", "feeder region", "ceiling region work", None),
    ("feeder region / parallel ceiling region work", "feeder region", "parallel ceiling region work", None),
    ("parallel ceiling region work / ceiling full decode", "parallel ceiling region work",
     "ceiling full decode", None),
    ("parallel ceiling full decode / ceiling full decode", "parallel ceiling full decode",
     "ceiling full decode", None),
    ("parallel ceiling region work / DataLoader+cv2 simplejpeg", "parallel ceiling region work",
     "DataLoader+cv2 simplejpeg", None),
    ("parallel ceiling region work / DataLoader+PIL", "parallel ceiling region work", "DataLoader+PIL", None),
    ("feeder region (jpeg_verify=False) / ceiling full decode", "feeder region (jpeg_verify=False)",
     "ceiling full decode", None),
    ("feeder region (jpeg_verify=False) / DataLoader+cv2 simplejpeg", "feeder region (jpeg_verify=False)",
     "DataLoader+cv2 simplejpeg", None),
    ("feeder region (jpeg_verify=False) / DataLoader+PIL", "feeder region (jpeg_verify=False)", "DataLoader+PIL",
     None),
    ("large: region (jpeg_verify=False) / full decode", "large: feeder region (jpeg_verify=False)",
     "large: feeder full decode", None),
    ("feeder region / feeder simplejpeg", "feeder region", "feeder simplejpeg", None),
    ("feeder region / DataLoader+cv2 simplejpeg", "feeder region", "DataLoader+cv2 simplejpeg", 1.5),
    ("feeder region / DataLoader+cv2 region", "feeder region", "DataLoader+cv2 region", None),
    ("feeder region / DataLoader+PIL", "feeder region", "DataLoader+PIL", 3.5),
    ("large: region / full decode", "large: feeder region", "large: feeder full decode", 2.0),
    ("large: region / simplejpeg (reduced scale)", "large: feeder region", "large: feeder simplejpeg", None),
    ("large eval: region / full decode", "large eval: feeder region", "large eval: feeder full decode", 1.3),
    ("large eval: region / simplejpeg", "large eval: feeder region", "large eval: feeder simplejpeg", None),
]


def _busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _timed_row(spec: dict[str, Any], cores: int) -> dict[str, Any] | None:
    """One child run: img/s (a ceiling: 1-thread rate x cores), CPU ms/img, the cores
    it used and the cores other processes used meanwhile."""
    busy0, kids0, t0 = _busy_s(), _children_cpu_s(), time.perf_counter()
    res = run_child(spec, memory=False)
    busy1, kids1, elapsed = _busy_s(), _children_cpu_s(), time.perf_counter() - t0
    if not res.ok:
        report.progress(f"  FAILED: {res.error[:400]}")
        return None
    ceiling = spec["mode"] == "ceiling"
    # A ceiling's wall rate here; render() takes its CPU-time rate.
    row = {"img_s": cores * 1e3 / res.extra["per_image_ms"] if ceiling else res.images_per_s,
           "cpu_ms": 1e3 * res.cpu_per_image_s if res.cpu_per_image_s else None,
           "cores_used": res.cpu_s / res.wall_s if res.wall_s > 0 else None}
    ends, counts = res.extra.get("epoch_end_s") or [], res.extra.get("epoch_images") or []
    if len(ends) > 1 and ends[-1] > ends[0]:
        # The epochs after the first: what a long run gets once its first epoch
        # (start-up, and each file read to its end) is behind it.
        row["img_s_later"] = (counts[-1] - counts[0]) / (ends[-1] - ends[0])
    if busy0 is not None and busy1 is not None and elapsed > 0:
        # The machine's busy time less the child's whole CPU (start-up included:
        # run_child reaps it, so it is in RUSAGE_CHILDREN), over the same window.
        row["other_cores"] = max(0.0, ((busy1 - busy0) - (kids1 - kids0)) / elapsed)
    return row


# -- stages ---------------------------------------------------------------------------

def _thread_ms(fn: Callable[[], None], n: int, repeats: int = 3) -> float:
    """Best of ``repeats`` of ``fn`` (one pass over ``n`` images), in ms per image of
    this thread's CPU time."""
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        best = min(best, (time.thread_time() - t) / n * 1e3)
    return best


def stage_costs(root: str, limit: int, chain: list[ops.Transform],
                full_chain: list[ops.Transform]) -> dict[str, float]:
    """One thread, per image (ms of CPU): where the region path's time goes, against
    full decode + crop + resize on the same crops.

    Returns:
        ``full``: full decode + crop + resize; ``full_decode``: its decode alone;
        ``region``: the region path (decode + transforms into the output) in an
        epoch after the first (every file already read to its end once, see
        :mod:`feeder.decode.verified`); ``region_first``: the same in the first
        epoch; ``header_plan``: reading the header and drawing the box;
        ``crc``: the fingerprint of each file (its CRC-32C); ``region_c``: the
        extension's decode (after the first epoch: down to the crop's last
        row); ``region_c_first``: the same, reading each file to its end;
        ``rest``: crop, resize into the output, flip and Python;
        ``entropy_to_bottom``: entropy decoding of the rows down to the crop's
        last row (what any region decode must do); ``entropy_whole``: the same
        for the whole image; ``scaled_share``: share of images decoded below
        1/1.
    """
    from ..decode import extension

    ext = extension.jpeg
    if ext is None:
        raise RuntimeError(f"the region decoder is not in use: {extension.missing}")
    source = ImageFolder(root)
    idx = np.linspace(0, len(source) - 1, min(limit, len(source))).astype(int).tolist()
    datas = [source.read(i)[0] for i in idx]
    keys = [sample_key(0, 0, i) for i in idx]
    n = len(datas)
    # Each JPEG's index sized as a feeder over this source sizes it.
    region = SampleWork(Chain(chain, None), files=len(source))
    full = SampleWork(Chain(full_chain, None), files=len(source))
    h, w = region.image_size
    out = np.empty((h, w, 3), np.uint8)

    def run(work: SampleWork) -> Callable[[], None]:
        def go() -> None:
            for d, k in zip(datas, keys):
                img, ctx = work.decode(d, k)
                work.transform(img, k, ctx, out)
        return go

    def headers() -> None:
        plan = region.plan
        for d, k in zip(datas, keys):
            wd, ht = ext.header(d)[:2]
            plan(ht, wd, k)

    def full_decodes() -> None:
        for d, k in zip(datas, keys):
            img, ctx = full.decode(d, k)
            full.discard(img)

    # The extension's calls, recorded once: the C decode alone, and the entropy
    # decoding down to each crop's last row (a one-pixel region there).
    calls: list[tuple] = []
    real = ext.decode

    class Recorder:
        def __getattr__(self, name: str) -> Any:
            return getattr(ext, name)

        @staticmethod
        def decode(data: Any, top: int, left: int, height: int, width: int, denom: int, buf: Any,
                   max_pixels: int, *rest: Any, **kw: Any) -> Any:
            calls.append((data, top, left, height, width, denom, max_pixels, rest, kw))
            return real(data, top, left, height, width, denom, buf, max_pixels, *rest, **kw)

    run(region)()  # the first epoch: every file read to its end and remembered
    region.jpeg.ext = Recorder()
    try:
        run(region)()  # the calls of an epoch after the first
    finally:
        region.jpeg.ext = ext
    biggest = max(c[3] * (c[4] + 2 * ext.PAD + 32) * 3 for c in calls)
    buf = np.empty(max(biggest, 1 << 16), np.uint8)

    def c_decodes() -> None:  # as the region path made them after the first epoch (with the index)
        for data, top, left, height, width, denom, mp, rest, kw in calls:
            real(data, top, left, height, width, denom, buf, mp, *rest, **kw)

    def c_decodes_no_index() -> None:  # the same, from the first row
        for data, top, left, height, width, denom, mp, rest, _ in calls:
            real(data, top, left, height, width, denom, buf, mp, False, False)

    def c_decodes_libjpeg() -> None:  # the same, with libjpeg-turbo's Huffman decoder
        for data, top, left, height, width, denom, mp, rest, _ in calls:
            real(data, top, left, height, width, denom, buf, mp, False, False, own=False)

    def c_decodes_first() -> None:  # each file read to its end, its index recorded
        for data, top, left, height, width, denom, mp, rest, kw in calls:
            real(data, top, left, height, width, denom, buf, mp, False, True, record=True,
                 max_points=kw.get("max_points", 16))

    def to_bottom() -> None:  # verify=False: reading stops at that row
        for data, top, left, height, width, denom, mp, _, _ in calls:
            real(data, top + height - 1, left, 1, 1, denom, buf, mp, False, False)

    def column(indexed: bool) -> Callable[[], None]:  # the crop's rows, one pixel wide (little IDCT)
        def go() -> None:
            for data, top, left, height, width, denom, mp, _, kw in calls:
                real(data, top, left, height, 1, denom, buf, mp, False, False,
                     index=kw.get("index") if indexed else None)
        return go

    def whole() -> None:
        for data, *_, mp, _, _ in calls:
            wd, ht = ext.header(data)[:2]
            real(data, ht - 1, 0, 1, 1, 1, buf, mp)

    def crcs() -> None:
        for d in datas:
            VerifiedJpegs.fingerprint(d)

    def first_epochs() -> None:
        run(SampleWork(Chain(chain, None), files=len(source)))()

    costs = {"full": _thread_ms(run(full), n), "full_decode": _thread_ms(full_decodes, n),
             "region": _thread_ms(run(region), n), "region_first": _thread_ms(first_epochs, n),
             "header_plan": _thread_ms(headers, n), "crc": _thread_ms(crcs, n),
             "region_c": _thread_ms(c_decodes, n), "region_c_first": _thread_ms(c_decodes_first, n),
             "region_c_no_index": _thread_ms(c_decodes_no_index, n),
             "region_c_libjpeg": _thread_ms(c_decodes_libjpeg, n),
             "entropy_to_bottom": _thread_ms(to_bottom, n),
             "column_first_row": _thread_ms(column(False), n),
             "column_index": _thread_ms(column(True), n),
             "entropy_whole": _thread_ms(whole, n)}
    costs["indexed_share"] = sum(c[8].get("index") is not None for c in calls) / max(1, len(calls))
    costs["rest"] = max(0.0, costs["region"] - costs["region_c"] - costs["header_plan"] - costs["crc"])
    costs["scaled_share"] = sum(c[5] > 1 for c in calls) / max(1, len(calls))
    return costs


def _stage_lines(name: str, c: dict[str, float], cores: int) -> list[str]:
    if "region_first" not in c:  # a report from before the fingerprints (all epochs read to the end)
        c = {**c, "region_first": c["region"], "region_c_first": c["region_c"], "crc": 0.0}
    return [
        f"{name}: one thread, ms of CPU per image (best of 3 passes)",
        f"  full decode + crop + resize  {c['full']:6.2f}   (decode {c['full_decode']:.2f})",
        f"  region path, after epoch 1   {c['region']:6.2f}   = header+plan {c['header_plan']:.3f}"
        f" + CRC-32C {c['crc']:.3f} + C region decode {c['region_c']:.2f}"
        f" + crop/resize/flip/Python {c['rest']:.2f}",
        f"  region path, first epoch     {c['region_first']:6.2f}   (C region decode reading each file"
        f" to its end {c['region_c_first']:.2f})",
        *([f"  C region decode after epoch 1: {c['region_c']:.2f} with the index"
           f" ({c['indexed_share']:.0%} of the files had one), {c['region_c_no_index']:.2f} from the"
           f" first row, {c['region_c_libjpeg']:.2f} with libjpeg-turbo's Huffman decoder",
           f"  entropy decoding down to the crop's last row {c['entropy_to_bottom']:.2f}"
           f" (whole image {c['entropy_whole']:.2f}); the crop's rows one pixel wide"
           f" {c['column_first_row']:.2f} from the first row, {c['column_index']:.2f} from the"
           f" checkpoints before the crop"]
          if "region_c_no_index" in c else
          [f"  entropy decoding down to the crop's last row {c['entropy_to_bottom']:.2f}"
           f" (whole image {c['entropy_whole']:.2f}): {c['entropy_to_bottom'] / c['region_c']:.0%}"
           f" of the C region decode, which no region decode can skip"]),
        f"  decode time saved {1 - c['region_c'] / c['full_decode']:.0%} ({1 - c['region_c_first'] / c['full_decode']:.0%}"
        f" in the first epoch); per-image speed-up {c['full'] / c['region']:.2f}x"
        f" ({c['full'] / c['region_first']:.2f}x); {c['scaled_share']:.0%} decoded below 1/1; at"
        f" {cores} cores with no engine overhead: {cores * 1e3 / c['region']:.0f} img/s vs the"
        f" full-decode ceiling {cores * 1e3 / c['full']:.0f}",
    ]


# -- the subcommand ----------------------------------------------------------------

def render(doc: dict[str, Any]) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """The report's text, table rows and ratios from its measurements (``meta`` of the JSON)."""
    rows, cores = doc["specs"], doc["cores"]
    names = list(rows)
    # A ceiling's rate is its one thread's *CPU* time per image times the cores:
    # on a shared machine its wall time also counts the time other processes
    # held its core (on a quiet one the two agree). The wall rate stays as img_s_wall.
    rounds = []
    for g in doc["rounds"]:
        g = {name: dict(r) for name, r in g.items()}
        for name, r in g.items():
            if rows.get(name, {}).get("mode") == "ceiling" and r.get("cpu_ms"):
                r.setdefault("img_s_wall", r["img_s"])
                r["img_s"] = cores * 1e3 / r["cpu_ms"]
        rounds.append(g)

    def med(name: str, key: str) -> float:
        vals = [g[name][key] for g in rounds if name in g and g[name].get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    def later(r: dict[str, Any], name: str) -> float | None:
        # A ceiling already times an epoch after the first.
        return r["img_s"] if rows[name]["mode"] != "loader" else r.get("img_s_later")

    lines = [f"region-decode on {doc['dir']} and {doc['large']}: batch {doc['batch_size']}, thread "
             f"counts 'auto', median of {len(rounds)} rounds (rows in a rotated order each round); "
             f"ceilings are 1-thread rates (from the thread's CPU time per image) x {cores} cores",
             f"command: {doc['command']}",
             f"machine: {doc['machine']}",
             "load average (1 min) before and after each round: "
             + ", ".join(f"{x:.2f}" for x in doc["load_average"]), "",
             f"{'row':<42} {'img/s':>7} {'CPU ms/img':>10} {'cores used':>10} {'other load':>10} "
             f"{'img/s after epoch 1':>19}"]
    table = []
    for name in names:
        row = {"row": name, "images_per_s": med(name, "img_s"), "cpu_ms_per_image": med(name, "cpu_ms"),
               "cores_used": med(name, "cores_used"), "other_cores": med(name, "other_cores"),
               "images_per_s_after_epoch_1": med(name, "img_s_later") if rows[name]["mode"] == "loader"
               else float("nan")}
        table.append(row)
        cu = "(1 thread)" if rows[name]["mode"] == "ceiling" else f"{row['cores_used']:.2f}"
        after = row["images_per_s_after_epoch_1"]
        lines.append(f"{name:<42} {row['images_per_s']:>7.0f} {row['cpu_ms_per_image']:>10.2f} {cu:>10} "
                     f"{row['other_cores']:>10.2f} {'' if after != after else f'{after:.0f}':>19}")
    lines += ["", "other load: cores busy with other processes while the row ran (the machine's busy "
              "time less the row's own CPU, start-up included)", "",
              f"{'ratio (median of per-round ratios)':<64} {'img/s':>7} {'per round':>28} {'target':>7} met"
              f" {'CPU/img':>8} {'after epoch 1':>13} met"]
    ratios = {}
    for label, a, b, target in RATIOS:
        if a not in rows or b not in rows:
            continue
        rs = [g[a]["img_s"] / g[b]["img_s"] for g in rounds if a in g and b in g and g[b]["img_s"] > 0]
        # The same comparison in CPU per image: what each row's work costs, whatever
        # share of the cores the other processes left it.
        cpu = [g[b]["cpu_ms"] / g[a]["cpu_ms"] for g in rounds
               if a in g and b in g and g[a].get("cpu_ms") and g[b].get("cpu_ms")]
        # The same after each row's first epoch (a ceiling's rate is one already).
        ls = [later(g[a], a) / later(g[b], b) for g in rounds if a in g and b in g
              and later(g[a], a) and later(g[b], b)]
        m = statistics.median(rs) if rs else float("nan")
        c = statistics.median(cpu) if cpu else float("nan")
        lm = statistics.median(ls) if ls else float("nan")
        ratios[label] = {"median": m, "rounds": rs, "target": target, "cpu_per_image": c,
                         "after_epoch_1": lm, "rounds_after_epoch_1": ls}
        met = "" if target is None else ("yes" if m >= target else "NO")
        lmet = "" if target is None or lm != lm else ("yes" if lm >= target else "NO")
        each = " ".join(f"{x:.2f}" for x in rs)
        lines.append(f"{label:<64} {m:>6.2f}x {each:>28} {('>= %.1fx' % target) if target else '':>7} "
                     f"{met:<3} {c:>7.2f}x {'' if lm != lm else f'{lm:.2f}x':>13} {lmet}")
    lines += ["", "CPU/img: the denominator row's CPU per image over the numerator's (for a ceiling, "
              "its one thread's CPU per image)",
              "after epoch 1: the loaders' rates over the epochs after their first (start-up and the "
              "first epoch, which reads each file to its end, left out), against the ceilings, which "
              "time an epoch after the first too; what a long training run sees"]
    for name, c in doc.get("stages", {}).items():
        lines += [""] + _stage_lines(name, c, cores)
    return "\n".join(lines), table, ratios


def run(args: argparse.Namespace) -> int:
    """The ``region-decode`` subcommand."""
    import json
    import sys

    from ..decode import extension

    if args.report:
        try:
            with open(args.report) as f:
                saved = json.load(f)
            meta = dict(saved["meta"])
            meta.setdefault("command", saved.get("command", "?"))
            meta.setdefault("machine", report.describe_machine(saved["machine"]))
        except (ValueError, KeyError, TypeError) as exc:  # OSError names the file itself
            raise ValueError(f"--report {args.report}: not a saved region_decode.json "
                             f"({type(exc).__name__}: {exc})") from exc
        meta.setdefault("batch_size", 64)
        text, _, _ = render(meta)
        print(text)
        return 0
    if args.large is None:
        raise ValueError("region-decode needs --large LARGE (an ImageFolder of large photos)")
    cores = available_cores()
    if extension.jpeg is None:
        raise SystemExit(f"region-decode: the region decoder is not in use ({extension.missing})")
    rows = specs(args)
    if args.only:
        unknown = sorted(set(args.only) - set(rows))
        if unknown:
            raise SystemExit(f"region-decode: --only names unknown rows {unknown}; rows: {list(rows)}")
        rows = {name: spec for name, spec in rows.items() if name in args.only}
    names = list(rows)
    rounds: list[dict[str, dict[str, Any]]] = []
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        report.progress(f"region-decode: round {r + 1}/{args.rounds}")
        got: dict[str, dict[str, Any]] = {}
        order = names[r % len(names):] + names[:r % len(names)]  # rotated: drift lands on every row
        for name in order:
            row = _timed_row(rows[name], cores)
            if row is not None:
                got[name] = row
                report.progress(f"  {name}: {row['img_s']:.0f} img/s, other load "
                                f"{row.get('other_cores', float('nan')):.2f} cores")
        rounds.append(got)
        load.append(os.getloadavg()[0])
    stages = {}
    if args.stage_images > 0:
        report.progress("region-decode: stages")
        stages["imagenet-like train"] = stage_costs(args.dir, args.stage_images, transforms(),
                                                    full_decode_transforms())
        stages["large train"] = stage_costs(args.large, args.stage_images, transforms(),
                                            full_decode_transforms())
        stages["large eval"] = stage_costs(args.large, args.stage_images, eval_transforms(),
                                           eval_transforms(full_decode=True))
    machine = report.machine_info()
    doc = {"dir": args.dir, "large": args.large, "batch_size": args.batch_size, "rounds": rounds,
           "stages": stages, "load_average": load, "cores": cores, "specs": rows,
           "command": " ".join(["feeder-bench", *sys.argv[1:]]), "machine": report.describe_machine(machine)}
    text, table, doc["ratios"] = render(doc)
    print(text)
    report.write_outputs(args.out, "region_decode", table, doc, machine=machine)
    with open(os.path.join(args.out, "region_decode.txt"), "w") as f:
        f.write(text + "\n")
    return 0
