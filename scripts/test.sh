#!/usr/bin/env bash
# Run the test suite (sets up .venv first). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$(bash "$root/scripts/env.sh")"
cd "$root"
exec "$vpy" -m pytest "$@"
