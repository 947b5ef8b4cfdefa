#!/usr/bin/env bash
# Regenerate every table and plot in bench/results/ (about 30 minutes on a
# 2-core machine). Run it on a quiet machine: the figures are wall-clock.
#
#   bash bench/run_all.sh
#
# Environment:
#   PYTHON              interpreter with feeder[bench] installed (default: .venv's,
#                       set up by scripts/env.sh when missing)
#   FEEDER_BENCH_DATA   scratch folder for the generated datasets
#                       (default ${TMPDIR:-/tmp}/feeder-bench-data; reused when present)
#   FEEDER_BENCH_OUT    results folder (default bench/results)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PYTHON="$(bash bench/python.sh)"
data="${FEEDER_BENCH_DATA:-${TMPDIR:-/tmp}/feeder-bench-data}"
out="${FEEDER_BENCH_OUT:-bench/results}"
bench() { "$PYTHON" -m feeder.bench "$@"; }

mkdir -p "$out"
rm -f "$out"/*.csv "$out"/*.json "$out"/*.png "$out"/*.txt

# ImageNet-like: 2000 JPEGs, 300-600 px a side, quality 75-95. Large: 200 photos of ~1500x1100.
bench make-data "$data/imagenet-like" --n-classes 20 --per-class 100 --seed 0 | tee "$out/data.txt"
bench make-data "$data/large" --large --n-classes 4 --per-class 50 --seed 1 | tee -a "$out/data.txt"
# Small: 20000 JPEGs, 64-96 px a side (thumbnails, downsampled datasets).
bench make-data "$data/small" --small --n-classes 20 --per-class 1000 --seed 1 | tee -a "$out/data.txt"

bench ceiling "$data/imagenet-like" --out "$out" --limit 500 --repeats 3 | tee "$out/ceiling.txt"
bench compare "$data/imagenet-like" --out "$out" --epochs 3 --repeats 5 --scan-repeats 2 --batch-size 64 \
  --workers-grid 0,1,2,3,4 --threads-grid 2x0,3x0,4x0,2x1,3x1,4x2 --targets | tee "$out/compare.txt"
# feeder against DataLoader, DALI's CPU pipeline and SPDL (those two when installed: pip install
# 'feeder[peers]'), first and steady epochs: 224 px photos, then 64 px small images (10000 per epoch).
# Each writes its own .txt.
bench peers "$data/imagenet-like" --out "$out" --size 224 --batch-size 64 --epochs 3 --repeats 3 \
  --name peers_224
bench peers "$data/small" --out "$out" --size 64 --batch-size 256 --epochs 3 --repeats 3 --limit 10000 \
  --name peers_small
bench sweep "$data/imagenet-like" --out "$out" --decode 1,2,3,4 --augment 0,1,2 --queue 2,4 \
  --step-ms 0,40 --repeats 3 --batch-size 64 | tee "$out/sweep.txt"
bench scaled-decode "$data/large" --out "$out" --repeats 3 --batch-size 64 | tee "$out/scaled_decode.txt"
# The JPEG region decoder (feeder.decode._jpeg) against the simplejpeg path, DataLoader and the full-decode
# ceiling, and where its time goes per image (writes region_decode.txt itself).
bench region-decode "$data/imagenet-like" --large "$data/large" --out "$out" --rounds 5 --epochs 2 \
  --large-epochs 3
# Storage: a source whose reads block 10 ms; shards over loopback HTTP at 15 ms per request
# (first epoch, then from the cache); local shards against the folder of files.
bench read-latency "$data/imagenet-like" --out "$out" --latency-ms 10 --limit 2000 --rounds 3 \
  --workers 2,4,8 | tee "$out/read_latency.txt"
bench remote "$data/imagenet-like" --out "$out" --latency-ms 15 --shard-size 16MB --rounds 3 \
  --workers 2,4,8 | tee "$out/remote.txt"
bench shards "$data/imagenet-like" --out "$out" --shard-size 64MB --epochs 2 --rounds 3 \
  --workers 2,4 | tee "$out/shards.txt"
# The training thread's step alone and fed by each loader (GIL interference): proxy and model steps,
# the loop on one core and the loader on the other.
bench interference "$data/imagenet-like" --out "$out" --rounds 5 --batch-size 64 | tee "$out/interference.txt"
# Where each thread holds the GIL per image (py-spy, in the bench extra; needs ptrace permission).
if "$PYTHON" -c "import shutil, sys, os; sys.exit(0 if shutil.which('py-spy') or os.path.exists(os.path.join(os.path.dirname(sys.executable), 'py-spy')) else 1)"; then
  { "$PYTHON" bench/experiments/gil_profile.py "$data/imagenet-like" --loader feeder --seconds 20 --rate 500
    echo
    "$PYTHON" bench/experiments/gil_profile.py "$data/imagenet-like" --loader work-thread --seconds 20 --rate 500
  } | tee "$out/gil_profile.txt"
else
  echo "py-spy not installed: bench/results/gil_profile.txt not regenerated (pip install py-spy)" >&2
fi
# What JPEG decoding costs, by decoder and setting; what a region-of-interest decode could save.
"$PYTHON" bench/experiments/decode_cost.py "$data/imagenet-like" | tee "$out/decode_cost.txt"
# What a feeder holds resident, per component, against the memory page's formula.
"$PYTHON" bench/experiments/memory_formula.py "imagenet-like=$data/imagenet-like:224:64" \
  "small=$data/small:64:256" "large=$data/large:224:64" --epochs 1,3 --rounds 3 | tee "$out/memory_formula.txt"
echo "results in $out" >&2
