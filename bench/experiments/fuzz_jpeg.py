"""A long fuzz run of the JPEG region decoder (``feeder.decode._jpeg``), by hand.

Mutates valid JPEGs (4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1, gray, progressive,
restart markers) with bit flips, truncation, insertion, deletion,
overwrites and fill bytes (before a stuffed zero, before a marker), decodes a random region at a random scale of each, and checks that
every input gives an image of the asked shape or ``DecodeError`` (anything
else stops the run with the input saved); that feeder's Huffman decoder
(``feeder/decode/_huffman.c``) refuses whatever libjpeg-turbo's refuses and gives
its pixels where both decode (``own refuses`` counts the inputs only feeder's
refuses: bytes before a marker that libjpeg-turbo's read-ahead swallowed, an
invalid code its fast path read as zero); that a decode from the index
recorded on the way (every few rows, or every row and every few MCUs along
it: ``max_points`` 16, 64 or 4096) gives the same pixels again (and a garbled index an image
or ``DecodeError``), that no input takes longer than
``--slow-s`` seconds, and that the process's memory stays flat (RSS printed
every ``--every`` inputs; the run fails when the last reading is more than
``--max-growth-mb`` above the one after the warm-up).

    PYTHONPATH=. python bench/experiments/fuzz_jpeg.py --count 50000

Under AddressSanitizer (see bench/README.md) build the extension with
``-fsanitize=address`` and preload libasan; OpenCV aborts under a preloaded
libasan, so write the seed files first (``--write-seeds DIR``, without ASan)
and read them in the sanitized run (``--seeds DIR``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import numpy as np

from feeder import DecodeError
from feeder import decode as _decode


def seeds() -> list[bytes]:
    import cv2

    from feeder.synthetic import make_image
    out = []
    flags = [[cv2.IMWRITE_JPEG_SAMPLING_FACTOR, f] for f in (
        cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422,
        cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_440,
        cv2.IMWRITE_JPEG_SAMPLING_FACTOR_411)]
    flags += [[cv2.IMWRITE_JPEG_PROGRESSIVE, 1], [cv2.IMWRITE_JPEG_RST_INTERVAL, 2], []]
    for k, f in enumerate(flags):
        img = make_image(64 + 8 * k, 96 - 4 * k, seed=k)[..., ::-1]
        if k == len(flags) - 1:
            img = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
        ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(img), [cv2.IMWRITE_JPEG_QUALITY, 85] + f)
        assert ok
        out.append(buf.tobytes())
    return out


def fill_bytes(buf: bytearray, rnd: random.Random) -> None:
    """Insert fill bytes (FF) before a stuffed zero (FF 00: invalid, feeder's
    decoder refuses it) or before a marker (valid: libjpeg's pixels)."""
    pairs = [i for i in range(len(buf) - 1) if buf[i] == 0xFF and (buf[i + 1] == 0 or 0xD0 <= buf[i + 1] <= 0xD9)]
    if pairs:
        at = rnd.choice(pairs)
        buf[at:at] = b"\xff" * rnd.randint(1, 3)


def mutate(data: bytes, rnd: random.Random) -> bytes:
    buf = bytearray(data)
    if rnd.random() < 0.2:  # fill bytes alone: mostly a valid file or exactly one fault
        fill_bytes(buf, rnd)
        if rnd.random() < 0.5:
            return bytes(buf)
    for _ in range(rnd.randint(1, 6)):
        at = rnd.randrange(0, 700) if rnd.random() < 0.5 else rnd.randrange(0, len(buf) + 1)
        at = min(at, len(buf))
        kind = rnd.randrange(5)
        if kind == 0 and buf:
            buf[min(at, len(buf) - 1)] ^= 1 << rnd.randrange(8)
        elif kind == 1:
            del buf[at:]
        elif kind == 2:
            buf[at:at] = rnd.randbytes(rnd.randint(1, 16))
        elif kind == 3:
            buf[at:at + 8] = rnd.randbytes(rnd.randint(1, 8))
        else:
            del buf[at:at + rnd.randint(1, 32)]
    return bytes(buf)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long (a bounded run)")
    ap.add_argument("--slow-s", type=float, default=2.0)
    ap.add_argument("--max-growth-mb", type=float, default=20.0)
    ap.add_argument("--save", default="/tmp/fuzz_jpeg_failure.jpg")
    ap.add_argument("--write-seeds", metavar="DIR", help="write the seed JPEGs to DIR and exit")
    ap.add_argument("--seeds", metavar="DIR", help="read the seed JPEGs from DIR (no OpenCV needed)")
    args = ap.parse_args()
    if args.write_seeds:
        os.makedirs(args.write_seeds, exist_ok=True)
        for k, data in enumerate(seeds()):
            with open(os.path.join(args.write_seeds, f"seed{k}.jpg"), "wb") as f:
                f.write(data)
        return 0
    ext = _decode._jpeg
    if ext is None:
        print(f"the region decoder is not in use: {_decode._jpeg_missing}", file=sys.stderr)
        return 2
    rnd = random.Random(args.seed)
    if args.seeds:
        base = [open(os.path.join(args.seeds, n), "rb").read() for n in sorted(os.listdir(args.seeds))]
    else:
        base = seeds()
    buf = np.empty(1 << 22, np.uint8)
    counts = {"image": 0, "DecodeError": 0}
    slowest = 0.0
    start_rss = None
    t0 = time.perf_counter()
    done = args.count
    for i in range(1, args.count + 1):
        if args.seconds is not None and time.perf_counter() - t0 > args.seconds:
            done = i - 1
            break
        data = mutate(rnd.choice(base), rnd)
        t = time.perf_counter()
        try:
            width, height, *_ = ext.header(data)
            d = rnd.choice((1, 2, 4, 8))
            H, W = -(-height // d), -(-width // d)
            if not 0 < H * W <= 1 << 20:
                raise DecodeError("too large for this run")  # the decoder's own check is tested in CI
            top, left = rnd.randrange(H), rnd.randrange(W)
            h, w = rnd.randint(1, H - top), rnd.randint(1, W - left)
            if h * (w + 2 * ext.PAD + 32) * 3 > buf.size:
                raise DecodeError("region too large for this run's buffer")
            compact = rnd.random() < 0.5
            size = h * (w if compact else w + 2 * ext.PAD + 32) * 3
            # libjpeg-turbo's own Huffman decoder first: feeder's must not pass
            # what it refuses, nor give other pixels where both pass.
            try:
                ext.decode(data, top, left, h, w, d, buf, 1 << 20, compact, own=False)
                reference = buf[:size].copy()
            except DecodeError:
                reference = None
            try:
                stride, offset, index, _ = ext.decode(data, top, left, h, w, d, buf, 1 << 20, compact,
                                                      record=True, max_points=rnd.choice((16, 64, 4096)))
            except DecodeError:
                counts["own refuses"] = counts.get("own refuses", 0) + (reference is not None)
                raise
            assert reference is not None, "libjpeg's decoder refused what feeder's passed"
            assert np.array_equal(buf[:size], reference), "feeder's decoder gave other pixels"
            assert stride >= w + offset, (stride, offset, w)
            if index is not None:  # the same bytes again, from the index: the same pixels
                if rnd.random() < 0.1:  # or a garbled index: an image or DecodeError, no crash
                    bad = bytearray(index)
                    bad[rnd.randrange(len(bad))] ^= 1 << rnd.randrange(8)
                    try:
                        ext.decode(data, top, left, h, w, d, buf, 1 << 20, compact, False, index=bytes(bad))
                    except DecodeError:
                        pass
                else:
                    ext.decode(data, top, left, h, w, d, buf, 1 << 20, compact, False, index=index)
                    assert np.array_equal(buf[:size], reference), "the index gave other pixels"
                    counts["indexed"] = counts.get("indexed", 0) + 1
            counts["image"] += 1
        except DecodeError:
            counts["DecodeError"] += 1
        except BaseException:
            with open(args.save, "wb") as f:
                f.write(data)
            print(f"input {i}: not an image or DecodeError (saved to {args.save})", file=sys.stderr)
            raise
        took = time.perf_counter() - t
        slowest = max(slowest, took)
        if took > args.slow_s:
            with open(args.save, "wb") as f:
                f.write(data)
            print(f"input {i} took {took:.2f} s (saved to {args.save})", file=sys.stderr)
            return 1
        if i == min(args.every, args.count) // 2:
            start_rss = rss_mb()
        if i % args.every == 0:
            print(f"{i} inputs: {counts}, RSS {rss_mb():.1f} MiB, slowest {slowest * 1e3:.1f} ms, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    growth = rss_mb() - (start_rss or rss_mb())
    print(f"done: {done} inputs, {counts}, RSS growth after warm-up {growth:+.1f} MiB, "
          f"slowest {slowest * 1e3:.1f} ms")
    return 0 if growth <= args.max_growth_mb else 1


if __name__ == "__main__":
    sys.exit(main())
