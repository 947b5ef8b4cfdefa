#!/usr/bin/env bash
# A bounded fuzz of feeder's JPEG decoder (feeder/decode/_jpeg.c, _huffman.c)
# built with AddressSanitizer and UndefinedBehaviorSanitizer.
#
#   bench/experiments/fuzz_jpeg_sanitized.sh [SECONDS] [OUT]
#
# Builds the extension with -fsanitize=address,undefined into a temporary copy
# of the package (the in-place build is left alone), writes the seed JPEGs
# without the sanitizer (OpenCV aborts under a preloaded libasan), runs
# bench/experiments/fuzz_jpeg.py for SECONDS (default 300) with libasan
# preloaded, any sanitizer report aborting the run, and writes the command,
# date, libjpeg-turbo version and the run's last lines to OUT (default
# bench/results/fuzz_sanitized.txt). Exit status: the fuzz's.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_BOUND=${1:-300}
OUT=${2:-bench/results/fuzz_sanitized.txt}
PY=${PYTHON:-python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cp -r feeder "$TMP/feeder"
rm -f "$TMP"/feeder/decode/_jpeg*.so
INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
SUFFIX=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc -shared -fPIC -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined \
    -fno-omit-frame-pointer -I"$INC" feeder/decode/_jpeg.c feeder/decode/_huffman.c feeder/decode/_resize.c \
    -ljpeg -ldl -lm \
    -o "$TMP/feeder/decode/_jpeg$SUFFIX"
PYTHONPATH=. "$PY" bench/experiments/fuzz_jpeg.py --write-seeds "$TMP/seeds"
LIBS="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
CMD="fuzz_jpeg.py --seeds SEEDS --count 100000000 --seconds $SECONDS_BOUND --every 5000 --seed ${FUZZ_SEED:-3}"
set +e
LD_PRELOAD="$LIBS" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    PYTHONPATH="$TMP" "$PY" bench/experiments/fuzz_jpeg.py --seeds "$TMP/seeds" --count 100000000 \
    --seconds "$SECONDS_BOUND" --every 5000 --seed "${FUZZ_SEED:-3}" --max-growth-mb 200 > "$TMP/log" 2>&1
STATUS=$?
set -e
{
    echo "AddressSanitizer + UndefinedBehaviorSanitizer fuzz of feeder.decode._jpeg (bench/experiments/fuzz_jpeg_sanitized.sh)"
    echo "command: bench/experiments/fuzz_jpeg_sanitized.sh $SECONDS_BOUND  ($CMD)"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "libjpeg-turbo: $(dpkg-query -W -f='${Version}' libjpeg62-turbo 2>/dev/null || echo unknown) (system), gcc $(gcc -dumpversion)"
    echo "sanitizer reports: $(grep -c 'ERROR: AddressSanitizer\|runtime error:' "$TMP/log" || true); exit status $STATUS"
    echo
    tail -n 5 "$TMP/log"
} > "$OUT"
cat "$OUT"
exit $STATUS
