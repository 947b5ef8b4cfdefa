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
# feeder's optional JPEG region decoder (feeder/decode/_jpeg.c) builds against the
# system's libjpeg-turbo headers: install them where we can (root with apt-get),
# else say so once and go on (feeder then decodes JPEGs with simplejpeg).
# A here-string, not a pipe: with pipefail, a compiler that exits before reading
# all of a pipe would fail the check through printf's broken pipe.
has_jpeg_headers() { "${CC:-cc}" -E - >/dev/null 2>&1 <<<$'#include <stdio.h>\n#include <jpeglib.h>'; }
if ! has_jpeg_headers; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "feeder: installing gcc and libjpeg-dev (libjpeg-turbo headers) for the JPEG region decoder" >&2
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q gcc libjpeg-dev >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q gcc libjpeg-dev >/dev/null 2>&1; }; } \
      || echo "feeder: apt-get could not install gcc libjpeg-dev; JPEGs will decode with simplejpeg" >&2
  else
    echo "feeder: no C compiler with libjpeg headers (apt-get install gcc libjpeg-dev, or dnf install" \
         "gcc libjpeg-turbo-devel, as root); JPEGs will decode with simplejpeg" >&2
  fi
fi
# Is torch there? Found, not imported: importing it takes seconds, on every run of
# every script (a broken install still fails at its first use).
if ! "$vpy" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
    >/dev/null 2>&1; then
  echo "feeder: installing ${FEEDER_TORCH:-torch==2.13.0}" >&2
  "$vpy" -m pip install -q "${FEEDER_TORCH:-torch==2.13.0}" >&2
fi
# Reinstall only when the package metadata changed or an extra is missing. The
# stamp records the extras installed; a script wanting others installs the union,
# so that scripts wanting different extras (docs.sh: test,docs; example.sh: test)
# share one installation instead of reinstalling whenever one follows the other.
stamp="$venv/.feeder-install"
# The extension's sources and whether its headers are there count too, so that
# installing the headers later rebuilds it.
want="$(cat "$root/setup.cfg" "$root/pyproject.toml" "$root/setup.py" "$root"/feeder/decode/*.c "$root"/feeder/decode/*.h | cksum)"
want="$want jpeg=$(has_jpeg_headers && echo yes || echo no)"
have="" have_extras=""
if [ -f "$stamp" ]; then
  have="$(sed -n 1p "$stamp")"
  have_extras="$(sed -n 2p "$stamp")"
fi
union="$(printf '%s,%s' "$have_extras" "$extras" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)"
if [ "$have" != "$want" ] || [ "$union" != "$have_extras" ]; then
  echo "feeder: installing feeder[$union] (editable)" >&2
  "$vpy" -m pip install -q -e "$root[$union]" >&2
  printf '%s\n%s\n' "$want" "$union" >"$stamp"
fi
echo "$vpy"
