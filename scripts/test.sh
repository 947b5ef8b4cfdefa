#!/usr/bin/env bash
# Run the test suite (sets up .venv first, with the test and docs extras: the docs
# tests build the site). Extra arguments go to pytest.
#
# Three test processes by default (pytest-xdist): much of the suite waits on
# threads, child processes and servers, so on 2 cores two processes left about
# a fifth of the CPU idle; three keep both cores busy (518 s for the suite, its
# CPU time over 2 cores being about 505 s). FEEDER_TEST_PROCESSES=1 runs
# everything in this one process, as do a -n of your own, -p no:xdist, --pdb
# and --trace (a debugger needs the test in this process). The processes steal
# queued tests from each other (--dist worksteal), so that neither sits idle
# while the other still has a queue of long tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$(FEEDER_EXTRAS="${FEEDER_EXTRAS:-test,docs}" bash "$root/scripts/env.sh")"
cd "$root"
# Bytecode for the package and the tests, written once: the suite starts a few
# hundred Python processes, and where PYTHONDONTWRITEBYTECODE is set (as in many
# containers) each would otherwise compile every module it imports again.
"$vpy" -m compileall -q -j 0 feeder tests >/dev/null
processes="${FEEDER_TEST_PROCESSES:-3}"
[[ "$processes" =~ ^[0-9]+$ ]] || { echo "FEEDER_TEST_PROCESSES must be a number, got '$processes'" >&2; exit 2; }
parallel=$(( 10#$processes > 1 ))
for arg in "$@"; do
  case "$arg" in
    -n|-n*|--numprocesses|--numprocesses=*|--dist|--dist=*|--pdb|--trace|*no:xdist*) parallel=0 ;;
  esac
done
if (( parallel )) && "$vpy" -c "import xdist" 2>/dev/null; then
  exec "$vpy" -m pytest -n "$(( 10#$processes ))" --dist worksteal "$@"
fi
exec "$vpy" -m pytest "$@"
