#!/usr/bin/env bash
# Run the example training loop (sets up .venv first). Extra arguments go to
# examples/train_loop.py (see --help); without a data folder it generates one.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$(bash "$root/scripts/env.sh")"
cd "$root"
exec "$vpy" examples/train_loop.py "$@"
