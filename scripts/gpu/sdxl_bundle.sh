#!/usr/bin/env bash
# Issue 63 item 3 (the phone path at SDXL size) on one GPU's LiteRT GPU delegate (NVIDIA Vulkan): the ~0.7 B block-removal
# preset's bundle (configs/sdxl/export_koala700m_phone.yaml: koala_700m UNet 0.783 B int8 in 5 layer-cut chunks, both
# text encoders int8, the tiled decoder, tiled synthetic weights, 4 steps) kept resident through the product's own
# runner: `pocketdiff run-bundle --pipelined` and `--pipelined --overlap-loads`, each cold (empty program cache, driver
# shader cache) then warm, one process a launch (benchmarks/startup_levers.py run: per-phase seconds from run-bundle's
# phase marks, host / GPU / at-once peaks measured: RSS, NVML and a poller; where each model ran).
# Here first, on the 2-core / 24 GB box (~12 min at 768 px, 17.6 GB peak):
#   .venv/bin/python -m pocketdiff export --config configs/sdxl/export_koala700m_phone.yaml --output runs/koala768
#   .venv/bin/python benchmarks/sd21_bundle.py pack runs/koala768:koala700m_768 --dest .devbundle/sdxl --max-golden-mb 0.5
# then staged (scripts/gpu/stage.sh split .devbundle/sdxl ...; the calls it prints, back to back, each `stage.sh receive`),
# and in the measuring call (carry .gl): bash scripts/gpu/sdxl_bundle.sh
# Writes $OUT/sdxl_bundle_runs.json (startup_levers rows; rewritten after every launch) and $OUT/sdxl_bundle.log; here
#   python benchmarks/sdxl_bundle_rows.py RUNS.json --preset koala_700m --resolution 768 --out benchmarks/results/sdxl_bundle_koala700m_768_<gpu>.json
# PLAN (default pipelined,overlap), BUDGET_S (default 480), LAUNCH_TIMEOUT (default 200 s a launch) override the defaults.
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/sdxl_bundle.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
source "$REPO/scripts/gpu/vulkan_env.sh"
source "$REPO/scripts/gpu/env.sh" || exit 3  # cd /tmp/runs: the repo's pocketdiff/ would shadow the installed one
PY=python3
BUNDLES=/tmp/sdxl_bundles
SRC=${SDXL_PACK:-/tmp/stage/tree/.devbundle/sdxl}  # staged by stage.sh receive; a carried .devbundle/sdxl also works
[ -d "$SRC" ] || SRC=$REPO/.devbundle/sdxl
if [ ! -d "$BUNDLES" ]; then
  say "unpack $SRC"
  $PY "$REPO"/benchmarks/sd21_bundle.py unpack "$SRC" "$BUNDLES" || exit 5
fi
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader); $(nproc) cores; set up in $SECONDS s"
for B in "$BUNDLES"/*/; do
  B=${B%/}
  say "== $(basename "$B"): $(du -sh "$B" | cut -f1)"
  $PY "$REPO"/benchmarks/startup_levers.py run "$B" --cache-root /tmp/sdxl_levers --out "$OUT/sdxl_bundle_runs.json" \
    --plan "${PLAN:-pipelined,overlap}" --budget-s "$(( ${BUDGET_S:-480} - SECONDS ))" \
    --timeout "${LAUNCH_TIMEOUT:-200}" 2>&1 | grep -v '^INFO: \|^WARNING: All log messages'
done
say "done"
