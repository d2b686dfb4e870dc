#!/usr/bin/env bash
# N GPUs of one host (NGPU=2 default; 4 on a four-GPU machine; <= 9 min), repo root, .whl/ carried:
#   bash scripts/gpu/sd21_distill_ngpu.sh            NGPU=4 bash scripts/gpu/sd21_distill_ngpu.sh
# The SD-2.1 distill smoke (configs/sd21/distill_smoke.yaml, eval off) through the verb on one GPU
# at batch B, then under `accelerate launch --num_processes N` at global batch N*B (weak scaling:
# B per GPU); then resume of the N-GPU run's last round from its first checkpoint on ONE GPU, and of
# that 1-GPU run's first checkpoint back on N (hardlinked copies of the run folder, the last
# round's folder and later checkpoints removed). -> $OUT/$NAME.json (weak-scaling
# efficiency per round, loss trajectories of the resumed rounds next to the uninterrupted one).
# Settings by environment: NGPU=2 BUDGET=530 RUN_S=240 (per training run) RESUME_S=160 (per resumed run) ARCH=sd21 RES=512 BATCH=16 (per GPU: the recipe's; 8 is host-bound, README) PY=python3 SKIP_ENV=1 EXTRA=
#   BENCH_VARIANTS=ours_guided,ours_wcond (benchmarks/distill_step.py at batch B on GPU 0 alone first: the
#   1-GPU run's verb/bench ratio; empty: none) RESUMES=1 (0: no resume runs, the speed figures only; to_one: N -> 1 only)
#   ALT_TWO=NAME:overrides,... (more N-GPU runs with overrides joined by ';', e.g. bf16:progressive.train.ddp_comm_hook=bf16:
#   each one's weak-scaling efficiency against the same 1-GPU run) WINDOWS=A:B,... (the rates over the log windows A < step <= B) LATE=5,10 (the rates over the log windows past these
#   steps too: the N-GPU run's steps 3-5 are still warming up). With progressive.train.profile_steps=N in EXTRA, the last
#   round's traces come back as $OUT/${NAME}_trace_<run>_<round>-rank<r>.json.gz (1-GPU rank 0, 2-GPU ranks 0 and 1, each
#   ALT_TWO run's rank 0; ~6 MB each): python benchmarks/trace_summary.py on them
set -u
T0=$SECONDS; BUDGET=${BUDGET:-530}
left() { echo $(( BUDGET - (SECONDS - T0) )); }
if [ -z "${SKIP_ENV:-}" ]; then source scripts/gpu/env.sh; else REPO=$PWD; RUNS=${RUNS:-/tmp/runs}; mkdir -p $RUNS; cd $RUNS || exit 1; fi
NGPU=${NGPU:-2} PY=${PY:-python3} ARCH=${ARCH:-sd21} RES=${RES:-512} BATCH=${BATCH:-16} EXTRA=${EXTRA:-}
RUN_S=${RUN_S:-240}  # watchdog of each training run (a 70-step round on one H100 took 194 s)
RESUME_S=${RESUME_S:-160}  # watchdog of each resumed run (loading, the rest of the round, writing its folder)
NAME=${NAME:-distill_sd21_${NGPU}gpu}
ALT_TWO=${ALT_TWO:-} LATE=${LATE:-5,10} WINDOWS=${WINDOWS:-}
OUT=${OUT:-$RUNS/out}; mkdir -p $OUT
L=$RUNS/sd21-${NGPU}gpu && TEACHER=$RUNS/sd21-teacher-$ARCH-$RES && rm -rf $L && mkdir -p $L || exit 1
step() {  # step NAME SECONDS CMD...: with a watchdog (at most what is left)
  local name=$1 want=$2 t; shift 2; t=$(left); [ "$t" -gt "$want" ] && t=$want
  if [ "$t" -lt 20 ]; then echo "[$(date +%T)] skip $name: ${t} s left"; return 1; fi
  echo "[$(date +%T)] $name (watchdog ${t} s)"; local s=$SECONDS
  timeout -k 10 "$t" "$@" > $L/$name.log 2>&1; local rc=$?
  echo "[$(date +%T)] $name exit $rc in $((SECONDS - s)) s"; [ $rc -eq 0 ] || tail -4 $L/$name.log
  return $rc
}
# an array, not a shell function: `timeout` (in step) runs programs only
LAUNCH2=($PY -m accelerate.commands.launch --num_machines 1 --num_processes $NGPU --dynamo_backend no -m pocketdiff)
C="--config $REPO/configs/sd21/distill_smoke.yaml model.pretrained=$TEACHER data.resolution=$RES eval.enabled=false
  keep_round_checkpoints=true guided.train.checkpoint_every=3 progressive.train.checkpoint_every=3
  guided.train.checkpoints_total_limit=3 progressive.train.checkpoints_total_limit=3 $EXTRA"
