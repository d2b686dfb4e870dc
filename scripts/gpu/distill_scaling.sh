#!/usr/bin/env bash
# Weak-scaling figure of the distillation step over 1, 2 and 4 GPUs (benchmarks/distill_scaling.py:
# SD-2.1-size UNet with random weights, the student DDP-wrapped by accelerate, bf16, batch 16 per
# GPU), on a 4-GPU machine, in one device call: each launch is stopped by a watchdog (its share
# of what is left of BUDGET seconds), then the per-N files are merged. Repo root, with .whl/ carried.
#   bash scripts/gpu/distill_scaling.sh
#     -> $OUT/distill_scaling_sd21.json (merged: samples/s, speedup, efficiency, all-reduce share)
#        $OUT/distill_scaling/ (the per-N JSON files and logs)
# Settings by environment: NS="1 2 4" ARCH=sd21 VARIANT=ours BATCH=16 ITERS=20 WARMUP=3
# COMPILE=1 (torch.compile: about 150 s more per launch, so fewer N fit) EXTRA="more args" BUDGET=540
set -u
T0=$SECONDS; BUDGET=${BUDGET:-540}
left() { echo $(( BUDGET - (SECONDS - T0) )); }
source scripts/gpu/env.sh
NS=${NS:-1 2 4} ARCH=${ARCH:-sd21} VARIANT=${VARIANT:-ours} BATCH=${BATCH:-16} ITERS=${ITERS:-20} WARMUP=${WARMUP:-3}
# per-N results stay in $L while the machine is warm: a later call with NS=4 merges them with its own
L=$RUNS/distill-scaling && mkdir -p $L $OUT/distill_scaling || exit 1
ngpu=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}  # NGPU: local dry runs
ncpu=$(nproc)
RESERVE=20  # seconds kept for the merge and the copies
ns=(); for n in $NS; do if [ "$n" -le "$ngpu" ]; then ns+=("$n"); else echo "skip N=$n: $ngpu GPUs visible"; fi; done
for i in "${!ns[@]}"; do
  n=${ns[$i]}; todo=$(( ${#ns[@]} - i ))
  t=$(( ($(left) - RESERVE) / todo ))  # the watchdog: this launch's share of what is left
  if [ "$t" -lt 30 ]; then echo "not starting N=$n: ${t} s would be left for it"; continue; fi
  f=$L/distill_scaling_${ARCH}_${n}gpu.json; rm -f $f
  echo "[$(date +%T)] N=$n on GPUs $(seq -s, 0 $((n - 1))), watchdog ${t} s"
  # torchrun would set OMP_NUM_THREADS=1: the UNet's CPU-side construction gets a share of the cores instead
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) OMP_NUM_THREADS=$(( ncpu / n > 16 ? 16 : ncpu / n )) \
    timeout -k 15 "$t" python3 -m accelerate.commands.launch --num_machines 1 --num_processes $n --dynamo_backend no \
      --main_process_port $((29500 + n)) $REPO/benchmarks/distill_scaling.py --out $f --arch $ARCH --variant $VARIANT \
      --batch $BATCH --iters $ITERS --warmup $WARMUP ${COMPILE:+--compile} ${EXTRA:-} > $L/n$n.log 2>&1
  rc=$?
  echo "[$(date +%T)] N=$n exit $rc$([ $rc -ge 124 ] && echo ' (watchdog)')"; grep "^\[distill_scaling" $L/n$n.log
  [ $rc -eq 0 ] || tail -5 $L/n$n.log
done
cp $L/*.json $L/*.log $OUT/distill_scaling/ 2>/dev/null
files=($L/distill_scaling_${ARCH}_*gpu.json)  # this call's and earlier calls' N
[ -f "${files[0]}" ] || { echo "no result"; exit 1; }
python3 $REPO/benchmarks/distill_scaling.py --merge "${files[@]}" --out $OUT/distill_scaling_${ARCH}.json 2>&1 | grep -v Warning
echo "[$(date +%T)] done in $((SECONDS - T0)) s"
