#!/usr/bin/env bash
# The delegate stage of benchmarks/export_sd21.py on a GPU machine (the device tool), run from
# the repo root with two carried folders:
#   .devexport/  the runtime: the ai-edge-litert wheel for the machine's Python (or
#                ai_edge_litert-*-slim.tar.xz: the same files minus the NPU plugins and
#                tools/apply_plugin_main) and ml_dtypes (its one dependency beside numpy);
#                and one or more packed sets, each made here by
#                `benchmarks/export_sd21.py --stage convert|pack --pack .devexport/SET`
#                (manifest.json, *.npy, *.tflite.zst or *.tflite.xz); .devexport itself may be a set
#   .gl/         Vulkan loader + libglvnd debs (the NVIDIA Vulkan ICD needs them); .gl/zstd/ the
#                zstd deb, used only where the machine has no zstd
# Conversion happens where litert-torch is installed; this machine needs only numpy + ai-edge-litert.
#   bash scripts/gpu/export_delegate.sh [extra --stage delegate args, e.g. --variants ours_fp16_rs --skip-cpu]
#   SETS="normal002" bash scripts/gpu/export_delegate.sh      # only some sets (default: all, in name order)
# Writes $OUT/export_sd21.json ({set: result}; each set's $OUT/export_sd21_SET.json is rewritten
# after every run, so a cut-off command keeps what it measured) and $OUT/export_delegate.log.
# Local dry run (lavapipe, the venv's ai-edge-litert):
#   SKIP_GL=1 SKIP_PIP=1 PYTHON=.venv/bin/python OUT=/tmp/o POCKETDIFF_VULKAN_DIR=$PWD/.vulkan bash scripts/gpu/export_delegate.sh
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
[[ $PY == */* && $PY != /* ]] && PY=$REPO/$PY  # the stage runs from /tmp
SITE=${SITE:-/tmp/site}
WORK=${WORK:-/tmp/export_sd21}
SRC=${DEVEXPORT:-.devexport}
BUDGET=${BUDGET:-540}  # seconds for everything below (one device command runs <= 600 s)
mkdir -p "$OUT" "$WORK" "$SITE"
LOG=$OUT/export_delegate.log
exec > >(tee -a "$LOG") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
if [ -z "${SETS:-}" ]; then
  SETS=$(for m in "$SRC"/*/manifest.json; do [ -f "$m" ] && basename "$(dirname "$m")"; done | sort -r | tr '\n' ' ')
  [ -f "$SRC/manifest.json" ] && SETS=". $SETS"
fi
[ -n "${SETS// /}" ] || { say "no manifest.json in $SRC or its subfolders (carry .devexport)"; exit 2; }
say "sets: $SETS"

# 1. Vulkan: loader + glvnd from the carried debs; the NVIDIA ICD json where the driver put it
source "$REPO/scripts/gpu/vulkan_env.sh"
glx=$(ldconfig -p 2>/dev/null | awk '/libGLX_nvidia\.so\.0/{print $NF; exit}')
say "VK_DRIVER_FILES=${VK_DRIVER_FILES:-} VK_ICD_FILENAMES=${VK_ICD_FILENAMES:-} libGLX_nvidia=${glx:-none}"
[ -n "$glx" ] && ldd "$glx" 2>/dev/null | grep "not found" && say "libGLX_nvidia misses the libraries above"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null

# 2. ai-edge-litert (+ ml_dtypes unless present) into $SITE; pocketdiff's core + export beside it
if [ -z "${SKIP_PIP:-}" ]; then
  wheels=$(ls "$SRC"/ai_edge_litert-*.whl 2>/dev/null)
  $PY -c "import ml_dtypes" 2>/dev/null || wheels="$wheels $(ls "$SRC"/ml_dtypes-*.whl 2>/dev/null)"
  if [ -n "${wheels// /}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $wheels || exit 3
  fi
  for t in "$SRC"/ai_edge_litert-*.tar.xz; do
    [ -f "$t" ] && $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$t" "$SITE"
  done
fi
rm -rf "$SITE/pocketdiff" && mkdir -p "$SITE/pocketdiff"
cp pocketdiff/*.py "$SITE/pocketdiff/" && cp -r export "$SITE/pocketdiff/export"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -z "${POCKETDIFF_VULKAN:-}" ] && { [ -e /dev/nvidia0 ] || [ -e /proc/driver/nvidia/version ]; }; then
  export POCKETDIFF_VULKAN=system  # the machine's NVIDIA Vulkan driver, never lavapipe
fi
$PY -c "import numpy, ai_edge_litert.compiled_model as c; print('numpy', numpy.__version__, 'ai_edge_litert', c.__file__)" || exit 4

# 3. the files of every set, decompressed in parallel (zstd: the machine's, else the carried
#    Debian one, .gl/zstd/*.deb, unpacked into /tmp/zstd; .xz: Python's lzma)
ZSTD=$(command -v zstd)
if [ -z "$ZSTD" ] && ls .gl/zstd/*.deb > /dev/null 2>&1; then
  dpkg -x .gl/zstd/*.deb /tmp/zstd && ZSTD=/tmp/zstd/usr/bin/zstd
fi
say "zstd: ${ZSTD:-none} $($ZSTD --version 2>&1 | head -1)"
unpack() {  # src dst
  case "$1" in
    *.xz) $PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'), 1 << 24)" "$1" "$2" ;;
    *) if [ -n "$ZSTD" ]; then
         "$ZSTD" -d -q -f --long=31 --memory=2048MB "$1" -o "$2"
       else
         $PY -c "import sys, zstandard; zstandard.ZstdDecompressor(max_window_size=2**31).copy_stream(open(sys.argv[1], 'rb'), open(sys.argv[2], 'wb'))" "$1" "$2"
       fi ;;
  esac
}
t0=$SECONDS
pids=()
for set in $SETS; do
  mkdir -p "$WORK/$set"
  cp "$SRC/$set"/manifest.json "$SRC/$set"/*.npy "$WORK/$set/"
  for z in "$SRC/$set"/*.tflite.zst "$SRC/$set"/*.tflite.xz; do
    [ -f "$z" ] || continue
    b=$(basename "$z"); unpack "$z" "$WORK/$set/${b%.*}" & pids+=($!)
  done
done
for p in "${pids[@]}"; do wait "$p" || say "a decompression failed ($p)"; done  # not a bare wait: tee is a child too
say "decompressed in $((SECONDS - t0)) s: $(cd "$WORK" && ls -l */*.tflite | awk '{printf "%s %.0f MiB; ", $9, $5/1048576}')"

# 4. the delegate stage per set (each run in its own child process; cwd outside the repo, whose
#    pocketdiff/ folder would shadow the package in $SITE); the time left is shared out
cd /tmp
rc=0
n=$(echo $SETS | wc -w)
for set in $SETS; do
  left=$((BUDGET - SECONDS))
  share=$((left / n)); n=$((n - 1))
  name=$( [ "$set" = . ] && echo export_sd21 || echo "export_sd21_$set")
  say "set $set: ${share} s"
  $PY "$REPO/benchmarks/export_sd21.py" --stage delegate --workdir "$WORK/$set" --out "$OUT/$name.json" \
    --timeout 240 --budget-s "$share" --repeats 10 --warmup 2 "$@" || rc=$?
done
say "delegate stage exit $rc"
$PY - "$OUT" $SETS <<'EOF'
import json, sys
from pathlib import Path
out, sets = Path(sys.argv[1]), sys.argv[2:]
merged = {}
for s in sets:
    f = out / ("export_sd21.json" if s == "." else f"export_sd21_{s}.json")
    if not f.is_file():
        continue
    r = merged[s] = json.loads(f.read_text())
    print(f"== {s}: driver {r.get('delegate_driver')}, init {r.get('init')}, activation max {(r.get('activations') or {}).get('max_abs')}")
    for v, row in (r.get("summary") or {}).items():
        print(v, json.dumps({k: x for k, x in row.items() if x not in (None, {}, [])}, default=str))
if "." not in sets:
    (out / "export_sd21.json").write_text(json.dumps(merged, indent=2))
EOF
exit $rc
