#!/usr/bin/env bash
# On a CUDA machine: the GPU acceptance run, in about seven minutes on one GPU
# (the steps' budgets allow up to about half an hour),
# everything under one folder ($OUT when set, else bench/results/gpu/<date>/):
#
#   bash bench/run_gpu.sh            # tests, check, overlap, interference (about 7 min on one H200)
#   bash bench/run_gpu.sh all        # also the longer benchmarks below
#   bash bench/run_gpu.sh tests      # pytest tests/cuda only
#   bash bench/run_gpu.sh check      # scripts/gpu-check only (its table)
#   bash bench/run_gpu.sh cpu        # ceiling + compare on CPU, all cores (the DataLoader targets)
#   bash bench/run_gpu.sh cuda       # compare --device cuda --model, then overlap (profiler trace)
#   bash bench/run_gpu.sh interference   # the training thread's CUDA step alone and fed
#
# The default run, measured on one H200 with 16 cores (bench/results/gpu/):
# tests 91 s, check 64-99 s, the dataset 15 s, overlap about 40 s (its
# profiler trace of feeder and DataLoader feeding the model step), and a short
# interference run (2 rounds, 8 loader cores, the model step: threads, the
# worker process, DataLoader) about 150 s.
#
# Every step runs under `timeout` (its budget in seconds below) and goes on
# whatever the one before did: each writes its log (<step>.txt) and a line to
# status.txt (PASS, FAIL or SKIP, seconds, log); the exit status is the worst
# one (0 PASS, 1 FAIL; 2 when there is no GPU at all).
# Environment: as bench/run_all.sh (PYTHON, FEEDER_BENCH_DATA, FEEDER_BENCH_OUT), OUT
# (used when FEEDER_BENCH_OUT is not set), and
# STEP_BUDGET_S to scale every budget (e.g. 2 for a slower GPU).
#
# On a machine without a package index, carry what its Python lacks as wheels
# (simplejpeg, often: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 ... simplejpeg`, then `pip install --no-index --target
# DIR` there and PYTHONPATH=DIR). Where only a few files may come back, point
# FEEDER_BENCH_OUT at a scratch folder and pack it (`tar czf ... -C DIR .`).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
part="${1:-default}"
case "$part" in default|all|tests|check|cpu|cuda|interference) ;;
  *) echo "usage: bash bench/run_gpu.sh [default|all|tests|check|cpu|cuda|interference]" >&2; exit 2;; esac
PYTHON="${PYTHON:-$(bash bench/python.sh)}"
out="${FEEDER_BENCH_OUT:-bench/results/gpu/$(date +%Y-%m-%d)}"
[ -n "${OUT:-}" ] && [ -z "${FEEDER_BENCH_OUT:-}" ] && out="$OUT"  # the device runner's folder
mkdir -p "$out"
status_file="$out/status.txt"
: > "$status_file"
scale="${STEP_BUDGET_S:-1}"
worst=0

# step NAME BUDGET_S COMMAND...: run COMMAND with its output in $out/NAME.txt,
# stopped after BUDGET_S x STEP_BUDGET_S seconds; record its status.
step() {
  local name="$1" budget="$2"; shift 2
  local log="$out/$name.txt" t0 rc status
  t0=$(date +%s)
  echo "== $name (budget ${budget} s x $scale)" >&2
  [ "$1" = bench ] && set -- "$PYTHON" -m feeder.bench "${@:2}"
  timeout --kill-after=20 "$(( budget * scale ))" "$@" > "$log" 2>&1
  rc=$?
  case "$rc" in
    0) status=PASS ;;
    124|137) status=FAIL; echo "run_gpu.sh: $name stopped after its budget" >> "$log" ;;
    *) status=FAIL ;;
  esac
  printf '%-14s %-5s %5ss  %s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "$log" | tee -a "$status_file" >&2
  [ "$status" = FAIL ] && worst=1
  return 0
}

skip() {
  printf '%-14s %-5s %5ss  %s\n' "$1" SKIP 0 "$2" | tee -a "$status_file" >&2
}

