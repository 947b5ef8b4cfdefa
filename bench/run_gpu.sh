#!/usr/bin/env bash
# On a CUDA machine: the CUDA tests and the GPU and many-core benchmarks, into
# bench/results/gpu-<GPU name>/. Each part stays under ten minutes, so the
# parts can also be run one by one:
#
#   bash bench/run_gpu.sh            # all parts
#   bash bench/run_gpu.sh tests      # tests/cuda, verbose, then scripts/gpu-check (its table)
#   bash bench/run_gpu.sh cpu        # ceiling + compare on CPU, all cores (the DataLoader targets)
#   bash bench/run_gpu.sh cuda       # compare --device cuda --model, then overlap (profiler trace)
#   bash bench/run_gpu.sh interference   # the training thread's CUDA step alone and fed (GIL interference)
#
# Environment: as bench/run_all.sh (PYTHON, FEEDER_BENCH_DATA, FEEDER_BENCH_OUT).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
part="${1:-all}"
case "$part" in all|tests|cpu|cuda|interference) ;;
  *) echo "usage: bash bench/run_gpu.sh [all|tests|cpu|cuda|interference]" >&2; exit 2;; esac
PYTHON="$(bash bench/python.sh)"
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "run_gpu.sh: torch.cuda.is_available() is False for $PYTHON; this script is for a CUDA machine" >&2
  exit 2
fi
gpu="$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0))")"
slug="$(printf '%s' "$gpu" | tr -cs 'A-Za-z0-9' '-' | sed 's/-*$//')"
data="${FEEDER_BENCH_DATA:-${TMPDIR:-/tmp}/feeder-bench-data}"
out="${FEEDER_BENCH_OUT:-bench/results/gpu-$slug}"
bench() { "$PYTHON" -m feeder.bench "$@"; }
mkdir -p "$out/cpu" "$out/cuda" "$out/interference"
echo "GPU: $gpu; results in $out" >&2

if [ ! -d "$data/imagenet-like" ]; then  # the same dataset as bench/run_all.sh
  bench make-data "$data/imagenet-like" --n-classes 20 --per-class 100 --seed 0 | tee "$out/data.txt"
fi

if [ "$part" = all ] || [ "$part" = tests ]; then
  "$PYTHON" -m pytest tests/cuda -v 2>&1 | tee "$out/cuda_tests.txt"
  # The acceptance table of the CUDA transfer path (the suite ran just above).
  PYTHON="$PYTHON" bash scripts/gpu-check --skip-suite 2>&1 | tee "$out/gpu_check.txt"
fi

if [ "$part" = all ] || [ "$part" = cpu ]; then
  bench ceiling "$data/imagenet-like" --out "$out/cpu" --limit 500 --repeats 3 | tee "$out/cpu/ceiling.txt"
  bench compare "$data/imagenet-like" --out "$out/cpu" --epochs 3 --repeats 3 --batch-size 64 \
    --workers-grid 4,8,12,16 --threads-grid 8x0,16x0,24x0,12x4 | tee "$out/cpu/compare.txt"
fi

if [ "$part" = all ] || [ "$part" = cuda ]; then
  bench compare "$data/imagenet-like" --out "$out/cuda" --device cuda --model --epochs 2 --repeats 3 \
    --batch-size 64 --workers-grid 4,8,16 --threads-grid 8x0,16x0 | tee "$out/cuda/compare.txt"
  bench overlap "$data/imagenet-like" --out "$out/cuda" --loaders feeder,dl-cv2 --workers 8 \
    --batches 30 --warmup 10 --batch-size 64 | tee "$out/cuda/overlap.txt"
fi

if [ "$part" = all ] || [ "$part" = interference ]; then
  # The synchronized CUDA step (kernel launches: the real thing the proxy stands for) and the
  # launch-bound proxy, alone and fed, with the loader on one core; then the model step with the
  # loader on 8 cores (decode_threads=8 against num_workers=8), the loop on its own core throughout.
  bench interference "$data/imagenet-like" --out "$out/interference" --device cuda --rounds 3 \
    --batch-size 64 --loader-cores 1 | tee "$out/interference/interference.txt"
  bench interference "$data/imagenet-like" --out "$out/interference/loader8" --device cuda --rounds 3 \
    --batch-size 64 --loader-cores 8 --steps model | tee "$out/interference/interference_loader8.txt"
fi
echo "results in $out" >&2
