#!/usr/bin/env bash
# Issue 64 item 5: image-to-image at SD-2.1 size on one GPU, inside the phone path's budget. The tiny phone bundle
# (.devbundle/rr, packed by benchmarks/sd21_bundle.py: SD-2.1-size, int8 chunked UNet, tiled decoder, 512 px, 4 DDIM
# steps) with an SD-2.1-size VAE encoder grafted in (configs/sd21/export_encoder.yaml: random tiled weights, the phone
# profile enforced, so its 512 px level runs in 2 row bands inside the graph, largest tensor 32.3 MB), then
# run-bundle --pipelined --init-image --strength 0.5 (2 of the 4 steps): time and memory per stage, host + GPU at once
# against 4 GB; beside it the same bundle's text-to-image run, verify-bundle on the encoder (fully accelerated, golden
# parity at fp16), and the 768 px banded encoder (3 bands over 2 blocks) compiled and run alone.
# Carried: .devbundle/i2i (`benchmarks/sd21_bundle.py pack` of the two encoder exports, ~3.5 MB: enc512 with its golden,
# enc768 without), .gl; .devbundle/rr staged as scripts/gpu/app_images.sh stages it (or already unpacked in
# /tmp/sd21_bundles/tiny by app_images.sh on this warm machine: then it need not travel again); .whl on a fresh machine.
#   after app_images.sh, same warm machine:  carry .gl .devbundle/i2i: bash scripts/gpu/img2img_bundle.sh
#   alone: bash scripts/gpu/stage.sh split .whl .devbundle/rr .devbundle/i2i --every .gl --part-mb 4.7 \
#            --then "bash scripts/gpu/img2img_bundle.sh"   (then the calls it prints, back to back)
# Writes $OUT/img2img_bundle_sd21_h100.json (ROW names it otherwise), $OUT/img2img_bundle.log and the runs' reports.
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/img2img_bundle.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
source "$REPO/scripts/gpu/vulkan_env.sh"
source "$REPO/scripts/gpu/env.sh" || exit 3  # cd /tmp/runs: the repo's pocketdiff/ would shadow the installed one
PY=${PYTHON:-python3}
PD="$PY -m pocketdiff.cli"
BENCH="$PY $REPO/benchmarks/img2img_bundle.py"
BUNDLES=${BUNDLES:-/tmp/sd21_bundles}  # a dry run elsewhere: BUNDLES/tiny and ENC/enc512 given (POCKETDIFF_ENV_READY=1 SKIP_GL=1 PYTHON=...)
[ -d "$BUNDLES/tiny" ] || { say "unpack rr"; $PY "$REPO"/benchmarks/sd21_bundle.py unpack "$REPO/.devbundle/rr" "$BUNDLES" > /dev/null || exit 5; }
ENC=${ENC:-/tmp/i2i_enc}
[ -d "$ENC/enc512" ] || { say "unpack i2i"; $PY "$REPO"/benchmarks/sd21_bundle.py unpack "$REPO/.devbundle/i2i" "$ENC" > /dev/null || exit 5; }
B=$BUNDLES/tiny_i2i
if [ ! -f "$B/vae_encoder.tflite" ]; then  # hard links: the graft replaces the manifest, the tiny bundle stays as it was
  rm -rf "$B" && cp -al "$BUNDLES/tiny" "$B" && $BENCH graft "$B" "$ENC/enc512" || exit 6
fi
DEVICE=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
say "${DEVICE:-no nvidia-smi}"
echo "$DEVICE" > "$OUT/device.txt"
SIZE=$($PY -c "import json, sys; i = json.load(open(sys.argv[1]))['image']; print(i['width'], i['height'])" "$B/manifest.json")
$BENCH picture /tmp/runs/i2i_in.png $SIZE
R=$OUT/i2i_runs
mkdir -p "$R"
filt() { grep -v '^INFO: \|^WARNING: All log messages\|Could not load shared library'; }
say "verify-bundle: the encoder on the GPU (fp16 golden parity)"
timeout 90 $PD verify-bundle "$B" --components vae_encoder --precisions fp16 --timeout 80 --json "$R/verify_vae_encoder.json" 2>&1 | filt | tail -5
CACHE=/tmp/i2i_cache
rb() {  # rb NAME FLAGS...: one run-bundle --pipelined launch, its report kept as $R/NAME.json
  local name=$1; shift
  say "run-bundle $name: $*"
  timeout 100 $PD run-bundle "$B" --prompt "a lighthouse on a cliff at dusk" --seed 0 --pipelined --gpu-cache "$CACHE" \
    --output "/tmp/runs/$name" --overwrite "$@" 2>&1 | filt | tail -3
  cp "/tmp/runs/$name/report.json" "$R/$name.json" 2>/dev/null || say "$name: no report"
}
ROWFILE=$OUT/${ROW:-img2img_bundle_sd21_h100.json}
row() {  # the row from what ran so far (rewritten after every launch: a call cut at its limit returns it)
  $BENCH row --run "$R/i2i_cold.json" --warm "$R/i2i_warm.json" --text "$R/t2i_warm.json" --verify "$R/verify_vae_encoder.json" \
    --encoder768 "$R/encoder_768.json" --device "$DEVICE" --out "$ROWFILE"
}
rb i2i_cold --init-image /tmp/runs/i2i_in.png --strength 0.5
row
rb i2i_warm --init-image /tmp/runs/i2i_in.png --strength 0.5
row > /dev/null
rb t2i_warm
row > /dev/null
if [ -f "$ENC/enc768/vae_encoder.tflite" ]; then  # the 768 px encoder alone: compile, runs, memory
  say "encoder 768 px alone"
  timeout 60 $BENCH encoder "$ENC/enc768/vae_encoder.tflite" 768 --out "$R/encoder_768.json" 2>&1 | filt | tail -2
  row > /dev/null
fi
say "done: $ROWFILE"
