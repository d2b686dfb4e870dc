#!/usr/bin/env bash
# The delegate stage of benchmarks/export_sd21.py on a GPU machine (the device tool), run from
# the repo root with two carried folders:
#   .devexport/  made here by `benchmarks/export_sd21.py --stage convert --pack .devexport`
#                (manifest.json, *.npy, *.tflite.zst) plus the ai-edge-litert wheel for the
#                machine's Python and ml_dtypes (its one dependency missing beside numpy)
#   .gl/         Vulkan loader + libglvnd debs (the NVIDIA Vulkan ICD needs them)
# Conversion happens where litert-torch is installed; this machine needs only numpy + ai-edge-litert.
#   bash scripts/gpu/export_delegate.sh [extra --stage delegate args, e.g. --variants ours_fp16_rs --skip-cpu]
# Writes $OUT/export_sd21.json (rewritten after every run) and $OUT/export_delegate.log.
# Local dry run (lavapipe, the venv's ai-edge-litert):
#   SKIP_GL=1 SKIP_PIP=1 PYTHON=.venv/bin/python OUT=/tmp/o bash scripts/gpu/export_delegate.sh
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
[[ $PY == */* && $PY != /* ]] && PY=$REPO/$PY  # the stage runs from /tmp
SITE=${SITE:-/tmp/site}
WORK=${WORK:-/tmp/export_sd21}
SRC=${DEVEXPORT:-.devexport}  # the packed folder
BUDGET=${BUDGET:-540}  # seconds for the delegate stage (one device command runs <= 600 s)
mkdir -p "$OUT" "$WORK" "$SITE"
LOG=$OUT/export_delegate.log
exec > >(tee -a "$LOG") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
[ -f "$SRC/manifest.json" ] || { say "no $SRC/manifest.json (carry .devexport)"; exit 2; }

# 1. Vulkan: loader + glvnd from the carried debs; the NVIDIA ICD json where the driver put it
if [ -z "${SKIP_GL:-}" ]; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
if [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ]; then
  for j in /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json \
           /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/local/share/vulkan/icd.d/nvidia_icd.json; do
    if [ -f "$j" ]; then export VK_DRIVER_FILES=$j; break; fi
  done
  glx=$(ldconfig -p 2>/dev/null | awk '/libGLX_nvidia\.so\.0/{print $NF; exit}')
  if [ -z "${VK_DRIVER_FILES:-}" ] && [ -n "$glx" ]; then  # driver present, json not: write one
    printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$glx" > /tmp/nvidia_icd.json
    export VK_DRIVER_FILES=/tmp/nvidia_icd.json
  fi
fi
say "VK_DRIVER_FILES=${VK_DRIVER_FILES:-} VK_ICD_FILENAMES=${VK_ICD_FILENAMES:-}"
glx=$(ldconfig -p 2>/dev/null | awk '/libGLX_nvidia\.so\.0/{print $NF; exit}')
[ -n "$glx" ] && ldd "$glx" 2>/dev/null | grep "not found" && say "libGLX_nvidia misses the libraries above"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null

# 2. ai-edge-litert (+ ml_dtypes unless present) into $SITE; pocketdiff's core + export beside it
if [ -z "${SKIP_PIP:-}" ]; then
  wheels=$(ls "$SRC"/ai_edge_litert-*.whl)
  $PY -c "import ml_dtypes" 2>/dev/null || wheels="$wheels $(ls "$SRC"/ml_dtypes-*.whl 2>/dev/null)"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $wheels || exit 3
fi
rm -rf "$SITE/pocketdiff" && mkdir -p "$SITE/pocketdiff"
cp pocketdiff/*.py "$SITE/pocketdiff/" && cp -r export "$SITE/pocketdiff/export"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -z "${POCKETDIFF_VULKAN:-}" ] && { [ -e /dev/nvidia0 ] || [ -e /proc/driver/nvidia/version ]; }; then
  export POCKETDIFF_VULKAN=system  # the machine's NVIDIA Vulkan driver, never lavapipe
fi
$PY -c "import numpy, ai_edge_litert.compiled_model as c; print('numpy', numpy.__version__, 'ai_edge_litert', c.__file__)" || exit 4

# 3. the files, decompressed in parallel
cp "$SRC"/manifest.json "$SRC"/*.npy "$WORK/"
t0=$SECONDS
pids=()
for z in "$SRC"/*.tflite.zst "$SRC"/*.tflite.xz; do
  [ -f "$z" ] || continue
  b=$(basename "$z"); b=${b%.*}
  case "$z" in
    *.xz) $PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'), 1 << 24)" "$z" "$WORK/$b" & pids+=($!) ;;
    *) if command -v zstd > /dev/null; then
         zstd -d -q -f --long=31 --memory=2048MB "$z" -o "$WORK/$b" & pids+=($!)
       else
         $PY -c "import sys, zstandard; zstandard.ZstdDecompressor(max_window_size=2**31).copy_stream(open(sys.argv[1], 'rb'), open(sys.argv[2], 'wb'))" "$z" "$WORK/$b" & pids+=($!)
       fi ;;
  esac
done
for p in "${pids[@]}"; do wait "$p" || say "decompression $p failed"; done  # not a bare wait: tee is a child too
say "decompressed in $((SECONDS - t0)) s: $(ls -la "$WORK" | awk '/tflite/{printf "%s %.0f MiB; ", $9, $5/1048576}')"

# 4. the delegate stage (each run in its own child process; cwd outside the repo, whose
#    pocketdiff/ folder would shadow the package in $SITE)
cd /tmp
$PY "$REPO/benchmarks/export_sd21.py" --stage delegate --workdir "$WORK" --out "$OUT/export_sd21.json" \
  --timeout 240 --budget-s "$BUDGET" --repeats 10 --warmup 2 "$@"
rc=$?
say "delegate stage exit $rc"
$PY - "$OUT/export_sd21.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print("driver", r.get("delegate_driver"), "| activations max", (r.get("activations") or {}).get("max_abs"))
for v, row in (r.get("summary") or {}).items():
    print(v, json.dumps({k: x for k, x in row.items() if x not in (None, {}, [])}, default=str))
EOF
exit $rc
