#!/usr/bin/env bash
# Where an SD bundle's load seconds go on a GPU machine's LiteRT GPU delegate (real Vulkan driver), through
# benchmarks/bundle_footprint.py. Repo root, carried: .whl/ (ai-edge-litert and the few wheels the image lacks),
# .gl/ (Vulkan loader debs), .devbundle/ (benchmarks/sd21_bundle.py pack of one layout), and for PROFILE=1 the py-spy
# binary in .pyspy/ (from its wheel's py_spy-*.data/scripts/: pip --target does not install a wheel's scripts).
#   1. `parallel`: every model file of the layout compiled by 1, 4, 8 threads at once (THREADS), cold then warm
#      program cache: whether LiteRT's per-model load overlaps across cores.
#   2. PROFILE=1: a native profile (py-spy, 200 Hz) of one warm load of the first UNet file, and that warm load
#      with the NVIDIA driver's own shader cache off (does the driver's cache matter once LiteRT's is warm?).
#   ENV_EACH=1: an environment per model; PROCS=2,4: the files also split over that many processes started at once
#   (is the serialisation per environment, per process, or the device's?). LITERT=nightly: LiteRT's libraries from
#   the carried .nightly/litert_nightly.tar.xz (ai-edge-litert-nightly's ai_edge_litert/ with its two .so files)
#   instead of the pinned wheel's, for the same runs side by side. STREAM=1: the UNet chunks streamed (each loaded, run,
#   released; 2 rounds) with an environment per load (run-bundle --stream-unet's way) and with one kept throughout.
# Writes $OUT/parallel_<layout>.json, $OUT/profile_*.json, $OUT/profile_warm.txt (py-spy raw stacks), a log.
#   THREADS=1,4,8 PROFILE=1 bash scripts/gpu/load_parallel.sh
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/load_parallel.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
source "$REPO/scripts/gpu/vulkan_env.sh"
source "$REPO/scripts/gpu/env.sh" || exit 3
cd "$REPO" || exit 3
PY=python3
BUNDLES=/tmp/sd21_bundles
[ -d "$BUNDLES" ] || $PY benchmarks/sd21_bundle.py unpack .devbundle "$BUNDLES" || exit 5
L=${LAYOUT:-$(ls "$BUNDLES" | head -1)}
B=$BUNDLES/$L
FILES=$(ls "$B"/text_encoder*.tflite "$B"/unet*.tflite "$B"/vae_*.tflite | sort -V)
if [ "${LITERT:-}" = nightly ]; then
  [ -d /tmp/litert_nightly ] || $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    "$REPO/.nightly/litert_nightly.tar.xz" /tmp/litert_nightly_x || exit 4
  [ -d /tmp/litert_nightly ] || mv /tmp/litert_nightly_x/ai_edge_litert_nightly /tmp/litert_nightly
  export PYTHONPATH=/tmp/litert_nightly:$PYTHONPATH
fi
say "LiteRT: $($PY -c 'import ai_edge_litert as a; print(a.__version__, a.__file__)')"
TAG=${TAG:-$L}
if [ "${THREADS:-}" != none ]; then  # THREADS=none: no parallel step
  say "== parallel $L (threads ${THREADS:-1,4,8}, processes ${PROCS:-none}): $(echo $FILES | xargs -n1 basename | tr '\n' ' ')"
  $PY benchmarks/bundle_footprint.py parallel $FILES --threads "${THREADS:-1,4,8}" --procs "${PROCS:-}" \
    ${ENV_EACH:+--env-each} --cache-root /tmp --out "$OUT/parallel_$TAG.json"
fi
if [ -n "${STREAM:-}" ]; then  # STREAM=1: the UNet chunks loaded, run, released in turn (2 rounds), env per load vs one kept
  U=$(ls "$B"/unet.[0-9]*.tflite | sort -V); C=/tmp/stream-cache; rm -rf $C
  for how in "--env-each cold" "--env-each warm" "shared warm" "--env-each again"; do
    set -- $how; flag=$1; [ "$flag" = shared ] && flag=""
    say "== stream $L ${flag:-one environment} ($2)"
    $PY benchmarks/bundle_footprint.py stream $U --rounds 2 $flag --cache $C --out "$OUT/stream_${1#--}_$2.json" | tail -1
  done
fi
if [ -n "${STREAM_AB:-}" ]; then  # STREAM_AB=1: why run-bundle's streamed loads take ~2x the stream probe's (same files)
  U=$(ls "$B"/unet.[0-9]*.tflite | sort -V); C=/tmp/streamab-cache; rm -rf $C /tmp/streamab-driver
  ab() { local tag=$1; shift; say "== stream A/B: $tag"  # ab TAG [--marks] [env VAR=VALUE]
    local marks=; [ "${1:-}" = --marks ] && { marks=--marks; shift; }
    "$@" $PY benchmarks/bundle_footprint.py stream $U --rounds 1 --env-each $marks --cache $C --out "$OUT/streamab_$tag.json" | tail -1; }
  D="env __GL_SHADER_DISK_CACHE_PATH=/tmp/streamab-driver"
  ab cold; ab warm; ab warm_marks --marks
  ab driverdir_cold $D; ab driverdir_warm $D; ab driverdir_warm_marks --marks $D
fi
if [ "${PROFILE:-1}" = 1 ]; then
  F=$(ls "$B"/unet.0.tflite "$B"/unet.tflite 2>/dev/null | head -1)
  C=/tmp/profile-cache; rm -rf $C
  say "== profile $(basename $F): cold, warm under py-spy, warm with the driver's cache off"
  $PY benchmarks/bundle_footprint.py together "$F" --cache $C > "$OUT/profile_cold.json"
  [ -x "${PYSPY:-.pyspy/py-spy}" ] || { say "no py-spy binary at ${PYSPY:-.pyspy/py-spy}: carry .pyspy/"; exit 4; }
  "${PYSPY:-.pyspy/py-spy}" record --native -r 200 -f raw -o "$OUT/profile_warm.txt" -- \
    $PY benchmarks/bundle_footprint.py together "$F" --cache $C > "$OUT/profile_warm.json"
  $PY benchmarks/bundle_footprint.py together "$F" --cache $C > "$OUT/profile_warm_again.json"
  __GL_SHADER_DISK_CACHE=0 $PY benchmarks/bundle_footprint.py together "$F" --cache $C > "$OUT/profile_warm_no_driver_cache.json"
  for f in "$OUT"/profile_*.json; do echo "$(basename $f): $(grep -o '"load_wall_s": [0-9.]*' $f)"; done
fi
say "done"
