#!/usr/bin/env bash
# GPU session, stage 3 (same warm machine as stage 2, /tmp/runs kept): finish what stage 2's
# 10 minutes cut: the OpenMoji CLIP, rounds 3-4 of the distillation (--resume latest), W4,
# prune's metrics (--resume latest), and the FD evaluations. A watchdog packs results at 530 s.
set -u
source scripts/gpu/env.sh
T0=$(date +%s); L=$RUNS/stage3 && mkdir -p $L; C=$REPO/configs; CLIP=outputs/clip-openmoji/clip
wait_clip() { while [ ! -f outputs/clip-openmoji/report.json ] && [ $(( $(date +%s) - T0 )) -lt 470 ]; do sleep 5; done; }
CUDA_VISIBLE_DEVICES=3 python3 -m pocketdiff train-clip --config $C/clip/openmoji.yaml --output outputs/clip-openmoji --overwrite save_dtype=float16 > $L/clip.log 2>&1 &
(
  CUDA_VISIBLE_DEVICES=0 python3 -m pocketdiff distill --config $C/distill/openmoji.yaml --output outputs/distill-openmoji --resume latest \
    guided.train.max_steps=600 progressive.final_steps=4 'progressive.round_max_steps=[600,600,600,700]' eval.metrics=false max_time_s=0 > $L/distill.log 2>&1
  wait_clip
  sed -e "s#outputs/distill-openmoji/round-3}#outputs/distill-openmoji/round-3}\n  - {name: student-16, path: outputs/distill-openmoji/round-2}#" stage2/eval_distill.yaml > $L/eval_distill.yaml
  CUDA_VISIBLE_DEVICES=0 python3 -m pocketdiff evaluate --config $L/eval_distill.yaml --output outputs/eval-distill --overwrite > $L/eval_distill.log 2>&1
) &
(
  CUDA_VISIBLE_DEVICES=1 python3 -m pocketdiff calibrate --config $C/calibrate/openmoji_w4.yaml --output outputs/calib-openmoji-w4 --overwrite > $L/calib-w4.log 2>&1
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
  CUDA_VISIBLE_DEVICES=1 python3 -m pocketdiff evaluate --config $L/eval_calib.yaml --output outputs/eval-calib --overwrite > $L/eval_calib.log 2>&1
) &
(
  wait_clip
  CUDA_VISIBLE_DEVICES=2 python3 -m pocketdiff prune --config $C/prune/openmoji.yaml --output outputs/prune-openmoji --resume latest \
    train.max_steps=2000 eval.num_samples=1024 'eval.seeds=[0]' > $L/prune.log 2>&1
) &
while [ $(( $(date +%s) - T0 )) -lt 530 ] && [ -n "$(jobs -r)" ]; do sleep 5; done
pkill -f "python3 -m pocketdiff" ; sleep 2
echo "packing after $(( $(date +%s) - T0 )) s"
for d in distill-openmoji prune-openmoji calib-openmoji-w8 calib-openmoji-w4 eval-distill eval-calib clip-openmoji; do
  [ -d outputs/$d ] && tar czf $L/$d.tgz -C outputs/$d --exclude=checkpoints --exclude=pipeline --exclude='round-*' --exclude=clip --exclude=cache --exclude='*.safetensors' --exclude=rtn . ; done
tar czf $OUT/stage3.tgz -C $RUNS stage3
[ -d outputs/distill-openmoji/round-4 ] && tar czf /tmp/student4.tgz -C outputs/distill-openmoji round-4 && split -b 15m /tmp/student4.tgz $OUT/student4.tgz.
[ -d outputs/clip-openmoji/clip ] && tar czf /tmp/clip.tgz -C outputs/clip-openmoji clip && split -b 15m /tmp/clip.tgz $OUT/clip.tgz.
ls -la $OUT
