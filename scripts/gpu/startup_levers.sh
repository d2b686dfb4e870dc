#!/usr/bin/env bash
# Issue 66 items 3 and 4 on the GPU machine: run-bundle's start-up levers side by side on the `tiny` phone bundle
# (.devbundle/rr, packed by benchmarks/sd21_bundle.py), one warm machine, one call (benchmarks/startup_levers.py, whose
# docstring has the steps): cold (empty program cache, CPU variants, driver shader cache) and warm launches of
# `run-bundle --pipelined` (the baseline), --on-cpu text_encoder [--compile-ahead], --overlap-loads [--overlap-ahead 3
# or 2] with it, --one-environment, --overlap-loads alone, --compile-ahead alone; an app's later images (app_images.py
# modes keep_unet_decoder_te_cpu, keep_unet_te_cpu, plain_te_cpu: IMAGES each, warm on te_cpu's folders); the
# environment probe; a last warm baseline.
# No step starts past BUDGET_S (default 380) seconds after this script started: with the last launch (<= ~40 s) the
# call stays under 8 min. Staged as scripts/gpu/app_images.sh was (the tree leaves ~5 MB per call for carried files):
#   bash scripts/gpu/stage.sh split .whl .devbundle/rr --every .gl --part-mb 4.7 --then "SETUP_ONLY=1 bash scripts/gpu/startup_levers.sh"
#   then the calls it prints, back to back (each carries .gl and one part; the last one installs the wheels and this
#   repo and unpacks the bundle into /tmp), then, on the same warm machine, the measuring call carrying [".gl"]:
#   bash scripts/gpu/startup_levers.sh
#   (a machine that already holds /tmp/sd21_bundles/tiny and /tmp/site, from an earlier script, needs only that call.)
# PLAN (startup_levers.py --plan), IMAGES (default 6), BUDGET_S, LAUNCH_TIMEOUT (default 80 s, each process) override the defaults.
# SMOKE=1: the smoke bundle on this machine's Vulkan (lavapipe on the 2-core box), nothing staged, a short plan.
# LAYOUT (default tiny) and PACK (default .devbundle/rr): which packed layout to unpack and measure.
# Writes $OUT/startup_sd21_<layout>.json (rewritten after every process: a cut call returns what ran), $OUT/startup_levers.log.
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/startup_levers.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
if [ -n "${SMOKE:-}" ]; then
  export PYTHONUNBUFFERED=1  # the venv's editable install maps pocketdiff.runtime to runtime/
  PY=${PY:-$REPO/.venv/bin/python}
  cd /tmp || exit 1
  $PY "$REPO"/benchmarks/startup_levers.py run --smoke --cache-root /tmp/startup_levers_smoke --out "$OUT/startup_sd21.json" \
    --plan "${PLAN:-pipelined,te_cpu,overlap_ahead3_te_cpu,app:keep_unet_decoder_te_cpu,probe}" --images "${IMAGES:-2}" \
    --probe-models text_encoder,vae_decoder --budget-s "$(( ${BUDGET_S:-900} - SECONDS ))" --timeout "${LAUNCH_TIMEOUT:-300}"
  exit $?
fi
source "$REPO/scripts/gpu/vulkan_env.sh"
source "$REPO/scripts/gpu/env.sh" || exit 3  # cd /tmp/runs: the repo's pocketdiff/ would shadow the installed one
PY=python3
BUNDLES=/tmp/sd21_bundles
LAYOUT=${LAYOUT:-tiny}  # another packed layout: LAYOUT=full PACK=.devbundle/full (the 866 M phone bundle)
[ -d "$BUNDLES/$LAYOUT" ] || { say "unpack"; $PY "$REPO"/benchmarks/sd21_bundle.py unpack "$REPO/${PACK:-.devbundle/rr}" "$BUNDLES" || exit 5; }
if [ -n "${SETUP_ONLY:-}" ]; then say "set up: $(ls "$BUNDLES"), $(ls /tmp/site | wc -l) packages in /tmp/site"; exit 0; fi
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader); $(nproc) cores; set up in $SECONDS s"
$PY "$REPO"/benchmarks/startup_levers.py run "$BUNDLES/$LAYOUT" --cache-root /tmp/startup_levers_$LAYOUT --out "$OUT/startup_sd21_$LAYOUT.json" \
  ${PLAN:+--plan "$PLAN"} --images "${IMAGES:-6}" --budget-s "$(( ${BUDGET_S:-380} - SECONDS ))" \
  --timeout "${LAUNCH_TIMEOUT:-80}" 2>&1 | grep -v '^INFO: \|^WARNING: All log messages'
say "done"
