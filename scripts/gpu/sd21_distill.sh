#!/usr/bin/env bash
# SD-2.1 size through the verbs in ONE call (one H100, <= 9 min), repo root, .whl/ carried:
#   (adamw8bit needs bitsandbytes, which the GPU image lacks and whose 43 MB wheel does not fit beside the repo:
#   carry .whl/bitsandbytes_slim.tar.xz, the wheel's files with only its libbitsandbytes_cuda128/130/132.so, 10 MB;
#   env.sh unpacks any .whl/*.tar.xz. A warm machine that already installed the wheels needs REINSTALL=1.)
#   bash scripts/gpu/sd21_distill.sh
# 1. an SD-2.1-size pipeline with random weights, saved once as a diffusers folder (the teacher)
# 2. `pocketdiff distill` with configs/sd21/distill_smoke.yaml (guided stage + rounds 8 -> 4 -> 2,
#    6 steps each, batch 8, under a 24 GiB cap: gradient checkpointing, bf16 teacher, 8-bit AdamW,
#    EMA on the CPU), its disk use sampled every 2 s
# 3. benchmarks/distill_step.py's matching variants (ours_guided, ours_wcond: same batch, cap,
#    optimizer, checkpointing, no compile) at batch 8, then 16, 24, 32 until one runs out of the
#    cap (the largest batch per 24 GiB); then the trainer's default settings without a cap
# 4. `pocketdiff prune` with configs/sd21/prune_smoke.yaml on the same teacher (30 %, internal)
# 5. benchmarks/distill_sd21.py summary -> $OUT/$NAME.json (copy it into benchmarks/results/ here), logs in
#    $OUT/sd21_distill_logs.tgz; the runs are deleted at the end (the teacher stays for a warm rerun)
# Settings by environment: BUDGET=530 ARCH=sd21 RES=512 LATENT=RES/8 BATCH=8 CAP=24 SWEEP=8,16,24,32
#   NAME=distill_sd21 (also names the run folder: two copies may run side by side) BENCH_S=150 (bench watchdog) BENCH_VARIANTS=ours_guided,ours_wcond BENCH_OPT=adamw8bit BENCH_LIB=bitsandbytes PY=python3 EXTRA_DISTILL= EXTRA_PRUNE= (key=value overrides)
#   VSWEEP=16,24,32 (batches tried through the verb, ascending, until one fails)
#   PARTS=distill,bench,prune,vsweep,default (which of steps 2-4 run; e.g. PARTS=prune on a second GPU call; also: ablate)
#   ABLATE=smoke:,noema:progressive.train.ema_decay=0 (PARTS=ablate: NAME:overrides, overrides joined by ';'; one progressive
#     round 8 -> 4 each at batch $BATCH, 8 steps, no checkpoint: which setting costs the verb its speed against the bench)
#   DISTILL_CONFIG=configs/sd21/distill_smoke.yaml (step 2's recipe; configs/sd21/distill.yaml with EXTRA_DISTILL="data.source=shapes
#     guided.train.max_steps=4 ..." runs the whole recipe's rounds and checkpoint rotation in a few steps each: its peak disk)
#   DISTILL_CONFIG=configs/sd21/distill_lcm_smoke.yaml: a recipe with `method: consistency` (read from the file) gets BATCH and CAP in
#     its consistency.train section, BENCH_VARIANTS=ours_lcm (the consistency step) and PARTS=distill,bench by default (prune,
#     vsweep, default and ablate are the progressive smoke's)
#   SKIP_ENV=1: no env.sh (a CPU dry run of the logic with tiny settings, see README "SD-2.1 size")
set -u
T0=$SECONDS; BUDGET=${BUDGET:-530}
left() { echo $(( BUDGET - (SECONDS - T0) )); }
if [ -z "${SKIP_ENV:-}" ]; then source scripts/gpu/env.sh; else REPO=$PWD; RUNS=${RUNS:-/tmp/runs}; mkdir -p $RUNS; cd $RUNS || exit 1; fi
PY=${PY:-python3} ARCH=${ARCH:-sd21} RES=${RES:-512} BATCH=${BATCH:-8} CAP=${CAP:-24} SWEEP=${SWEEP:-8,16,24,32} VSWEEP=${VSWEEP:-16,24,32}
NAME=${NAME:-distill_sd21} LATENT=${LATENT:-$((RES / 8))} BENCH_OPT=${BENCH_OPT:-adamw8bit} BENCH_LIB=${BENCH_LIB:-bitsandbytes}
DISTILL_CONFIG=${DISTILL_CONFIG:-configs/sd21/distill_smoke.yaml}
if grep -q '^method: *consistency' $REPO/$DISTILL_CONFIG; then  # one consistency stage, its own train section and bench variant
  STAGES=consistency; BENCH_VARIANTS=${BENCH_VARIANTS:-ours_lcm}; PARTS=${PARTS:-distill,bench}
else
  STAGES="guided progressive"; BENCH_VARIANTS=${BENCH_VARIANTS:-ours_guided,ours_wcond}
