#!/usr/bin/env bash
# The main job: sets up .venv when missing (idempotent), then runs the demo.
# Extra arguments go to `pocketdiff demo` (e.g. --smoke, --output DIR, --overwrite).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec .venv/bin/pocketdiff demo "$@"
