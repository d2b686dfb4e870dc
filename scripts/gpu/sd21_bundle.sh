#!/usr/bin/env bash
# SD-2.1-size bundles at 512 px on a GPU machine's LiteRT GPU delegate (Vulkan, the real driver),
# run from the repo root with three carried folders:
#   .whl/        the wheels of scripts/gpu/env.sh (ai-edge-litert among them)
#   .gl/         Vulkan loader + libglvnd debs (the NVIDIA Vulkan ICD needs them)
#   .devbundle/  made here: `python benchmarks/sd21_bundle.py pack BUNDLE:cfg [BUNDLE:student] --dest .devbundle`
#                from `pocketdiff export --config configs/sd21/export.yaml` (CFG, 20 steps) and
#                configs/sd21/export_student.yaml (w-embedded, 4 steps); tiled synthetic weights,
#                every .tflite xz-compressed (a few MB in all)
# Per layout: `pocketdiff verify-bundle` on the GPU delegate (every component fully accelerated,
# finite and within the manifest's tolerances at fp16 and fp32; compile time, latency), then
# `pocketdiff run-bundle` end to end (tokenize + text encoder + all UNet steps + decode) plain and
# --pipelined (peak RSS of each), and XNNPACK beside it (verify-bundle --accelerator cpu: the text
# encoder and decoder; the int8 UNet on the CPU as its fp16-storage variant and as it is, under a time limit).
# Writes $OUT/verify_*.json, $OUT/run_*/report.json, $OUT/sd21_bundle.json (summary), $OUT/sd21_bundle.log.
#   bash scripts/gpu/sd21_bundle.sh            # ~6-8 min on one H100 (nvidia-h100-x1)
# CPU_FIRST=1 runs step 5 (XNNPACK) before step 4 (the GPU delegate).
# Local dry run (lavapipe; tiny bundles): SKIP_GL=1 OUT=/tmp/o CPU_UNET_S=60 bash scripts/gpu/sd21_bundle.sh
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/sd21_bundle.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
T0=$SECONDS
BUDGET=${BUDGET:-520}
CPU_UNET_S=${CPU_UNET_S:-90}
[ -f "$REPO/.devbundle/index.json" ] || { say "no .devbundle/index.json: carry .devbundle (benchmarks/sd21_bundle.py pack)"; exit 2; }

# 1. Vulkan loader + glvnd from the carried debs; the NVIDIA ICD json where the driver put it
source "$REPO/scripts/gpu/vulkan_env.sh"

# 2. wheels + pocketdiff into /tmp/site (env.sh), then work from /tmp/runs
if [ -z "${SKIP_PIP:-}" ]; then
  source "$REPO/scripts/gpu/env.sh" || exit 3
else
  cd /tmp || exit 3
fi
PY=${PYTHON:-python3}
[[ $PY == */* && $PY != /* ]] && PY=$REPO/$PY
PD="$PY -m pocketdiff.cli"
$PY -c "import ai_edge_litert, numpy; print('ai_edge_litert ok, numpy', numpy.__version__)" || exit 4

# 3. the bundles (xz, Python's lzma)
BUNDLES=/tmp/sd21_bundles
rm -rf "$BUNDLES"
$PY "$REPO/benchmarks/sd21_bundle.py" unpack "$REPO/.devbundle" "$BUNDLES" || exit 5
LAYOUTS=$(ls "$BUNDLES")
say "layouts: $LAYOUTS (unpacked in $((SECONDS - T0)) s)"
left() { echo $((BUDGET - (SECONDS - T0))); }

# 4. per layout: verify-bundle on the GPU delegate, then run-bundle plain and pipelined
gpu_part() {
for L in $LAYOUTS; do
  B=$BUNDLES/$L
  say "== $L: verify-bundle gpu (fp16, fp32)"
  timeout $(( $(left) - 30 )) $PD verify-bundle "$B" --accelerator gpu --keep-going --json "$OUT/verify_${L}_gpu.json" --timeout 240
  echo "$?" > "$OUT/verify_${L}_gpu.status"
  for mode in plain pipelined; do
    [ "$(left)" -gt 60 ] || { say "time budget spent: run-bundle $L $mode skipped"; echo skipped > "$OUT/run_${L}_${mode}.status"; continue; }
    flag=""; [ $mode = pipelined ] && flag=--pipelined
    say "== $L: run-bundle gpu $mode"
    timeout $(( $(left) - 20 )) $PD run-bundle "$B" --prompt "a photograph of an astronaut riding a horse" --output "$OUT/run_${L}_${mode}" \
      --accelerator gpu $flag --seed 0
    echo "$?" > "$OUT/run_${L}_${mode}.status"
  done
done
}

# 5. XNNPACK beside it: text encoder + decoder of the first layout, then its int8 UNet under a time limit
cpu_part() {
L=$(echo $LAYOUTS | awk '{print $1}')
if [ "$(left)" -gt 60 ]; then
  say "== $L: verify-bundle cpu (XNNPACK, $(nproc) cores): text encoder, decoder"
  DEC=$($PY -c "import json, sys; m = json.load(open(sys.argv[1])); print(','.join((m.get('vae_tiling') or {}).get('components', ['vae_decoder'])))" "$BUNDLES/$L/manifest.json")
  timeout $(( $(left) - 20 )) $PD verify-bundle "$BUNDLES/$L" --accelerator cpu --components "text_encoder,$DEC" --keep-going \
    --json "$OUT/verify_${L}_cpu.json" --timeout 200
  echo "$?" > "$OUT/verify_${L}_cpu.status"
fi
for variant in fp16 int8; do  # the int8 UNet on XNNPACK: its fp16-storage variant (default), then as it is
  [ "$(left)" -gt 40 ] || { echo skipped > "$OUT/verify_${L}_cpu_unet_${variant}.status"; continue; }
  lim=$(( $(left) - 20 )); [ $lim -gt $CPU_UNET_S ] && lim=$CPU_UNET_S
  flag=""; [ $variant = int8 ] && flag=--cpu-int8-as-is
  say "== $L: verify-bundle cpu unet ($variant, limit ${lim} s)"
  $PD verify-bundle "$BUNDLES/$L" --accelerator cpu --components unet --keep-going $flag --json "$OUT/verify_${L}_cpu_unet_${variant}.json" --timeout "$lim"
  echo "$?" > "$OUT/verify_${L}_cpu_unet_${variant}.status"
done
}

# CPU_FIRST=1: XNNPACK before the GPU delegate (when the budget may not reach both)
if [ -n "${CPU_FIRST:-}" ]; then cpu_part; gpu_part; else gpu_part; cpu_part; fi

# 6. summary; disk cleaned
$PY "$REPO/benchmarks/sd21_bundle.py" collect "$OUT" --out "$OUT/sd21_bundle.json"
rm -rf "$BUNDLES"
say "done in $((SECONDS - T0)) s; $OUT/sd21_bundle.json"