fi
EXTRA_DISTILL=${EXTRA_DISTILL:-} EXTRA_PRUNE=${EXTRA_PRUNE:-} PARTS=${PARTS:-distill,bench,prune,vsweep,default}  # more key=value overrides per verb (CPU dry runs)
STAGE_OVR=$(for s in $STAGES; do echo -n "$s.train.batch_size=$BATCH $s.train.memory_cap_gib=$CAP "; done)  # step 2's batch and cap
OUT=${OUT:-$RUNS/out}; mkdir -p $OUT
L=$RUNS/sd21-$NAME && TEACHER=$RUNS/sd21-teacher-$ARCH-$RES && rm -rf $L && mkdir -p $L || exit 1
META=$L/meta.json; echo "{}" > $META
meta() { $PY - "$META" "$1" "$2" <<'EOF'
import json, sys
p, k, v = sys.argv[1:]
d = json.load(open(p)); d[k] = json.loads(v); json.dump(d, open(p, "w"), indent=1)
EOF
}
gpu_peak() { local v; v=$(sort -n $L/$1.smi 2>/dev/null | tail -1); echo ${v:-null}; }
# samplers in the background, every stream redirected (a $(...) caller would otherwise wait for them)
watch_gpu() { ( command -v nvidia-smi >/dev/null && exec nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 ) \
  > $L/$1.smi 2>/dev/null < /dev/null & echo $!; }
watch_disk() { ( while true; do du -sb $1 2>/dev/null | cut -f1; sleep 2; done ) > $L/$2.du 2>/dev/null < /dev/null & echo $!; }
want() { [[ ",$PARTS," == *",$1,"* ]]; }
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

# 1. the teacher (kept in $RUNS while the machine stays warm)
step teacher 150 $PY $REPO/benchmarks/distill_sd21.py teacher $TEACHER --arch $ARCH --resolution $RES || exit 1
meta teacher_bytes $(du -sb $TEACHER | cut -f1)

# 2. distill through the verb, disk and GPU memory sampled
if want distill; then
w1=$(watch_disk $L/distill distill); g1=$(watch_gpu distill)
step distill ${DISTILL_S:-270} $PY -m pocketdiff distill --config $REPO/$DISTILL_CONFIG --output $L/distill \
  model.pretrained=$TEACHER data.resolution=$RES $STAGE_OVR $EXTRA_DISTILL
kill $w1 $g1 2>/dev/null
v=$(sort -n $L/distill.du 2>/dev/null | tail -1); meta distill_peak_disk_bytes "${v:-null}"; meta distill_nvidia_smi_peak_mib "$(gpu_peak distill)"
fi

# 3. the benchmark's matching variants and the batch sweep under the same cap; then the defaults without a cap
if want bench; then
(cd $REPO/benchmarks && step bench ${BENCH_S:-150} $PY distill_step.py --out $L/bench.json --arch $ARCH --latent $LATENT \
  --variants $BENCH_VARIANTS --compile off --grad-ckpt --optimizer $BENCH_OPT --optimizer-lib $BENCH_LIB --memory-cap-gib $CAP \
  --batches $SWEEP --iters 4 --warmup 2)
fi
# 3a. ablations through the verb at the distill run's batch
if want ablate; then
ABLATE=${ABLATE:-smoke:,noema:progressive.train.ema_decay=0,gpuema:progressive.train.ema_device=auto}
for spec in ${ABLATE//,/ }; do
  n=${spec%%:*}; o=${spec#*:}
  step ablate_$n 120 $PY -m pocketdiff distill --config $REPO/configs/sd21/distill_smoke.yaml --output $L/ablate_$n \
    model.pretrained=$TEACHER data.resolution=$RES guided.enabled=false progressive.final_steps=4 progressive.train.max_steps=8 \
    progressive.train.checkpoint_every=100 progressive.train.batch_size=$BATCH guided.train.memory_cap_gib=$CAP progressive.train.memory_cap_gib=$CAP eval.enabled=false $EXTRA_DISTILL ${o//;/ }
done
fi
# 3b. prune through the verb on the same teacher
if want prune; then
g2=$(watch_gpu prune)
step prune 150 $PY -m pocketdiff prune --config $REPO/configs/sd21/prune_smoke.yaml --output $L/prune \
  model.pretrained=$TEACHER data.resolution=$RES train.memory_cap_gib=$CAP $EXTRA_PRUNE
kill $g2 2>/dev/null; meta prune_nvidia_smi_peak_mib "$(gpu_peak prune)"
fi

# 3c. the trainer's default settings (AdamW, no checkpointing), no cap: the peak on an 80 GB card
if want default; then
(cd $REPO/benchmarks && step bench_default 120 $PY distill_step.py --out $L/bench_default.json --arch $ARCH --latent $LATENT \
  --variants ours_wcond --compile off --no-channels-last --batch 16 --iters 2 --warmup 1)
fi

# 3d. larger batches through the verb under the same cap: one progressive round (8 -> 4), 6 steps, no checkpoint
if want vsweep; then
for b in ${VSWEEP//,/ }; do
  step vsweep_$b 120 $PY -m pocketdiff distill --config $REPO/configs/sd21/distill_smoke.yaml --output $L/vsweep_$b \
    model.pretrained=$TEACHER data.resolution=$RES guided.enabled=false progressive.final_steps=4 progressive.train.max_steps=6 \
    progressive.train.checkpoint_every=100 progressive.train.batch_size=$b guided.train.memory_cap_gib=$CAP progressive.train.memory_cap_gib=$CAP eval.enabled=false \
    || break
done
fi
# 5. one JSON, logs, clean-up
$PY $REPO/benchmarks/distill_sd21.py summary --out $OUT/$NAME.json \
  $(want distill && echo --distill $L/distill) $(want prune && echo --prune $L/prune) --bench $L/bench.json --default-bench $L/bench_default.json --meta $META $(want vsweep && for b in ${VSWEEP//,/ }; do echo --vsweep $L/vsweep_$b; done) \
  $(want ablate && for spec in ${ABLATE//,/ }; do echo --ablate "$L/ablate_${spec%%:*}=${spec#*:}"; done)
tar czf $OUT/${NAME}_logs.tgz -C $L --exclude='*.safetensors' --exclude='*.pt' --exclude=cache . 2>/dev/null
rm -rf $L
echo "[$(date +%T)] done in $((SECONDS - T0)) s"
