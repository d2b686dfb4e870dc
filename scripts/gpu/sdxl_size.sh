#!/usr/bin/env bash
# Issue 63 item 3 (first two parts) at SDXL size in ONE call on one H100 (<= 8 min), repo root, after the staged
# wheels (.whl, scripts/gpu/env.sh); nothing else carried: every model is built from SDXL base's config here.
#   bash scripts/gpu/sdxl_size.sh
# 1. (background, CPU) benchmarks/sdxl_size.py build: an SDXL base-shaped StableDiffusionXLPipeline (2.6 B UNet, both
#    text encoders, random weights, norms perturbed) saved as a folder, for calibrate's real loading path
# 2. (GPU, meanwhile) benchmarks/distill_step.py --arch sdxl: the distill step through the trainer's own code
#    (pocketdiff.train.distill_targets / consistency_loss) against diffusers' default eager step (fp32 weights under
#    bf16 autocast, separate cond/uncond passes, foreach AdamW), same UNet, batch, 128x128 latents, pooled embeddings
#    and time ids; levers of the ours variants: bf16 teacher weights, one fused cond/uncond batch, channels_last,
#    cudnn.benchmark, fused AdamW; torch.compile off (COMPILE=on compiles; an SDXL UNet's compile takes minutes).
#    If the eager step runs out of memory at $BATCH, eager + ours_wcond again at batch 1.
# 3. (GPU) `pocketdiff calibrate --config configs/sdxl/calibrate_smoke.yaml model.pretrained=<folder>` (W8, block-wise
#    reconstruction, $CAL_ITERS iterations per block) under /usr/bin/time -v, nvidia-smi sampled every 0.5 s
# 4. benchmarks/sdxl_size.py summary -> $OUT/sdxl_distill_step_<gpu>.json and $OUT/sdxl_calibrate_<gpu>.json (copy them
#    into benchmarks/results/ here), logs in $OUT/sdxl_size_logs.tgz; the run folders are deleted at the end.
# Settings by environment: BUDGET=450 (s, the whole script) DISTILL_S=180 (distill watchdog) ARCH=sdxl BATCH=2
#   VARIANTS=eager,ours_wcond,ours_eager,ours_lcm ITERS=8 WARMUP=2 COMPILE=off CAL_ITERS=20 CAL_EXTRA= (key=value
#   overrides of calibrate) PY=python3 PARTS=distill,calibrate TAG= (a suffix of the output files' names). A second call
#   for the compiled step alone: PARTS=distill COMPILE=on VARIANTS=eager,ours_wcond DISTILL_S=420 TAG=_compiled.
#   SKIP_ENV=1: no env.sh (a CPU dry run: SKIP_ENV=1 PY=$PWD/.venv/bin/python ARCH=tiny_xl ITERS=1 WARMUP=1 CAL_ITERS=2
#   CAL_EXTRA="device=cpu memory_cap_gib=null recon.autocast=off" OUT=/tmp/dry/out RUNS=/tmp/dry/runs; ~2 min)
set -u
T0=$SECONDS; BUDGET=${BUDGET:-450}
if [ -z "${SKIP_ENV:-}" ]; then source scripts/gpu/env.sh; else REPO=$PWD; RUNS=${RUNS:-/tmp/runs}; mkdir -p $RUNS; fi
PY=${PY:-python3} ARCH=${ARCH:-sdxl} BATCH=${BATCH:-2} ITERS=${ITERS:-8} WARMUP=${WARMUP:-2} COMPILE=${COMPILE:-off}
VARIANTS=${VARIANTS:-eager,ours_wcond,ours_eager,ours_lcm} CAL_ITERS=${CAL_ITERS:-20} CAL_EXTRA=${CAL_EXTRA:-}
CAL_CONFIG=configs/sdxl/calibrate_smoke.yaml PARTS=${PARTS:-distill,calibrate}
TAG=${TAG:-}
want() { [[ ",$PARTS," == *",$1,"* ]]; }
OUT=${OUT:-$RUNS/out}; mkdir -p $OUT
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower() if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo cpu)
L=$RUNS/sdxl_size && rm -rf $L && mkdir -p $L || exit 1
META=$L/meta.json; echo "{}" > $META
meta() { $PY - "$META" "$1" "$2" <<'EOF'
import json, sys
p, k, v = sys.argv[1:]
d = json.load(open(p)); d[k] = json.loads(v); json.dump(d, open(p, "w"), indent=1)
EOF
}
left() { echo $((BUDGET - (SECONDS - T0))); }
step() {  # step NAME SECONDS CMD...: run with a watchdog (at most what is left), log, wall time and exit code into META
  local name=$1 most=$2 t; shift 2; t=$(left); [ "$t" -gt "$most" ] && t=$most
  if [ "$t" -lt 20 ]; then echo "[$(date +%T)] skip $name: ${t} s left"; meta "${name}_skipped" true; return 1; fi
  echo "[$(date +%T)] $name (watchdog ${t} s)"; local s=$SECONDS
  timeout -k 10 "$t" "$@" > $L/$name.log 2>&1; local rc=$?
  meta "${name}_exit" $rc; meta "${name}_wall_s" $((SECONDS - s))
  echo "[$(date +%T)] $name exit $rc in $((SECONDS - s)) s$([ $rc -ge 124 ] && echo ' (watchdog)')"
  [ $rc -eq 0 ] || tail -4 $L/$name.log
  return $rc
}
meta device "\"$($PY -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")' 2>/dev/null)\""
meta budget_s $BUDGET

