#!/usr/bin/env bash
# Create .venv at the repo root (idempotent): torch==2.13.0 first, pinned through a
# constraints file so nothing pulls a CUDA build, then pocketdiff with its extras ([all]: export, dev and gpu-cache,
# litert-lm-api's one-build LiteRT library for run-bundle --weight-cache), then the
# Mesa lavapipe Vulkan driver (CPU machines) unpacked into .vulkan/ for the LiteRT GPU delegate.
# pip's output goes to .venv/setup.log (printed when a step fails).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
bash scripts/setup_web.sh  # LiteRT.js (npm, pinned) + chromium for the web page; quick when present
STAMP=".venv/.pocketdiff-installed"
HASH="$(cat pyproject.toml scripts/setup.sh scripts/setup_vulkan.sh scripts/constraints.txt | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
  exit 0
fi
echo "setup: creating/updating .venv (torch 2.13.0 CPU, pocketdiff[all], lavapipe) ..." >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
LOG=.venv/setup.log
: > "$LOG"
step() {
  if ! "$@" >>"$LOG" 2>&1; then
    echo "setup: failed: $*" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}
step .venv/bin/python -m pip install --upgrade pip
step .venv/bin/python -m pip install torch==2.13.0
step .venv/bin/python -m pip install -c scripts/constraints.txt -e ".[all]"
bash scripts/setup_vulkan.sh
echo "$HASH" > "$STAMP"
echo "setup: done" >&2
