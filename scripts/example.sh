#!/usr/bin/env bash
# Run an example training loop (sets up .venv first): examples/train_loop.py
# (classification), or, with "segmentation" or "detection" first, that example.
# Extra arguments go to the script (see --help); without a data folder each
# generates one.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$(bash "$root/scripts/env.sh")"
cd "$root"
script=examples/train_loop.py
case "${1:-}" in
  segmentation|detection) script="examples/train_$1.py"; shift ;;
esac
exec "$vpy" "$script" "$@"
