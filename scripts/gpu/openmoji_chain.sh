#!/usr/bin/env bash
# The OpenMoji chain on a 4-GPU machine, resumable across 10-minute calls: run it again and
# every stage continues where it stopped (--resume latest; finished stages are skipped).
#   bash scripts/gpu/openmoji_chain.sh     (repo root; carry .whl .devdata .carry)
# Needs the stage-1 teacher (carried fp16 as .carry/teacher16, or left in /tmp/runs by a warm
# machine) and trains the OpenMoji CLIP when it is not there yet. The recipes are the repo's
# OpenMoji configs with the shorter schedules below; the evaluations are the repo's
# configs/calibrate/evaluate_openmoji.yaml and each verb's own FD / CLIP score.
# A watchdog packs $OUT/chain.tgz (reports, logs, grids) before the call's limit.
set -u
source scripts/gpu/env.sh
T0=$(date +%s); DEADLINE=${DEADLINE:-530}
L=$RUNS/chain && mkdir -p $L outputs; C=$REPO/configs
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
done_() { [ -f outputs/$1/report.json ] || { [ $1 = clip-openmoji ] && [ -f outputs/clip-openmoji/clip/config.json ]; }; }
wait_for() { while ! done_ "$1" && [ "$(left)" -gt 0 ]; do sleep 5; done; done_ "$1"; }
run() {  # run GPU LOG VERB ARGS...: one verb on one GPU, stopped at the deadline (timeout 0 would mean none)
  local gpu=$1 name=$2 t; shift 2; t=$(left); [ "$t" -gt 0 ] || return 1
  CUDA_VISIBLE_DEVICES=$gpu timeout "$t" python3 -m pocketdiff "$@" >> $L/$name.log 2>&1
}

if [ ! -d outputs/teacher-openmoji/pipeline ]; then
  python3 -c "
import torch; from pocketdiff.models import load_pipeline, save_pipeline
save_pipeline(load_pipeline('$REPO/.carry/teacher16'), 'outputs/teacher-openmoji/pipeline')" > $L/restore.log 2>&1 || { cat $L/restore.log; exit 1; }
fi
if [ ! -d outputs/clip-openmoji/clip ] && [ -d $REPO/.carry/clip-openmoji ]; then  # a carried CLIP (when it fits the 64 MiB)
  mkdir -p outputs/clip-openmoji && cp -r $REPO/.carry/clip-openmoji outputs/clip-openmoji/clip
fi
DISTILL="guided.train.max_steps=600 progressive.final_steps=4 progressive.round_max_steps=[600,600,600,700] eval.num_images=1024 eval.metric_seeds=[0]"
(  # GPU3: the CLIP every FD needs
  done_ clip-openmoji || run 3 clip train-clip --config $C/clip/openmoji.yaml --output outputs/clip-openmoji --overwrite save_dtype=float16
) &
(  # GPU0: W8 of the teacher while the CLIP trains, distillation (its rounds are evaluated by distill
   # itself, with the CLIP), then W8 / W4 of the 4-step student
  done_ calib-openmoji-w8 || run 0 calib-w8 calibrate --config $C/calibrate/openmoji_w8.yaml --output outputs/calib-openmoji-w8 --resume latest
  wait_for clip-openmoji && { done_ distill-openmoji || run 0 distill distill --config $C/distill/openmoji.yaml --output outputs/distill-openmoji --resume latest $DISTILL; }
  for b in 8 4; do done_ distill-openmoji && { done_ calib-student4-w$b || run 0 calib-student4-w$b calibrate --config $C/calibrate/openmoji_student_w$b.yaml --output outputs/calib-student4-w$b --resume latest; }; done
) &
(  # GPU1: W4 of the teacher, then the FD of every quantized model (configs/calibrate/evaluate_openmoji.yaml)
  done_ calib-openmoji-w4 || run 1 calib-w4 calibrate --config $C/calibrate/openmoji_w4.yaml --output outputs/calib-openmoji-w4 --resume latest
  wait_for calib-student4-w4 && wait_for clip-openmoji && { done_ eval-calib || run 1 eval-calib evaluate --config $C/calibrate/evaluate_openmoji.yaml --output outputs/eval-calib --overwrite 'prompts.from_reference=1024' 'seeds=[0]'; }
) &
(  # GPU2: 30 % pruning + recovery; its FD before / after / after recovery needs the CLIP at the end
  wait_for clip-openmoji && { done_ prune-openmoji || run 2 prune prune --config $C/prune/openmoji.yaml --output outputs/prune-openmoji --resume latest train.max_steps=2000 eval.num_samples=1024 'eval.seeds=[0]'; }
) &
while [ -n "$(jobs -r)" ] && [ "$(left)" -gt 0 ]; do sleep 5; done
pkill -f "python3 -m pocketdiff"; sleep 2
for d in $(ls outputs); do [ -f outputs/$d/report.json ] && reports outputs/$d $L/$d.tgz; done
tar czf $OUT/chain.tgz -C $RUNS chain
echo "finished: $(cd outputs && for d in *; do [ -f $d/report.json ] && printf '%s ' $d; done)"
echo "chain call done after $(( $(date +%s) - T0 )) s (run again to continue)"
