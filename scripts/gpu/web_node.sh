#!/usr/bin/env bash
# Issue 50 on a GPU machine: the page's pipeline in Node.js (web/node_runner.mjs, LiteRT.js on Dawn on the real
# Vulkan driver) on an SD-2.1-size bundle, beside run-bundle --pipelined in the same call: rows with gpu_peak_mb
# (NVML), host_peak_mb, unet, gpu_device, gpu, ok, total_s, run_bundle_gpu_peak_mb (benchmarks/web_node.py).
# Issue 66 item 5, the page at phone size: LAYOUT=tiny, the `tiny` phone bundle (configs/sd21/export_student_int8gpu.yaml
# model.unet_blocks=tiny unet_chunks=4: int8 filters read directly, 3x3 convs as shifted 1x1 taps, 4 UNet chunks, 3
# text-encoder chunks, the decoder in 3 graphs) at /tmp/sd21_bundles/tiny, left there by scripts/gpu/startup_levers.sh on
# the same warm machine: then only .webnode/ (~30 MiB) and .gl/ travel, in one call while tests/, docs/ and
# benchmarks/results/ are out of the tree (~13 MiB left of ~58), else staged (scripts/gpu/stage.sh split .webnode --every .gl):
#   carry [".webnode", ".gl"]:  LAYOUT=tiny UNET=resident,streamed bash scripts/gpu/web_node.sh
# VARIANTS=fp16 (--precision fp16: LiteRT.js at half precision for the text encoder and UNet) measures the other way the
# page holds int8-direct filters: lavapipe, a 32 px export of the phone preset against its DEQUANTIZE twin, LiteRT.js 2.5.3
# adds ~3.9 B per int8 weight in storage buffers and drops ~4 B of rgba32float texture at fp32 (no saving), ~1.4 B and
# 2 B of rgba16float at fp16.
# Its rows are web_tiny_node_<unet>_<devices>_<gpu>.json (every other layout's web_sd21_node_...), <gpu> from nvidia-smi
# (h100, h200; `gpu` where it does not answer).
# Repo root, carried: .whl/ (ai-edge-litert ...), .gl/ (Vulkan loader debs), .webnode/ and .devbundle-web/
# (`LAYOUT=base bash scripts/gpu/pack_web_node.sh` here: node + web/node_modules, and that one layout of .devbundle/,
# about 63 MiB with the two others; without .devbundle-web/ the layout is taken from a carried .devbundle/), and optionally
# .webref/ (a `pocketdiff web` page's web/reference/ made here; without it the reference is run-bundle's on the GPU,
# made in the call).
#   LAYOUT=base UNET=resident,streamed DEVICES=per-model bash scripts/gpu/web_node.sh
# All of that is ~66 MB beside a ~50.5 MB tracked tree: over one call's 64 MiB, so it goes staged (scripts/gpu/stage.sh),
# in back-to-back calls of one warm machine (/tmp outlives a call, a machine goes back 30 s after one). Here:
#   bash scripts/gpu/stage.sh split .webnode .devbundle-web --every .gl --first .whl \
#     --then "LAYOUT=base UNET=resident,streamed DEVICES=per-model bash scripts/gpu/web_node.sh"
# prints the calls with each one's measured bytes (at 50.49 MB tracked: 4 parts of 13.35 MB, every call <= 64.21 MB):
#   call 1    carry .whl .gl          source scripts/gpu/env.sh   (the wheels into /tmp/site, kept for later calls)
#   call 2-4  carry .stage/pNN .gl    bash scripts/gpu/stage.sh receive
#   call 5    carry .stage/p03 .gl    bash scripts/gpu/stage.sh receive && bash scripts/gpu/stage.sh restore &&
#                                     LAYOUT=base UNET=resident,streamed DEVICES=per-model bash scripts/gpu/web_node.sh
# One call measures both UNet modes (a row each) beside one run-bundle --pipelined (run_bundle_gpu_peak_mb): at the
# SD-2.1 layer-cut student ~1 min resident, ~3.2 min streamed, ~0.6 min run-bundle, ~1 min the GPU reference. Only
# LAYOUT is unpacked. BUDGET (default 560 s from the start) stops benchmarks/web_node.py before the call's 10-minute
# limit; the rows already run are in web_node.log (one JSON line each) and their folders are tarred either way.
# Writes $OUT/web_<sd21|tiny>_node_<unet>_<devices>_<gpu>.json (a comma list joined by "-"; rewritten after every row, so
# a call stopped at BUDGET returns the rows that ran) (+ its folder, tarred) and $OUT/web_node.log. Each row also says
# where the GPU's memory went: gpu_peak_phase (the span between two of the runner's events, a model's open, compiled or
# close, that holds the NVML peak), gpu_at_close_max_mb, gpu_at_end_mb; every event's gpu_mb is in the JSON's
# runs.*.report.memory_events, and the 0.1 s series in the tarred folder's <unet>_<device>/gpu_series.json.
set -u
START=$SECONDS
REPO=$PWD
export OUT=${OUT:-/tmp/out}  # benchmarks/web_node.py writes its result there too, after every row
mkdir -p "$OUT"
exec > >(tee -a "$OUT/web_node.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
UNET=${UNET:-resident}
DEVICES=${DEVICES:-per-model}
VARIANTS=${VARIANTS:-plain}  # benchmarks/web_node.py --variant: plain, nosettle, nosuballoc, fp16, fp16all
TIMEOUT=${TIMEOUT:-420}
source "$REPO/scripts/gpu/vulkan_env.sh"
# node and the npm packages, before env.sh leaves the repo root
if [ ! -x /tmp/webnode/bin/node ]; then
  [ -f "$REPO/.webnode/node.xz" ] || { say "no .webnode/ carried (bash scripts/gpu/pack_web_node.sh here)"; exit 4; }
  mkdir -p /tmp/webnode/bin && xz -dc "$REPO/.webnode/node.xz" > /tmp/webnode/bin/node && chmod +x /tmp/webnode/bin/node
fi
[ -f "$REPO/web/node_modules/webgpu/package.json" ] || tar -C "$REPO/web" -xJf "$REPO/.webnode/node_modules.tar.xz" || exit 4
export PATH=/tmp/webnode/bin:$PATH
say "node $(node --version)"
source "$REPO/scripts/gpu/env.sh" || exit 3
# the installed package looks for LiteRT.js beside itself (pocketdiff/web/node_modules)
ln -sfn "$REPO/web/node_modules" /tmp/site/pocketdiff/web/node_modules  # this call's repo copy (an earlier call's may be gone)
BUNDLES=/tmp/sd21_bundles
LAYOUT=${LAYOUT:-base}
PACKED="$REPO/.devbundle-web"; [ -f "$PACKED/index.json" ] || PACKED="$REPO/.devbundle"
if [ ! -d "$BUNDLES/$LAYOUT" ]; then
  [ -f "$PACKED/index.json" ] || { say "no $BUNDLES/$LAYOUT on this machine and no .devbundle-web/ or .devbundle/ carried to unpack it from"; exit 5; }
  # that layout alone (sd21_bundle.py unpack takes every layout of an index): an index of it, beside the stored files
  ONE=/tmp/webbundle_one && rm -rf "$ONE" && mkdir -p "$ONE"
  python3 - "$PACKED" "$LAYOUT" "$ONE" <<'PY' || exit 5
import json, os, sys
src, layout, one = sys.argv[1:4]
index = json.load(open(os.path.join(src, "index.json")))
if layout not in index["layouts"]:
    sys.exit(f"web_node: layout {layout} is not in {src}/index.json ({', '.join(index['layouts'])})")
json.dump({**index, "layouts": {layout: index["layouts"][layout]}}, open(os.path.join(one, "index.json"), "w"))
for name in os.listdir(src):
    if name != "index.json":
        os.symlink(os.path.join(src, name), os.path.join(one, name))
PY
  python3 "$REPO/benchmarks/sd21_bundle.py" unpack "$ONE" "$BUNDLES" || exit 5
fi
say "layout $LAYOUT from $PACKED ($(( SECONDS - START )) s)"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>/dev/null | head -3
REF=(); [ -f "$REPO/.webref/reference.json" ] && REF=(--reference "$REPO/.webref")
tag="${UNET//,/-}_${DEVICES//,/-}"; [ "$VARIANTS" = plain ] || tag="${tag}_${VARIANTS//,/-}"  # names of letters, digits, "." "_" "-" alone: the device tool returns no other file from $OUT
GPU=$(gpu_tag gpu)  # scripts/gpu/gpu_tag.sh, sourced by env.sh
case $LAYOUT in tiny) ROWS=web_tiny ;; *) ROWS=web_sd21 ;; esac  # the phone bundle's rows, beside the SD-2.1 student's
NAME="${ROWS}_node_${tag}_${GPU}"
say "== web_node $LAYOUT unet=$UNET devices=$DEVICES -> $NAME"
LEFT=$(( ${BUDGET:-560} - (SECONDS - START) ))
[ "$LEFT" -gt 60 ] || { say "only ${LEFT} s of BUDGET left before the runs"; exit 6; }
timeout -k 10 "$LEFT" python3 "$REPO/benchmarks/web_node.py" --bundle "$BUNDLES/$LAYOUT" --unet "$UNET" --gpu-device "$DEVICES" --variant "$VARIANTS" \
  "${REF[@]}" --timeout "$(( TIMEOUT < LEFT ? TIMEOUT : LEFT ))" --out "/tmp/runs/$NAME.json"
rc=$?
[ $rc -ne 124 ] || say "stopped at BUDGET after $(( SECONDS - START )) s: the rows that ran are in $NAME.json and the JSON lines above"
tar czf "$OUT/$NAME.tgz" --exclude='*.tflite' -C /tmp/runs "$NAME"
say "done (exit $rc, $(( SECONDS - START )) s)"
exit $rc
