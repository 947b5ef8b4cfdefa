#!/usr/bin/env bash
# feeder-doctor on the ImageNet-like set, one report of each kind, into bench/results/
# (its report.txt only: doctor.json and doctor.png stay in a scratch folder, deleted at the end):
#   doctor_loader_bound/   no model step: the loader's own limit
#   doctor_model_bound/    a simulated step 10x the loader's time per batch (from the first report)
#   doctor_storage_bound/  the set packed into shards behind a bandwidth-limited HTTP server on loopback
# Usage: bash bench/doctor_reports.sh [DATA] [SECONDS]   (DATA: an image folder; default
# $FEEDER_BENCH_DATA/imagenet-like, made with feeder-bench make-data when missing)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DATA=${1:-${FEEDER_BENCH_DATA:-/tmp/feeder-bench-data}/imagenet-like}
SECONDS_EACH=${2:-60}
OUT=bench/results
BATCH=32
BANDWIDTH=4000000   # bytes/s over every connection: about 4 MB/s, a busy shared link
[ -d "$DATA" ] || $PY -m feeder.bench make-data "$DATA" --n-classes 10 --per-class 100
WORK=$(mktemp -d)
SERVER=
trap '[ -z "$SERVER" ] || kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT
run() {  # name, args...
  local name=$1; shift
  local t0=$(date +%s)
  $PY -m feeder.doctor "$@" --batch-size $BATCH --seconds "$SECONDS_EACH" --out "$WORK/$name" -q
  echo "($name: $(( $(date +%s) - t0 )) s)" | tee -a "$WORK/$name/report.txt"
  mkdir -p "$OUT/$name"
  cp "$WORK/$name/report.txt" "$OUT/$name/report.txt"
}
run doctor_loader_bound "$DATA"
STEP_MS=$($PY -c "import json; m = json.load(open('$WORK/doctor_loader_bound/doctor.json'))['measurements']; print(round(10 * 1e3 * m['batch_size'] / m['loader_rate'], 1))")
run doctor_model_bound "$DATA" --step-ms "$STEP_MS"
$PY -m feeder.pack "$DATA" "$WORK/shards" -q
$PY -m feeder.bench.httpserver "$WORK/shards" 0 $BANDWIDTH > "$WORK/url" &
SERVER=$!
for _ in $(seq 100); do [ -s "$WORK/url" ] && break; sleep 0.1; done
run doctor_storage_bound "$(head -1 "$WORK/url")/train.json"
