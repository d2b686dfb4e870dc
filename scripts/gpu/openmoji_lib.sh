# The OpenMoji GPU chains' shared part: the set-up of a call, its clock and verbs, the teacher phase (an OpenMoji
# teacher beside a small OpenMoji CLIP, both packed into $OUT for a lost machine) and the restore of that teacher in a
# later call. Sourced from the repo root by block_removal_openmoji.sh, few_step_openmoji.sh, sdxl_openmoji.sh and lora_openmoji.sh.
# What the sourcing script sets and calls:
#
#   om_env            SMOKE=1: this machine (the repo's venv, the shared data, no installs; RUNS and OUT set by the
#                     caller); else the GPU machine's wheels (.whl_om, else env.sh's .whl) and scripts/gpu/env.sh.
#                     Sets REPO, RUNS, DATA_ROOT and pack FOLDER NAME ENTRIES...; leaves the shell in $RUNS.
#   om_sizes          VAE, TEACHER, CLIP (the teacher's and CLIP's step overrides: toy ones under SMOKE=1, else the
#                     chains' 2,000-step teacher at batch 256 within TEACHER_S=400 s) and CLIP_SMALL (a 128-wide CLIP).
#   om_clock BUDGET   T0 and BUDGET_S (BUDGET unless BUDGET_S is set); left, stamp MESSAGE (into $L/timeline.log),
#                     verb NAME VERB ARGS... (one pocketdiff verb stopped at the call's budget, log $L/NAME.log) and
#                     again NAME (--resume latest under RESUME=1 when outputs/NAME has checkpoints, else --overwrite).
#   om_teacher ARGS   the teacher (configs/teacher/openmoji.yaml + $VAE $TEACHER + ARGS, e.g. model.arch=small_xl) and
#                     the CLIP at once into outputs/teacher-openmoji and outputs/clip-openmoji; then $OUT/teacher16.tgz.*
#                     (the teacher in float16) and $OUT/clip16.tgz. Returns 1 when the teacher did not finish.
#   om_restore CARRY  the teacher and CLIP of the teacher call: kept in this warm machine's $RUNS, or unpacked from a
#                     carried .carry/CARRY/{teacher16.tgz.*,clip16.tgz} after a lost machine (back to float32).
#   om_fp16 SRC DST   a pipeline folder in float16 (it loads back as float32).
# Needs C (configs folder) and L (log folder) set before om_clock's functions run.
# shellcheck shell=bash
source scripts/gpu/gpu_tag.sh  # gpu_tag: h100 / h200 for result names (SMOKE runs source no env.sh)
T=outputs/teacher-openmoji/pipeline K=outputs/clip-openmoji/clip

om_env() {
  REPO=$PWD
  if [ -n "${SMOKE:-}" ]; then  # this machine: the repo's venv, the shared data, no installs
    export PATH=$REPO/.venv/bin:$PATH POCKETDIFF_ENV_READY=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    RUNS=${RUNS:?SMOKE=1 needs RUNS=/tmp/...}; mkdir -p "$RUNS" "${OUT:?SMOKE=1 needs OUT=/tmp/...}" && cd "$RUNS" || exit 1
    pack() { local dir=$1 name=$2; shift 2; tar czf /tmp/$name.tgz -C "$dir" "$@" && split -b 15m /tmp/$name.tgz $OUT/$name.tgz.; }
    DATA_ROOT=$(python3 -c "from pocketdiff.data import shared_data_root; print(shared_data_root() or '')")
  else
    if [ -d .whl_om ] && [ ! -f /tmp/site/.wheels-installed ]; then  # the OpenMoji jobs' wheels (env.sh's .whl may hold another job's)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_om/*.whl || exit 1
      touch /tmp/site/.wheels-installed
    fi
    source scripts/gpu/env.sh
    DATA_ROOT=$POCKETDIFF_DATA
  fi
}

om_sizes() {
  CLIP_SMALL="model.vision_width=128 model.text_width=128 model.projection_dim=128 model.vision_heads=4 model.text_heads=4"
  if [ -n "${SMOKE:-}" ]; then
    VAE="5 vae.batch_size=8 data.max_samples=64" TEACHER="train.max_steps=4 train.batch_size=8 samples.steps=2"
    CLIP="train.steps=4 train.batch_size=16 data.max_samples=64 holdout=16"
  else
    VAE=1500 TEACHER="train.batch_size=256 train.max_steps=${TEACHER_STEPS:-2000} train.max_time_s=${TEACHER_S:-400}" CLIP="train.steps=2000"
  fi
}

om_clock() {
  T0=$(date +%s); BUDGET_S=${BUDGET_S:-$1}
}
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
stamp() { echo "[$(date +%T)] $*" | tee -a $L/timeline.log; }
verb() {  # verb NAME VERB ARGS...: one pocketdiff verb, its log in $L/NAME.log, stopped at the call's budget
  local name=$1 t; t=$(left); shift; [ "$t" -gt 10 ] || { stamp "not starting $name: $t s left"; return 1; }
  stamp "start $name ($t s left)"
  timeout $t python3 -m pocketdiff "$@" >> $L/$name.log 2>&1; local rc=$?
  stamp "end $name exit $rc"; return $rc
}
again() { [ -n "${RESUME:-}" ] && [ -d outputs/$1/checkpoints ] && echo "--resume latest" || echo --overwrite; }

om_fp16() {
  python3 -c "import sys, torch; from pocketdiff.models import load_pipeline, save_pipeline
p = load_pipeline(sys.argv[1]); p.to(torch.float16); save_pipeline(p, sys.argv[2])" "$1" "$2"
}

om_teacher() {  # om_teacher [teacher overrides...]
  # shellcheck disable=SC2086  # the size strings are words
  verb teacher train-teacher --config $C/teacher/openmoji.yaml --output outputs/teacher-openmoji --overwrite \
    vae.steps=$VAE $TEACHER "$@" &
  # shellcheck disable=SC2086
  verb clip train-clip --config $C/clip/openmoji.yaml --output outputs/clip-openmoji --overwrite save_dtype=fp16 \
    $CLIP_SMALL $CLIP &
  wait
  [ -f $T/model_index.json ] || { tail -20 $L/teacher.log; return 1; }
  rm -rf /tmp/teacher16 && om_fp16 $T /tmp/teacher16 && pack /tmp teacher16 teacher16
  tar czf $OUT/clip16.tgz -C outputs/clip-openmoji clip
}

om_restore() {  # om_restore CARRY: exits the call when there is no teacher to restore
  [ -f $T/model_index.json ] && [ -d $K ] && return 0
  local S=$REPO/.carry/$1
  ls $S/teacher16.tgz.* > /dev/null 2>&1 || { echo "no teacher: run the teacher phase first (or carry .carry/$1)"; exit 1; }
  rm -rf /tmp/teacher16 && cat $S/teacher16.tgz.* | tar xzf - -C /tmp && python3 -c "import sys; from pocketdiff.models import load_pipeline, save_pipeline
save_pipeline(load_pipeline(sys.argv[1]), sys.argv[2])" /tmp/teacher16 $T || exit 1
  mkdir -p outputs/clip-openmoji && tar xzf $S/clip16.tgz -C outputs/clip-openmoji || exit 1
}
