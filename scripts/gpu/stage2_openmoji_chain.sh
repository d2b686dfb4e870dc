#!/usr/bin/env bash
# GPU session, stage 2 (a 4-GPU machine, one 10-minute call): the OpenMoji chain on the
# teacher of stage 1 (carried as .carry/teacher16, fp16): distillation 64 -> 4 steps,
# W8 / W4 calibration, 30 % pruning with recovery, their FD / CLIP score against the teacher,
# the OpenMoji CLIP (same recipe and seed as stage 1), and the 1-GPU vs 2-GPU check.
#   bash scripts/gpu/stage2_openmoji_chain.sh      (repo root; carry .whl .devdata .carry)
# The configs are the repo's OpenMoji recipes with shorter schedules (dotted overrides below).
set -u
source scripts/gpu/env.sh
T0=$(date +%s)
L=$RUNS/stage2 && mkdir -p $L outputs
python3 -c "
import torch; from pocketdiff.models import load_pipeline, save_pipeline
save_pipeline(load_pipeline('$REPO/.carry/teacher16', torch_dtype=torch.float32), 'outputs/teacher-openmoji/pipeline')
" > $L/restore.log 2>&1 || { cat $L/restore.log; exit 1; }
CLIP=outputs/clip-openmoji/clip
wait_clip() { while [ ! -f outputs/clip-openmoji/report.json ] && [ $(( $(date +%s) - T0 )) -lt 420 ]; do sleep 5; done; }
C=$REPO/configs

# GPU3: the OpenMoji CLIP, its retrieval, then the SD-2.1 calibration timing with what is left
(
  CUDA_VISIBLE_DEVICES=3 timeout 330 python3 -m pocketdiff train-clip --config $C/clip/openmoji.yaml --output outputs/clip-openmoji save_dtype=float16 > $L/clip.log 2>&1
  CUDA_VISIBLE_DEVICES=3 timeout 60 python3 $REPO/benchmarks/clip_retrieval.py --clip $CLIP --out $L/retrieval_openmoji.json --device cuda >> $L/clip.log 2>&1
  left=$(( 560 - ($(date +%s) - T0) ))
  [ $left -gt 60 ] && CUDA_VISIBLE_DEVICES=3 timeout $left python3 $REPO/benchmarks/calibrate_sd21.py --out $L/calibrate_sd21_timing.json --no-sweep --iters 250,500,1000 > $L/calibrate_sd21.log 2>&1
) &

# GPU0: distillation 64 -> 4 (guided + 4 progressive rounds), then FD of the students vs the teacher's DDIM
(
  CUDA_VISIBLE_DEVICES=0 timeout 450 python3 -m pocketdiff distill --config $C/distill/openmoji.yaml --output outputs/distill-openmoji \
    guided.train.max_steps=600 progressive.final_steps=4 'progressive.round_max_steps=[600,600,600,700]' eval.metrics=false max_time_s=400 > $L/distill.log 2>&1
  wait_clip
  cat > $L/eval_distill.yaml <<YAML
models:
  - {name: teacher DDIM, path: outputs/teacher-openmoji/pipeline, steps: [4, 8, 64]}
  - {name: student-8, path: outputs/distill-openmoji/round-3}
  - {name: student-4, path: outputs/distill-openmoji/round-4}
reference: {source: openmoji, resolution: 64}
prompts: {from_reference: 1024}
metrics: {features: clip, clip: $CLIP}
seeds: [0]
guidance_scale: 3.0
batch_size: 128
device: auto
YAML
  CUDA_VISIBLE_DEVICES=0 timeout $(( 575 - ($(date +%s) - T0) )) python3 -m pocketdiff evaluate --config $L/eval_distill.yaml --output outputs/eval-distill > $L/eval_distill.log 2>&1
) &

# GPU1 + GPU2: 2-GPU vs 1-GPU distillation check (shapes teacher, same global batch)
DDP="--config $C/distill/shapes.yaml guided.train.max_steps=300 guided.train.log_every=10 progressive.start_steps=8
  progressive.final_steps=4 progressive.train.max_steps=300 progressive.train.log_every=10 eval.enabled=false data.shapes_count=4096"
CUDA_VISIBLE_DEVICES=1,2 timeout 120 python3 -m accelerate.commands.launch --num_machines 1 --dynamo_backend no --mixed_precision bf16 \
  --num_processes 2 --main_process_port 29511 -m pocketdiff distill $DDP --output ddp-2gpu > $L/ddp-2gpu.log 2>&1

# GPU2: 30 % pruning (Taylor) + recovery, its FD before / after / after recovery (at the end, when the CLIP exists)
CUDA_VISIBLE_DEVICES=2 timeout $(( 575 - ($(date +%s) - T0) )) python3 -m pocketdiff prune --config $C/prune/openmoji.yaml --output outputs/prune-openmoji \
  train.max_steps=2000 eval.num_samples=1024 'eval.seeds=[0]' > $L/prune.log 2>&1 &

# GPU1: the 1-GPU run, then W8 and W4 calibration of the teacher, then their FD
(
  CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m pocketdiff distill $DDP --output ddp-1gpu > $L/ddp-1gpu.log 2>&1
  python3 $REPO/benchmarks/distill_ddp_check.py --a ddp-1gpu --b ddp-2gpu --out $L/ddp_check.json > $L/ddp_check.log 2>&1
  for b in 8 4; do
    CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pocketdiff calibrate --config $C/calibrate/openmoji_w$b.yaml --output outputs/calib-openmoji-w$b > $L/calib-w$b.log 2>&1
  done
  wait_clip
  cat > $L/eval_calib.yaml <<YAML
models:
  - {name: teacher float, path: outputs/teacher-openmoji/pipeline}
  - {name: W8 RTN, path: outputs/calib-openmoji-w8/rtn/pipeline}
  - {name: W8 recon, path: outputs/calib-openmoji-w8/pipeline}
  - {name: W4 RTN, path: outputs/calib-openmoji-w4/rtn/pipeline}
  - {name: W4 recon, path: outputs/calib-openmoji-w4/pipeline}
reference: {source: openmoji, resolution: 64}
prompts: {from_reference: 1024}
metrics: {features: clip, clip: $CLIP}
steps: [25]
seeds: [0]
guidance_scale: 3.0
batch_size: 128
device: auto
YAML
  CUDA_VISIBLE_DEVICES=1 timeout $(( 575 - ($(date +%s) - T0) )) python3 -m pocketdiff evaluate --config $L/eval_calib.yaml --output outputs/eval-calib > $L/eval_calib.log 2>&1
) &
wait
echo "all jobs done after $(( $(date +%s) - T0 )) s"
for d in distill-openmoji prune-openmoji calib-openmoji-w8 calib-openmoji-w4 eval-distill eval-calib clip-openmoji; do
  [ -d outputs/$d ] && tar czf $L/$d.tgz -C outputs/$d --exclude=checkpoints --exclude=pipeline --exclude='round-*' --exclude=clip --exclude=cache \
    --exclude='*.safetensors' --exclude=rtn .
done
for d in ddp-1gpu ddp-2gpu; do [ -d $d ] && tar czf $L/$d.tgz -C $d --exclude=checkpoints --exclude='round-*' --exclude=cache . ; done
du -sh outputs/* > $L/sizes.txt 2>&1
tar czf $OUT/stage2.tgz -C $RUNS stage2
ls -la $OUT; cat $L/sizes.txt
echo "stage 2 done after $(( $(date +%s) - T0 )) s"
