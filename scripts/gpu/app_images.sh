#!/usr/bin/env bash
# An app keeps its models (issue 66 item 4), on the GPU machine: the tiny phone bundle (.devbundle/rr, packed by
# benchmarks/sd21_bundle.py) drawn N images in one process per mode (benchmarks/app_images.py), every mode on the same
# program cache: one cold launch first (empty caches, keep_unet, 2 images), then each mode warm, one process each.
# Staged as scripts/gpu/runner_before_after.sh was (the tree leaves ~5 MB per call for carried files):
#   bash scripts/gpu/stage.sh split .whl .devbundle/rr --every .gl --part-mb 4.7 --then "bash scripts/gpu/app_images.sh"
#   then the calls it prints, back to back (each carries .gl and one part; the last one measures).
# MODES (default plain pipelined keep_unet keep_unet_text), IMAGES (default 10).
# Writes $OUT/app_images.json (rows appended after every process: a call cut short returns what ran), $OUT/app_images.log.
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/app_images.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
source "$REPO/scripts/gpu/vulkan_env.sh"
source "$REPO/scripts/gpu/env.sh" || exit 3  # cd /tmp/runs: the repo's pocketdiff/ would shadow the installed one
PY=python3
BUNDLES=/tmp/sd21_bundles
[ -d "$BUNDLES/tiny" ] || { say "unpack"; $PY "$REPO"/benchmarks/sd21_bundle.py unpack "$REPO/.devbundle/rr" "$BUNDLES" || exit 5; }
CACHE=/tmp/app_cache
RES=$OUT/app_images.json
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt"
app() { say "$*"; $PY "$REPO"/benchmarks/app_images.py "$BUNDLES/tiny" --gpu-cache "$CACHE" --out "$RES" "$@" 2>&1 | grep -v '^INFO: \|^WARNING: All log messages'; }
[ -d "$CACHE" ] || app --mode keep_unet --images 2 --launch cold
for m in ${MODES:-plain pipelined keep_unet keep_unet_text}; do
  app --mode "$m" --images "${IMAGES:-10}" --launch warm
done
say "done"
