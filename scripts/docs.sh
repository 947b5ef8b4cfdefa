#!/usr/bin/env bash
# Build the documentation site into site/ (sets up .venv with the docs extra first):
#   bash scripts/docs.sh          mkdocs build --strict (a broken link or reference fails)
#   bash scripts/docs.sh serve    serve it with live reload on http://127.0.0.1:8000
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$(FEEDER_EXTRAS="${FEEDER_EXTRAS:-test,docs}" bash "$root/scripts/env.sh")"
cd "$root"
# (mkdocs-material prints a banner about its successor on every build otherwise.)
export NO_MKDOCS_2_WARNING=1
if [ "${1:-}" = serve ]; then
  shift
  exec "$vpy" -m mkdocs serve "$@"
fi
exec "$vpy" -m mkdocs build --strict "$@"