# 1. the folder, built on the CPU while the GPU runs the distill step (8 threads: the step's own CPU work keeps the rest)
want calibrate && ( s=$SECONDS; OMP_NUM_THREADS=8 timeout -k 10 $(( $(left) - 60 )) $PY $REPO/benchmarks/sdxl_size.py build $L/sdxl --arch $ARCH --threads 8 \
    > $L/build.log 2>&1; echo "$? $((SECONDS - s))" > $L/build.rc ) < /dev/null &
BUILD=$!

# 2. the distill step (the benchmark imports the installed package: run from benchmarks/)
BENCH_ARGS="--arch $ARCH --compile $COMPILE --flops off --iters $ITERS --warmup $WARMUP"
DISTILL_JSONS=""
if want distill; then
(cd $REPO/benchmarks && step distill ${DISTILL_S:-180} $PY distill_step.py --out $L/distill.json $BENCH_ARGS --batch $BATCH --variants $VARIANTS)
grep '^\[distill_step\]' $L/distill.log
DISTILL_JSONS="--distill $L/distill.json"
if $PY -c "import json, sys; sys.exit(0 if json.load(open('$L/distill.json'))['variants'].get('eager', {}).get('oom') else 1)" 2>/dev/null \
   && [ "$BATCH" -gt 1 ]; then  # the eager step does not fit $BATCH: both at batch 1, the ratio at a batch both fit
  (cd $REPO/benchmarks && step distill_b1 100 $PY distill_step.py --out $L/distill_b1.json $BENCH_ARGS --batch 1 --variants eager,ours_wcond)
  grep '^\[distill_step\]' $L/distill_b1.log
  DISTILL_JSONS="$DISTILL_JSONS --distill $L/distill_b1.json"
fi
fi

# 3. calibrate W8 through the verb on the saved folder
if want calibrate; then
wait $BUILD; BUILD_RC=1 BUILD_S=0; [ -f $L/build.rc ] && read BUILD_RC BUILD_S < $L/build.rc; meta build_exit $BUILD_RC; meta build_wall_s $BUILD_S
tail -1 $L/build.log
if [ "$BUILD_RC" = 0 ]; then
  TIMEV=""; [ -x /usr/bin/time ] && TIMEV="/usr/bin/time -v -o $L/time_v.txt"
  ( command -v nvidia-smi >/dev/null && exec nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 ) \
    > $L/calibrate.smi 2>/dev/null < /dev/null & SMI=$!
  meta calibrate_command "\"pocketdiff calibrate --config $CAL_CONFIG --output RUN model.pretrained=FOLDER recon.iters=$CAL_ITERS $CAL_EXTRA\""
  step calibrate $(( $(left) - 25 )) $TIMEV $PY -m pocketdiff calibrate --config $REPO/$CAL_CONFIG --output $L/cal \
    model.pretrained=$L/sdxl recon.iters=$CAL_ITERS $CAL_EXTRA
  if grep -q "is below what the run needs" $L/calibrate.log; then  # refused before loading: the predicted need is over the
    grep -o "host_cap_gib=.*" $L/calibrate.log | head -1                     # 48 GiB cap; measure it anyway, under 64
    meta calibrate_refused_at_cap "\"$(grep -o 'host_cap_gib=.*' $L/calibrate.log | head -1 | tr -d '\"')\""
    rm -rf $L/cal; mv $L/calibrate.log $L/calibrate_refused.log
    step calibrate $(( $(left) - 25 )) $TIMEV $PY -m pocketdiff calibrate --config $REPO/$CAL_CONFIG --output $L/cal \
      model.pretrained=$L/sdxl recon.iters=$CAL_ITERS $CAL_EXTRA host_cap_gib=64
  fi
  kill $SMI 2>/dev/null
  tail -2 $L/calibrate.log
else
  tail -5 $L/build.log
fi
fi

# 4. rows, logs, clean-up
CAL_ARGS=""; want calibrate && CAL_ARGS="--calibrate $L/cal --time-v $L/time_v.txt --smi $L/calibrate.smi --out-calibrate $OUT/sdxl_calibrate${TAG}_$GPU.json"
$PY $REPO/benchmarks/sdxl_size.py summary $DISTILL_JSONS $CAL_ARGS --meta $META --out-distill $OUT/sdxl_distill_step${TAG}_$GPU.json
cp $L/sdxl.json $OUT/sdxl_folder${TAG}_$GPU.json 2>/dev/null
tar czf $OUT/sdxl_size${TAG}_logs.tgz -C $L --exclude=sdxl --exclude=cal/pipeline --exclude='*.safetensors' --exclude='*.pt' . 2>/dev/null
rm -rf $L
echo "[$(date +%T)] done in $((SECONDS - T0)) s"
