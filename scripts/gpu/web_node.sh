#!/usr/bin/env bash
# Issue 50 on a GPU machine: the page's pipeline in Node.js (web/node_runner.mjs, LiteRT.js on Dawn on the real
# Vulkan driver) on an SD-2.1-size bundle, beside run-bundle --pipelined in the same call: rows with gpu_peak_mb
# (NVML), host_peak_mb, unet, gpu_device, gpu, ok, total_s, run_bundle_gpu_peak_mb (benchmarks/web_node.py).
# Repo root, carried: .whl/ (ai-edge-litert ...), .gl/ (Vulkan loader debs), .devbundle/ (benchmarks/sd21_bundle.py
# pack), .webnode/ (scripts/gpu/pack_web_node.sh: node + web/node_modules), and optionally .webref/ (a `pocketdiff web`
# page's web/reference/ made here; without it the reference is run-bundle's on the GPU, made in the call).
#   LAYOUT=layer10te3 UNET=resident,streamed DEVICES=per-model bash scripts/gpu/web_node.sh
# Each call stays under the 10-minute limit with one mode per call at SD size (resident ~1 min, streamed ~3-5 min).
# Writes $OUT/web_sd21_node_<unet>_<devices>_h200.json (+ its folder, tarred) and $OUT/web_node.log.
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/web_node.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
UNET=${UNET:-resident}
DEVICES=${DEVICES:-per-model}
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
[ -e /tmp/site/pocketdiff/web/node_modules ] || ln -s "$REPO/web/node_modules" /tmp/site/pocketdiff/web/node_modules
BUNDLES=/tmp/sd21_bundles
if [ ! -d "$BUNDLES" ]; then
  python3 "$REPO/benchmarks/sd21_bundle.py" unpack "$REPO/.devbundle" "$BUNDLES" || exit 5
fi
LAYOUT=${LAYOUT:-$(ls "$BUNDLES" | head -1)}
say "layout $LAYOUT: $(ls "$BUNDLES")"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>/dev/null | head -3
REF=(); [ -f "$REPO/.webref/reference.json" ] && REF=(--reference "$REPO/.webref")
tag="${UNET//,/+}_${DEVICES//,/+}"
say "== web_node $LAYOUT unet=$UNET devices=$DEVICES"
python3 "$REPO/benchmarks/web_node.py" --bundle "$BUNDLES/$LAYOUT" --unet "$UNET" --gpu-device "$DEVICES" "${REF[@]}" \
  --timeout "$TIMEOUT" --out "/tmp/runs/web_sd21_node_${tag}_h200.json"
cp "/tmp/runs/web_sd21_node_${tag}_h200.json" "$OUT/" 2>/dev/null
tar czf "$OUT/web_sd21_node_${tag}_h200.tgz" --exclude='*.tflite' -C /tmp/runs "web_sd21_node_${tag}_h200"
say "done"
