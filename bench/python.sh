#!/usr/bin/env bash
# Print the interpreter the bench scripts run: $PYTHON when set, else .venv's
# python when it already has feeder's bench extra, else the one scripts/env.sh
# sets up with the test and bench extras.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then
  echo "$PYTHON"
elif [ -x "$root/.venv/bin/python" ] && "$root/.venv/bin/python" -c "import feeder.bench, PIL, matplotlib" >/dev/null 2>&1; then
  echo "$root/.venv/bin/python"
else
  FEEDER_EXTRAS="test,bench" bash "$root/scripts/env.sh"
fi
