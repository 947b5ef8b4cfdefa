#!/usr/bin/env bash
# Run the test suite (sets up .venv first, with the test and docs extras: the docs
# tests build the site). Extra arguments go to pytest.
#
# Two test processes by default (pytest-xdist): most of the suite waits on
# threads, child processes and servers, so two processes finish the whole suite
# in about 0.6x the time of one, even on 2 cores. FEEDER_TEST_PROCESSES=1 runs
# everything in this one process; a -n of your own (or -p no:xdist) wins.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$(FEEDER_EXTRAS="${FEEDER_EXTRAS:-test,docs}" bash "$root/scripts/env.sh")"
cd "$root"
processes="${FEEDER_TEST_PROCESSES:-2}"
args=()
if [[ "$processes" =~ ^[0-9]+$ ]] && (( processes > 1 )) \
    && ! printf '%s\n' "$@" | grep -qE '^(-n|--numprocesses|--dist)|no:xdist' \
    && "$vpy" -c "import xdist" 2>/dev/null; then
  args=(-n "$processes")
fi
exec "$vpy" -m pytest "${args[@]}" "$@"
