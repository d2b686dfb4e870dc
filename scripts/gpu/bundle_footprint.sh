#!/usr/bin/env bash
# Memory and start-up of SD-2.1-size bundles on a GPU machine's LiteRT GPU delegate (real Vulkan driver),
# through the product's own code (benchmarks/bundle_footprint.py). Repo root, carried: .whl/ (ai-edge-litert
# and the few wheels the image lacks), .gl/ (Vulkan loader debs), .devbundle/ (benchmarks/sd21_bundle.py pack).
#   PARTS=probe  per UNet file (each chunk of a chunked UNet alone) and the text encoder, each option set of the
#                accelerator in its own process (host RSS, GPU, time per phase)
#   PARTS=runs   pocketdiff run-bundle end to end: plain / --pipelined (/ streamed: --stream-unet, a chunked UNet), cold / warm launch, per layout
# Writes $OUT/probe_<layout>_<unet file>.json, $OUT/probe_text_encoder.json, $OUT/runs_<tag>.json, $OUT/bundle_footprint.log.
#   PARTS=probe,runs bash scripts/gpu/bundle_footprint.sh
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/bundle_footprint.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
PARTS=${PARTS:-probe,runs}
SETS_UNET=${SETS_UNET:-base,madvise,gpu_convert,lean,single_delegate,cached,cached_weights}
SETS_TE=${SETS_TE-base,lean,cached}  # empty: no text-encoder probe
source "$REPO/scripts/gpu/vulkan_env.sh"
source "$REPO/scripts/gpu/env.sh" || exit 3
PY=python3
BUNDLES=/tmp/sd21_bundles
if [ ! -d "$BUNDLES" ]; then
  $PY "$REPO/benchmarks/sd21_bundle.py" unpack "$REPO/.devbundle" "$BUNDLES" || exit 5
fi
LAYOUTS=$(ls "$BUNDLES")
say "layouts: $LAYOUTS"
FIRST=$(echo $LAYOUTS | awk '{print $1}')
# PROBE_LAYOUTS: the layouts whose UNet files are probed (default: the first); a UNet in chunks
# (export unet_chunks: K) is probed chunk file by chunk file, each alone in its own process
PROBE_LAYOUTS=${PROBE_LAYOUTS:-$FIRST}
if [[ ,$PARTS, == *,probe,* ]]; then
  for L in $PROBE_LAYOUTS; do
    for F in "$BUNDLES/$L"/unet.tflite "$BUNDLES/$L"/unet.[0-9]*.tflite; do
      [ -f "$F" ] || continue
      stem=$(basename "$F" .tflite)
      say "== probe $L/$stem ($SETS_UNET)"
      $PY "$REPO/benchmarks/bundle_footprint.py" matrix "$F" --sets "$SETS_UNET" --out "$OUT/probe_${L}_${stem}.json" --cache-root /tmp
    done
    chunks=$(ls "$BUNDLES/$L"/unet.[0-9]*.tflite 2>/dev/null | sort -V)
    if [ -n "$chunks" ]; then
      say "== chain $L: $(echo $chunks | xargs -n1 basename | tr '\n' ' ')"
      $PY "$REPO/benchmarks/bundle_footprint.py" chain $chunks --out "$OUT/chain_${L}.json"
    fi
  done
  if [ -n "$SETS_TE" ]; then
    say "== probe text_encoder ($SETS_TE)"
    $PY "$REPO/benchmarks/bundle_footprint.py" matrix "$BUNDLES/$FIRST/text_encoder.tflite" --sets "$SETS_TE" --out "$OUT/probe_text_encoder.json" --cache-root /tmp
  fi
fi
# VARIANTS="tag|modes|KEY=VALUE,KEY=VALUE;tag2|modes|..." : run-bundle variants (default: the runner's defaults, both modes);
# the word no-gpu-cache among the options runs without the program cache
VARIANTS=${VARIANTS:-"default|plain,pipelined|"}
if [[ ,$PARTS, == *,runs,* ]]; then
  args=""; for L in ${RUN_LAYOUTS:-$LAYOUTS}; do args="$args $BUNDLES/$L:$L"; done
  IFS=';' read -ra variants <<< "$VARIANTS"
  for v in "${variants[@]}"; do
    IFS='|' read -r tag modes opts <<< "$v"
    flags=""; IFS=',' read -ra kv <<< "$opts"; for o in "${kv[@]}"; do [ -n "$o" ] && flags="$flags --gpu-option $o"; done
    say "== runs $tag ($modes$flags): $args"
    $PY "$REPO/benchmarks/bundle_footprint.py" runs $args --modes "$modes" --tag "$tag" $flags --out "$OUT/runs_$tag.json" --cache-root /tmp/pd-cache
  done
fi
say "done"