"$PYTHON" - > "$out/machine.txt" 2>&1 <<'EOF'
import platform, subprocess, torch
print("python", platform.python_version(), "torch", torch.__version__, "CUDA", torch.version.cuda)
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}", torch.cuda.get_device_name(i))
try:
    print(subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
except OSError:
    pass
EOF
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "run_gpu.sh: torch.cuda.is_available() is False for $PYTHON; this script is for a CUDA machine" >&2
  for name in cuda_tests gpu_check; do skip "$name" "no CUDA device"; done
  exit 2
fi
echo "GPU run: results in $out" >&2

want() { case "$part" in default|all|"$1") return 0 ;; *) return 1 ;; esac; }

if want tests; then
  step cuda_tests 180 "$PYTHON" -m pytest tests/cuda -v -p no:cacheprovider -p no:xdist
fi
if want check; then
  # The acceptance table of the CUDA transfer path (the suite ran just above).
  step gpu_check 360 "$PYTHON" scripts/gpu_check.py --skip-suite
fi

data="${FEEDER_BENCH_DATA:-${TMPDIR:-/tmp}/feeder-bench-data}"
need_data() {  # the same dataset as bench/run_all.sh
  if [ ! -d "$data/imagenet-like" ]; then
    step make_data 600 bench make-data "$data/imagenet-like" --n-classes 20 \
      --per-class 100 --seed 0
  fi
}

if [ "$part" = default ]; then
  # The short benchmarks: where the copies run against the model's kernels,
  # and how much each loader slows a launch-bound model step.
  need_data
  if [ ! -d "$data/imagenet-like" ]; then
    skip overlap "no dataset"; skip interference8 "no dataset"
  else
    step overlap 240 bench overlap "$data/imagenet-like" --out "$out/cuda" \
      --loaders feeder,dl-cv2 --workers 8 --batches 30 --warmup 10 --batch-size 64
    step interference8 360 bench interference "$data/imagenet-like" --out "$out/interference" \
      --device cuda --rounds 2 --batch-size 64 --loader-cores 8 --steps model \
      --loaders alone,feeder,feeder-process,dataloader --windows 4
  fi
fi

if [ "$part" = all ] || [ "$part" = cpu ] || [ "$part" = cuda ] || [ "$part" = interference ]; then
  mkdir -p "$out/cpu" "$out/cuda" "$out/interference"
  need_data
  if [ "$part" = all ] || [ "$part" = cpu ]; then
    step ceiling 600 bench ceiling "$data/imagenet-like" --out "$out/cpu" \
      --limit 500 --repeats 3
    step compare_cpu 600 bench compare "$data/imagenet-like" --out "$out/cpu" \
      --epochs 3 --repeats 3 --batch-size 64 --workers-grid 4,8,12,16 --threads-grid 8x0,16x0,24x0,12x4 --targets
  fi
  if [ "$part" = all ] || [ "$part" = cuda ]; then
    step compare_cuda 600 bench compare "$data/imagenet-like" --out "$out/cuda" \
      --device cuda --model --epochs 2 --repeats 3 --batch-size 64 --workers-grid 4,8,16 \
      --threads-grid 8x0,16x0
    step overlap 600 bench overlap "$data/imagenet-like" --out "$out/cuda" \
      --loaders feeder,dl-cv2 --workers 8 --batches 30 --warmup 10 --batch-size 64
  fi
  if [ "$part" = all ] || [ "$part" = interference ]; then
    # The synchronized CUDA step and the launch-bound proxy, alone and fed, the
    # loader on one core; then the model step with the loader on 8 cores.
    step interference 600 bench interference "$data/imagenet-like" --out "$out/interference" \
      --device cuda --rounds 3 --batch-size 64 --loader-cores 1
    step interference8 600 bench interference "$data/imagenet-like" --out "$out/interference/loader8" \
      --device cuda --rounds 3 --batch-size 64 \
      --loader-cores 8 --steps model
  fi
fi
echo "results in $out; status:" >&2
cat "$status_file" >&2
exit "$worst"
