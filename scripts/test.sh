#!/usr/bin/env bash
# Run the test suite (sets up .venv first, with the test and docs extras: the docs
# tests build the site). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$(FEEDER_EXTRAS="${FEEDER_EXTRAS:-test,docs}" bash "$root/scripts/env.sh")"
cd "$root"
exec "$vpy" -m pytest "$@"
