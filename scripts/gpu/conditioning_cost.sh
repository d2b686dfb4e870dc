#!/usr/bin/env bash
# Issue 61 item 2 on the GPU machine: the SDXL-style added embedding (prompt-dependent conditioning) as its own graph
# on the LiteRT GPU delegate (Vulkan), against one UNet step of the staged SD-2.1-size `tiny` phone bundle.
# Here first: python benchmarks/conditioning_cost.py export .devcond   (two graphs, ~0.3 MB packed: carry .devcond)
# There (after the staged .whl + .devbundle/rr, scripts/gpu/stage.sh): bash scripts/gpu/conditioning_cost.sh
# Writes $OUT/conditioning_cost_sd21.json.
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
say() { echo "[$(date +%H:%M:%S)] $*"; }
source "$REPO/scripts/gpu/vulkan_env.sh"
source "$REPO/scripts/gpu/env.sh" || exit 3  # cd /tmp/runs: the repo's pocketdiff/ would shadow the installed one
BUNDLES=/tmp/sd21_bundles
[ -d "$BUNDLES/tiny" ] || { say "unpack"; python3 "$REPO"/benchmarks/sd21_bundle.py unpack "$REPO/.devbundle/rr" "$BUNDLES" || exit 5; }
[ -f "$REPO/.devcond/export.json" ] || { say "no .devcond: carry it (benchmarks/conditioning_cost.py export .devcond)"; exit 2; }
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
python3 "$REPO"/benchmarks/conditioning_cost.py measure "$REPO/.devcond" "$BUNDLES/tiny" \
  --out "$OUT/conditioning_cost_sd21.json" --repeats ${REPEATS:-50} 2>&1 | grep -v '^INFO: \|^WARNING: All log messages\|^I0000\|^W0000'
say "done"
