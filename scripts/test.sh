#!/usr/bin/env bash
# The test command: sets up .venv when missing (idempotent), then runs the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
# two worker processes (pytest-xdist), each test file kept on one worker (its module fixtures built once);
# `bash scripts/test.sh -n 0` runs everything in this one process
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile tests "$@"
