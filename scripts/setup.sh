#!/usr/bin/env bash
# Create .venv at the repo root (idempotent): torch==2.13.0 first, pinned through a
# constraints file so nothing pulls a CUDA build, then pocketdiff with its extras, then the
# Mesa lavapipe Vulkan driver (CPU machines) unpacked into .vulkan/ for the LiteRT GPU delegate.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
STAMP=".venv/.pocketdiff-installed"
HASH="$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -c scripts/constraints.txt -e ".[all]"
bash scripts/setup_vulkan.sh
echo "$HASH" > "$STAMP"
