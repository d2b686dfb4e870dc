#!/usr/bin/env bash
# GPU session, stage 1 (a 4-GPU machine, one 10-minute call): the OpenMoji teacher (two
# variants side by side: torch.compile vs eager, the better one is kept), the OpenMoji CLIP,
# the 1-GPU vs 2-GPU distillation check, and the SD-2.1-size step / calibration benchmarks.
#   run from the repo root with .whl/ and .devdata/ carried: bash scripts/gpu/stage1_teacher_clip_benches.sh
# Results land in $OUT (JSON, logs, report folders, the kept teacher and the CLIP in fp16) and in
# /tmp/runs (kept while the machine stays warm; then scripts/gpu/openmoji_chain.sh continues).
set -u
source scripts/gpu/env.sh
T0=$(date +%s)
L=$RUNS/stage1 && mkdir -p $L  # logs and JSON, packed into one file at the end ($OUT takes 8 files)
TEACHER="--config $REPO/configs/teacher/openmoji.yaml train.batch_size=256 train.max_steps=30000 train.ema_decay=0.999
  train.checkpoint_every=1000 vae.steps=1500 vae.batch_size=128 vae.max_time_s=90 train.max_time_s=300"
CUDA_VISIBLE_DEVICES=0 timeout 500 python3 -m pocketdiff train-teacher $TEACHER --output teacher-compiled train.compile_mode=default > $L/teacher-compiled.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 500 python3 -m pocketdiff train-teacher $TEACHER --output teacher-eager > $L/teacher-eager.log 2>&1 &

DDP="--config $REPO/configs/distill/shapes.yaml guided.train.max_steps=300 guided.train.log_every=10 progressive.start_steps=8
  progressive.final_steps=4 progressive.train.max_steps=300 progressive.train.log_every=10 eval.enabled=false data.shapes_count=4096"
LAUNCH="python3 -m accelerate.commands.launch --num_machines 1 --dynamo_backend no --mixed_precision bf16"
(
  CUDA_VISIBLE_DEVICES=2,3 timeout 150 $LAUNCH --num_processes 2 --main_process_port 29511 -m pocketdiff distill $DDP --output ddp-2gpu > $L/ddp-2gpu.log 2>&1
  CUDA_VISIBLE_DEVICES=2 timeout 150 python3 -m pocketdiff distill $DDP --output ddp-1gpu > $L/ddp-1gpu.log 2>&1
  python3 $REPO/benchmarks/distill_ddp_check.py --a ddp-1gpu --b ddp-2gpu --out $L/ddp_check.json > $L/ddp_check.log 2>&1
  CUDA_VISIBLE_DEVICES=2 timeout 300 python3 -m pocketdiff train-clip --config $REPO/configs/clip/openmoji.yaml --output clip-openmoji save_dtype=fp16 > $L/clip.log 2>&1
  CUDA_VISIBLE_DEVICES=2 timeout 60 python3 $REPO/benchmarks/clip_retrieval.py --clip clip-openmoji/clip --out $L/retrieval_openmoji.json --device cuda >> $L/clip.log 2>&1
) &
(
  sleep 150  # after the 2-GPU run
  CUDA_VISIBLE_DEVICES=3 timeout 270 python3 $REPO/benchmarks/distill_step.py --out $L/distill_step_sd21.json --arch sd21 --device cuda > $L/distill_step.log 2>&1
  left=$(( 520 - ($(date +%s) - T0) ))
  [ $left -gt 60 ] && CUDA_VISIBLE_DEVICES=3 timeout $left python3 $REPO/benchmarks/calibrate_sd21.py --out $L/calibrate_sd21_timing.json --no-sweep --iters 250,500,1000 > $L/calibrate_sd21.log 2>&1
) &
wait
echo "all jobs done after $(( $(date +%s) - T0 )) s"
python3 - <<'PY'
import json, pathlib
best = None
for name in ("teacher-compiled", "teacher-eager"):
    r = pathlib.Path(name, "report.json")
    if r.is_file():
        rep = json.loads(r.read_text())
        print(name, "unet steps", rep["steps"], "final loss", rep["final_loss"], "vae", rep.get("vae", {}).get("steps"))
        if best is None or rep["steps"] > best[1]:
            best = (name, rep["steps"])
if best:
    pathlib.Path("teacher-openmoji").unlink(missing_ok=True)
    pathlib.Path("teacher-openmoji").symlink_to(best[0])
    print("kept", best[0])
PY
nvidia-smi --query-gpu=name,memory.used --format=csv > $L/gpus.csv
for d in teacher-compiled teacher-eager ddp-1gpu ddp-2gpu clip-openmoji; do [ -d $d ] && reports $d $L/$d-report.tgz; done
tar czf $OUT/stage1.tgz -C $RUNS stage1
# the kept teacher in fp16 (about 26 MB) and the CLIP (fp16), for use here and to carry if the machine goes cold
python3 -c "
from pocketdiff.models import load_pipeline; import torch
load_pipeline('teacher-openmoji/pipeline', torch_dtype=torch.float16).save_pretrained('/tmp/teacher16')
" && pack /tmp teacher16 teacher16
[ -d clip-openmoji/clip ] && pack clip-openmoji clip-openmoji clip
ls -la $OUT
echo "stage 1 done after $(( $(date +%s) - T0 )) s"
