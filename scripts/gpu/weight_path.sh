#!/usr/bin/env bash
# Issue 49 (the delegate's weight path) and issue 48 item 4 on a GPU machine's LiteRT GPU delegate (real Vulkan
# driver), through the product's own runners. Repo root; carried: .whl/ (the wheels of env.sh), .gl/ (Vulkan loader
# debs), .devbundle/<SET>/ (each a `benchmarks/sd21_bundle.py pack BUNDLE:LAYOUT --dest .devbundle/SET` of SD-2.1-size
# bundles), optionally .devprobe/ (small .tflite files for the per-op-kind probe). Parts (PARTS, comma list):
#   repro  benchmarks/weight_cache_repro.py on the committed tiny model, crashes re-run under cuda-gdb
#   runs   `pocketdiff run-bundle` per layout (RUN_LAYOUTS, default all), MODES (default pipelined), cold then warm;
#          GPU_OPTION=KEY=VALUE passes one accelerator option (run-bundle --gpu-option). Issue 49 item 3's modes:
#          overlap (--pipelined --overlap-loads: each model in a worker of its own, the next one compiled during the
#          current one; it writes the measured per-model figures) and overlapN (the same under --memory-budget-mb N,
#          from the figures the overlap mode measured: list overlap first), e.g. MODES=pipelined,overlap,overlap6000;
#          each row: start_s, total_s, unet_step_s, host/GPU peaks and host_plus_gpu_peak_at_once_mb, overlap_levels
#   probe  each UNet file of PROBE_LAYOUTS alone in a fresh process (host RSS, GPU memory, load time); PROBE_SETS: the
#          option sets (bundle_footprint.py OPTION_SETS, default base; int8_kernels for int8.storage: direct files)
#   images `pocketdiff run-bundle --pipelined` once per layout of IMAGE_LAYOUTS (one prompt, seed 0), each image's PSNR
#          against the first layout's (images.json; 999: identical): the same weights through other graphs give the same image
#   ops    each .tflite of $PROBE_DIR (default .devprobe/) alone in a fresh process (GPU bytes per parameter by op kind and
#          storage; PROBE_DIR=.devprobe2: benchmarks/activation_probe.py, activation memory)
# Bundles stay unpacked in /tmp/sd21_bundles between calls of a warm machine (a later call carries only new sets).
# Writes $OUT/weight_path_out.tgz (weight_cache_repro.json, runs_<layout>.json, probe_<layout>_<file>.json, ops.json) and the log.
#   PARTS=repro,runs,probe PROBE_LAYOUTS="base int8gpu" bash scripts/gpu/weight_path.sh
#   PARTS=runs RUN_LAYOUTS=sd21 MODES=pipelined,overlap,overlap6000 bash scripts/gpu/weight_path.sh
# A set of ~19-26 MB does not fit beside .whl/ and the ~50.5 MB tracked tree (64 MiB a call): stage it over back-to-back
# calls of one warm machine (scripts/gpu/stage.sh; /tmp outlives a call, a machine goes back 30 s after one). Here:
#   bash scripts/gpu/stage.sh split .devbundle/SET [.devbundle/SET2 ...] --every .gl --first .whl \
#     --then "PARTS=runs RUN_LAYOUTS=LAYOUT bash scripts/gpu/weight_path.sh"
# prints the calls with each one's measured bytes (one 26.6 MB set: 2 parts of 13.3 MB, every call <= 64.17 MB):
#   call 1      carry .whl .gl          source scripts/gpu/env.sh   (the wheels into /tmp/site, kept for later calls)
#   next calls  carry .stage/pNN .gl    bash scripts/gpu/stage.sh receive
#   last call   carry .stage/pLAST .gl  bash scripts/gpu/stage.sh receive && bash scripts/gpu/stage.sh restore && PARTS=... bash scripts/gpu/weight_path.sh
# (restore links .devbundle/SET into this call's repo copy; the unpacked bundles then stay in /tmp/sd21_bundles.)
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
RES=/tmp/weight_path_out  # everything lands here, then one .tgz in $OUT (a call returns 8 files at most)
rm -rf "$RES" && mkdir -p "$OUT" "$RES"
exec > >(tee -a "$RES/weight_path.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
ship() { tar czf "$OUT/weight_path_out.tgz" -C "$RES" . && cp "$RES/weight_path.log" "$OUT/"; }  # after each step: a call cut at its limit still returns what ran
PARTS=${PARTS:-repro,runs,probe}
MODES=${MODES:-pipelined}
source "$REPO/scripts/gpu/vulkan_env.sh"
source "$REPO/scripts/gpu/env.sh" || exit 3  # works from /tmp/runs: the repo's pocketdiff/ would shadow the installed package
PY=python3
BUNDLES=/tmp/sd21_bundles
for d in "$REPO"/.devbundle/*/; do
  [ -f "$d/index.json" ] || continue
  for L in $($PY -c "import json,sys; print(' '.join(json.load(open(sys.argv[1]))['layouts']))" "$d/index.json"); do
    [ -d "$BUNDLES/$L" ] && continue
    $PY "$REPO"/benchmarks/sd21_bundle.py unpack "$d" "$BUNDLES" || exit 5
  done
done
LAYOUTS=$(ls "$BUNDLES" 2>/dev/null)
say "layouts: $LAYOUTS"
if [[ ,$PARTS, == *,repro,* ]]; then
  say "== weight cache reproducer"
  $PY "$REPO"/benchmarks/weight_cache_repro.py run "$REPO"/benchmarks/data/weight_cache_tiny.tflite --gdb --out "$RES/weight_cache_repro.json"
fi
PROBE_DIR=${PROBE_DIR:-.devprobe}  # ops: the folder of .tflite.xz files (benchmarks/activation_probe.py make .devprobe2)
if [[ ,$PARTS, == *,ops,* ]] && [ -d "$REPO/$PROBE_DIR" ]; then  # benchmarks/weight_storage_probe.py make .devprobe
  rm -rf /tmp/devprobe /tmp/ops_*.json && mkdir -p /tmp/devprobe
  for X in "$REPO/$PROBE_DIR"/*.tflite.xz; do
    [ -f "$X" ] && $PY -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$X" "/tmp/devprobe/$(basename "$X" .xz)"
  done
  say "== per-op-kind probe: $(ls /tmp/devprobe | tr '\n' ' ')"
  for F in /tmp/devprobe/*.tflite; do
    $PY "$REPO"/benchmarks/bundle_footprint.py matrix "$F" --sets ${PROBE_SETS:-base} --out "/tmp/ops_$(basename "$F" .tflite).json"
  done
  $PY -c "import json,glob; json.dump({'rows': [r for f in sorted(glob.glob('/tmp/ops_*.json')) for r in json.load(open(f))['rows']]}, open('$RES/ops.json','w'), indent=1)"
fi
if [[ ,$PARTS, == *,runs,* ]]; then
  for L in ${RUN_LAYOUTS:-$LAYOUTS}; do
    say "== runs $L ($MODES)"
    $PY "$REPO"/benchmarks/bundle_footprint.py runs "$BUNDLES/$L:$L" --modes "$MODES" --tag weight_path${GPU_OPTION:+_opt} ${GPU_OPTION:+--gpu-option $GPU_OPTION} --out "$RES/runs_$L.json" --cache-root /tmp/pd-cache
    ship
  done
fi
if [[ ,$PARTS, == *,images,* ]]; then
  set -- ${IMAGE_LAYOUTS:-$LAYOUTS}
  PROMPT="a red apple on a wooden table"
  say "== images: $*"
  for L in "$@"; do
    $PY -m pocketdiff.cli run-bundle "$BUNDLES/$L" --prompt "$PROMPT" --seed 0 --pipelined --output "/tmp/images/$L" \
      --gpu-cache /tmp/pd-cache/images_$L --overwrite > "$RES/images_$L.log" 2>&1 || say "run-bundle $L failed (images_$L.log)"
  done
  $PY - "$RES/images.json" "$PROMPT" "$@" <<'PYEOF'
import json, sys
import numpy as np
from PIL import Image
from pocketdiff.runtime.tiled_decode import psnr_db
out, prompt, layouts = sys.argv[1], sys.argv[2], sys.argv[3:]
def read(L):  # None where run-bundle made no image (its log says why)
    try:
        return np.asarray(Image.open(f"/tmp/images/{L}/image.png"), dtype=np.float64) / 255.0
    except OSError:
        return None
img = {L: read(L) for L in layouts}
ref = layouts[0]
rows = [{"layout": L, "reference": ref, "image": img[L] is not None,
         "psnr_db": None if L == ref or img[L] is None or img[ref] is None else min(round(psnr_db(img[ref], img[L]), 2), 999.0)}
        for L in layouts]
json.dump({"prompt": prompt, "seed": 0, "mode": "pipelined", "rows": rows}, open(out, "w"), indent=1)
print(json.dumps(rows))
PYEOF
  ship
fi
if [[ ,$PARTS, == *,probe,* ]]; then
  for L in ${PROBE_LAYOUTS:-}; do
    for F in "$BUNDLES/$L"/unet.tflite "$BUNDLES/$L"/unet.[0-9]*.tflite "$BUNDLES/$L"/text_encoder*.tflite; do
      [ -f "$F" ] || continue
      stem=$(basename "$F" .tflite)
      [ -n "${PROBE_ONLY:-}" ] && [[ " $PROBE_ONLY " != *" $stem "* ]] && continue  # e.g. PROBE_ONLY="unet.3 unet.6"
      say "== probe $L/$stem"
      $PY "$REPO"/benchmarks/bundle_footprint.py matrix "$F" --sets ${PROBE_SETS:-base} --out "$RES/probe_${L}_${stem}.json"
    done
  done
fi
say "done"
ship
