#!/usr/bin/env bash
# Every verb's smoke recipe on a CUDA machine, in about two minutes: run this first in a GPU
# session, before the long jobs, to catch CUDA-only faults (a metric left on the CPU, a
# launcher quirk) while they still cost seconds. Repo root, with .whl/ carried.
#   bash scripts/gpu/smoke.sh        -> $OUT/smoke.tgz (logs) and a pass/fail line per verb
set -u
source scripts/gpu/env.sh
S=$REPO/configs/smoke L=$RUNS/smoke && rm -rf $L && mkdir -p $L && cd $L || exit 1
status=0
check() { local name=$1; shift; if timeout 300 "$@" > $name.log 2>&1; then echo "ok   $name"; else echo "FAIL $name (tail of $name.log:)"; tail -5 $name.log; status=1; fi; }
check teacher  python3 -m pocketdiff train-teacher --config $S/train-teacher.yaml --output teacher train.compile_mode=default
check distill  python3 -m pocketdiff distill --config $S/distill.yaml --output distill
if [ "$(python3 -c "import torch; print(torch.cuda.device_count())")" -ge 2 ]; then  # honours CUDA_VISIBLE_DEVICES
  check distill-2gpu python3 -m accelerate.commands.launch --num_machines 1 --num_processes 2 --dynamo_backend no \
    -m pocketdiff distill --config $S/distill.yaml --output distill-2gpu
fi
check calibrate python3 -m pocketdiff calibrate --config $S/calibrate.yaml --output calibrate device=auto
check prune    python3 -m pocketdiff prune --config $S/prune.yaml --output prune
check evaluate python3 -m pocketdiff evaluate --config $S/evaluate.yaml --output evaluate device=cuda
check clip     python3 -m pocketdiff train-clip --config $REPO/configs/clip/shapes.yaml --output clip train.steps=20 device=cuda
tar czf $OUT/smoke.tgz -C $L .
exit $status