b2="guided.train.batch_size=$((NGPU * BATCH)) progressive.train.batch_size=$((NGPU * BATCH))"
b1="guided.train.batch_size=$BATCH progressive.train.batch_size=$BATCH"

step teacher 150 $PY $REPO/benchmarks/distill_sd21.py teacher $TEACHER --arch $ARCH --resolution $RES || exit 1
# the benchmark's matching variants at batch B on GPU 0 alone, right before the 1-GPU run (BENCH_VARIANTS= skips it)
BENCH_VARIANTS=${BENCH_VARIANTS-ours_guided,ours_wcond}
if [ -n "$BENCH_VARIANTS" ]; then
  (cd $REPO/benchmarks && CUDA_VISIBLE_DEVICES=0 step bench 150 $PY distill_step.py --out $L/bench.json --arch $ARCH --latent $((RES / 8)) \
    --variants $BENCH_VARIANTS --compile off --grad-ckpt --optimizer adamw8bit --optimizer-lib bitsandbytes --memory-cap-gib 24 \
    --batches $BATCH --iters 6 --warmup 2)
fi
CUDA_VISIBLE_DEVICES=0 step one $RUN_S $PY -m pocketdiff distill --output $L/one $C $b1
step two $RUN_S "${LAUNCH2[@]}" distill --output $L/two $C $b2
ALT=()
for spec in ${ALT_TWO//,/ }; do
  n=${spec%%:*}; o=${spec#*:}
  step two_$n $RUN_S "${LAUNCH2[@]}" distill --output $L/two_$n $C $b2 ${o//;/ } && ALT+=(--alt "$n=$L/two_$n")
done
# resume the N-GPU run's last round on one GPU (its global batch N*B now on one process: no cap)
last=$(ls -d $L/two/round-* 2>/dev/null | sort -V | tail -1)
if [ -n "$last" ] && [ "${RESUMES:-1}" != 0 ]; then
  r=$(basename $last)
  # keep only the round's first checkpoint (and the earlier rounds'): --resume latest then restarts mid-round
  keep_first() { ls -d $1/checkpoints/$r/checkpoint-* 2>/dev/null | sort -V | tail -n +2 | xargs -r rm -rf; rm -rf $1/$r; }
  # a hardlinked copy of run $1 as $2 whose small files (logs.jsonl: appended in place) are real copies, so the
  # resumed run cannot write into the uninterrupted run's files; no report.json until the resumed run writes its own
  fork_run() { cp -al $1 $2 && find $2 -type f -size -64M -exec sh -c 'cp -p "$0" "$0.c" && mv "$0.c" "$0"' {} \; && rm -f $2/report.json && keep_first $2; }
  fork_run $L/two $L/two_to_one
  CUDA_VISIBLE_DEVICES=0 step two_to_one $RESUME_S $PY -m pocketdiff distill --output $L/two_to_one --resume latest $C $b2 \
    guided.train.memory_cap_gib=null progressive.train.memory_cap_gib=null
  if [ "${RESUMES:-1}" != to_one ]; then
    fork_run $L/two_to_one $L/one_to_two
    step one_to_two $RESUME_S "${LAUNCH2[@]}" distill --output $L/one_to_two --resume latest $C $b2 \
      guided.train.memory_cap_gib=null progressive.train.memory_cap_gib=null
  fi
fi
$PY $REPO/benchmarks/distill_sd21.py scaling --out $OUT/$NAME.json \
  --one $L/one --multi $L/two --resumed $L/two_to_one --resumed $L/one_to_two --bench $L/bench.json --batch $BATCH "${ALT[@]}" $(for a in ${LATE//,/ }; do echo --late $a; done) $(for w in ${WINDOWS//,/ }; do echo --window $w; done)
# profiler traces (train.profile_steps in EXTRA) come back on their own: the last round's, one per run and rank
if [ -n "$last" ]; then
  r=$(basename $last)
  for t in one/profile/$r-rank0 two/profile/$r-rank0 two/profile/$r-rank1 $(for a in ${ALT_TWO//,/ }; do echo two_${a%%:*}/profile/$r-rank0; done); do
    [ -f $L/$t.json.gz ] && cp $L/$t.json.gz $OUT/${NAME}_trace_${t%%/*}_${t##*/}.json.gz
  done
fi
tar czf $OUT/${NAME}_logs.tgz -C $L --exclude='*.safetensors' --exclude='*.pt' --exclude='*.json.gz' --exclude=cache . 2>/dev/null
rm -rf $L
echo "[$(date +%T)] done in $((SECONDS - T0)) s"
