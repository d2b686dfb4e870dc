#!/usr/bin/env bash
# The OpenMoji distillation with the recipe's full guided stage (configs/distill/openmoji.yaml:
# 6,000 steps; the earlier chains cut it to 600) and the chains' rounds (64 -> 2 steps), then its
# students at w 1, 3, 6 (evaluate_openmoji_guidance.yaml, evaluate_openmoji_guided_stage.yaml), on one
# GPU. About 29 min of training: the first call starts a detached lane that outlives the call while
# the machine stays warm; every call (this script again, promptly: a machine idle for 30 s is given
# back) waits for it until DEADLINE and packs the reports into $OUT/full-guided.tgz.
#   first call: carry .whl .devdata .carry/teacher16.tar.xz;  a later call: .carry/clip-openmoji
set -u
source scripts/gpu/env.sh
L=$RUNS/full-guided && mkdir -p $L outputs; C=$REPO/configs
source $REPO/scripts/gpu/chain_lib.sh
done_() {
  case $1 in
    clip-openmoji) [ -f outputs/clip-openmoji/clip/config.json ] ;;
    distill-openmoji) [ -f outputs/distill-openmoji/round-5/model_index.json ] ;;
    *) [ -f outputs/$1/report.json ] ;;
  esac
}
lane0() {
  done_ distill-openmoji || run 0 distill distill --config $C/distill/openmoji.yaml --output outputs/distill-openmoji \
    --resume latest $OPENMOJI_ROUNDS
  done_ distill-openmoji || return 1
  evaluate 0 eval-guided-stage evaluate_openmoji_guided_stage.yaml &  # two small-model evaluations share the GPU
  evaluate 0 eval-guidance evaluate_openmoji_guidance.yaml
  wait
}
[ "${1:-}" = lane ] && { lane_main $2; exit 0; }

T0=$(date +%s); DEADLINE=${DEADLINE:-520}  # the device's 600 s include env.sh's installs before T0
restore_teacher outputs/teacher-openmoji/pipeline || exit 1
restore_clip outputs/clip-openmoji/clip
export LANE_BUDGET=${LANE_BUDGET:-2700}
start_lanes scripts/gpu/full_guided_chain.sh 0
while [ "$(running 0)" -gt 0 ] && [ "$(left)" -gt 15 ]; do sleep 5; done
pack_reports
tar czf $OUT/full-guided.tgz -C $RUNS full-guided
echo "rounds: $(rounds)"
tail -8 $L/timeline.log
grep -o '\[[a-z0-9 -]*\][^\r]*it/s[^\r]*' $L/distill.log 2>/dev/null | tail -2
grep -v Warning $L/distill.log 2>/dev/null | tail -3
for f in $L/eval-*.log; do [ -f $f ] && { echo "== $f"; tail -3 $f; }; done
echo "call done after $(( $(date +%s) - T0 )) s; lane running: $(running 0)"
