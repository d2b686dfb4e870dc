#!/usr/bin/env bash
# Issue 61 deliverable 6 (and issue 66 item 1's timeline): run-bundle's memory and start-up on one GPU for one
# SD-2.1-size layout before and after the runner refactor (a71cdf1), side by side in one call, through
# benchmarks/runner_before_after.py. Repo root; carried (staged, scripts/gpu/stage.sh: they do not fit beside the
# tracked tree in one call):
#   .whl/      ai-edge-litert 2.3.0 as ai_edge_litert-2.3.0-slim.tar.xz (the wheel's files minus vendors/ and
#              tools/apply_plugin_main) + backports.strenum and flatbuffers wheels: scripts/gpu/env.sh installs them
#   .before/   site_before.tar.xz, site_after.tar.xz: `pip install --no-deps --target site_X .` of `git archive COMMIT`
#              (8042439 before, the commit named in site_X/POCKETDIFF_COMMIT after; pocketdiff/assets left out, linked
#              to the repo's own copy here: run-bundle reads none of it)
#   .devbundle/SET/  one layout, `benchmarks/sd21_bundle.py pack BUNDLE:LAYOUT --dest .devbundle/SET` of a bundle
#              exported by the code after (schema_version 3)
#   .gl/       the Vulkan loader debs (scripts/gpu/vulkan_env.sh)
# Each variant runs with its site first on PYTHONPATH (checked: the report names the pocketdiff it imported).
# ORDER (default before,after,after,before) blocks on the version-2 manifest, then V3 (default 1) blocks of the code
# after on the version-3 one; a block: --pipelined cold, --pipelined warm, plain warm (benchmarks/runner_before_after.py).
# SETUP_ONLY=1 stops once the wheels, both sites and the bundles are in /tmp (kept while the machine stays warm): the
# measurement then has a call of its own (a call's 10 minutes), carrying only .gl.
# Writes $OUT/runner_before_after.json, $OUT/runner_before_after.log.
#   bash scripts/gpu/stage.sh split .whl .before .devbundle/rr --every .gl --part-mb 5 \
#     --then "SETUP_ONLY=1 bash scripts/gpu/runner_before_after.sh"
#   and then, back to back, carry .gl: bash scripts/gpu/runner_before_after.sh
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
RES=$OUT  # written in place: a call cut at its limit still returns what ran (the JSON is rewritten after every launch)
mkdir -p "$OUT"
exec > >(tee -a "$RES/runner_before_after.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
source "$REPO/scripts/gpu/vulkan_env.sh"
source "$REPO/scripts/gpu/env.sh" || exit 3  # cd /tmp/runs: the repo's pocketdiff/ would shadow the installed ones
PY=python3
SITES=/tmp/rba_sites
mkdir -p "$SITES"
for n in before after; do
  if [ ! -d "$SITES/site_$n" ]; then
    $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$REPO/.before/site_$n.tar.xz" "$SITES" || exit 4
  fi
  [ -e "$SITES/site_$n/pocketdiff/assets" ] || ln -s /tmp/site/pocketdiff/assets "$SITES/site_$n/pocketdiff/assets"
done
BUNDLES=/tmp/sd21_bundles
for d in "$REPO"/.devbundle/*/; do
  [ -f "$d/index.json" ] || continue
  for L in $($PY -c "import json,sys; print(' '.join(json.load(open(sys.argv[1]))['layouts']))" "$d/index.json"); do
    [ -d "$BUNDLES/$L" ] && continue
    say "unpack $L"
    $PY "$REPO"/benchmarks/sd21_bundle.py unpack "$d" "$BUNDLES" > /dev/null || exit 5
  done
done
LAYOUT=${LAYOUT:-$(ls "$BUNDLES" | grep -v '_v2$' | head -1)}
$PY "$REPO"/benchmarks/runner_before_after.py v2 "$BUNDLES/$LAYOUT" "$BUNDLES/${LAYOUT}_v2" || exit 6
if [ -n "${SETUP_ONLY:-}" ]; then say "set up: $(ls "$SITES") $(ls "$BUNDLES")"; exit 0; fi  # the next call of this warm machine measures
say "layout $LAYOUT; $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$RES/device.txt"
$PY "$REPO"/benchmarks/runner_before_after.py run --v2-bundle "$BUNDLES/${LAYOUT}_v2" --v3-bundle "$BUNDLES/$LAYOUT" \
  --site before="$SITES/site_before" --site after="$SITES/site_after" --order "${ORDER:-before,after,after,before}" \
  --v3 "${V3:-1}" --timeout "${LAUNCH_TIMEOUT:-150}" --out "$RES/runner_before_after.json"
say "done"
