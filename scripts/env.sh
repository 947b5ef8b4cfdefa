#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install feeder into it.
# Sourced by scripts/example.sh and scripts/test.sh; prints the venv's python.
#
# - If the python used here can already import torch, the venv sees that torch
#   (--system-site-packages) and uses it as is.
# - Otherwise torch is pinned (FEEDER_TORCH, default torch==2.13.0): an unpinned
#   "torch" would pull the newest CUDA build, several GB, on a CPU-only machine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
venv="${FEEDER_VENV:-$root/.venv}"
extras="${FEEDER_EXTRAS:-test}"

if [ ! -x "$venv/bin/python" ]; then
  if "$py" -c "import torch" >/dev/null 2>&1; then
    echo "feeder: using the torch already installed for $py" >&2
    "$py" -m venv --system-site-packages "$venv"
  else
    "$py" -m venv "$venv"
  fi
fi
vpy="$venv/bin/python"
if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
  echo "feeder: installing ${FEEDER_TORCH:-torch==2.13.0}" >&2
  "$vpy" -m pip install -q "${FEEDER_TORCH:-torch==2.13.0}" >&2
fi
# Reinstall only when the package metadata or the extras changed.
stamp="$venv/.feeder-install"
want="$(cat "$root/setup.cfg" "$root/pyproject.toml" | cksum) $extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "feeder: installing feeder[$extras] (editable)" >&2
  "$vpy" -m pip install -q -e "$root[$extras]" >&2
  echo "$want" >"$stamp"
fi
echo "$vpy"
