#!/usr/bin/env bash
# Rebuild tests/web/smoke_bundle, the tiny bundle the web page's CI test runs in headless
# Chromium (shipped, so CI does not spend an export's ~5 minutes on it): the shipped shapes
# teacher through the smoke export recipe, 4 DDIM steps, int8 (RTN) UNet, fp16 text encoder
# and decoder, every component checked on the LiteRT GPU delegate by export itself.
# Rerun after a change to the bundle format (tests/web fail on a manifest they cannot read).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
.venv/bin/pocketdiff export --config configs/smoke/export.yaml --output "$TMP/bundle" steps=4 weights=int8 int8.rtn=true
rm -rf "$TMP/bundle/_export" "$TMP/bundle/report.json"
DST=tests/web/smoke_bundle
find "$DST" -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
cp -r "$TMP/bundle/." "$DST/"
echo "rebuilt $DST ($(du -sh "$DST" | cut -f1))"
