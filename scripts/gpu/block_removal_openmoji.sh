#!/usr/bin/env bash
# Block removal on OpenMoji (issue 48 item 3): teacher -> block removal + KD (prune, presets base / small / tiny) ->
# 2-step consistency student (configs/distill/openmoji_lcm.yaml) -> W8 (configs/calibrate/openmoji_student_w8.yaml)
# -> FD and CLIP score (openmoji-CLIP) against the unpruned student (same chain without the prune) and the teacher's
# 64 DDIM steps. Three calls chained on ONE warm H200 (each within 30 s of the last: /tmp/runs stays):
#
#   bash scripts/gpu/block_removal_openmoji.sh teacher    # carry .whl_om .devdata (~25 MB beside ~39 MB of tracked files)
#       teacher (VAE 1,500 steps, UNet TEACHER_STEPS=2000 steps at batch 256 within TEACHER_S=400 s, as few_step's 1,964-step
#       teacher; 794 steps drew no emoji yet) beside a small CLIP.
#   bash scripts/gpu/block_removal_openmoji.sh prune      # no carry
#       the three prunes + KD at once (RECOVERY_S=200 s each) beside the unpruned consistency student (LCM_STEPS=600), then its W8.
#   bash scripts/gpu/block_removal_openmoji.sh students   # no carry
#       the three presets' consistency students at once, each then W8; one `pocketdiff evaluate` of every student
#       (float and W8 at 1 and 2 steps, W8 RTN at 2) and the teacher's DDIM at 64.
# Each call returns bro_reports.tgz (every run's reports and logs so far, no weights); the teacher call also teacher16.tgz.*
# and clip16.tgz (a lost machine restarts from them: put them in .carry/block_removal and carry that, without .devdata).
# Then: python3 scripts/gpu/block_removal_table.py --runs DIR (bro_reports.tgz unpacked) --out
# benchmarks/results/block_removal_openmoji_h200.json.  RESUME=1: carry on runs an earlier call stopped at their box.
# SMOKE=1: the same chain on this CPU at toy size (a few steps, 16 captions), OUT and RUNS set by the caller.
# PRESETS, CHAIN (work folder and carry name), REPORTS (the reports file) and TEACHER_ARGS (teacher overrides) make
# another chain of the same phases: scripts/gpu/sdxl_openmoji.sh (the SDXL-shaped teacher, the KOALA presets).
set -u
PHASE=${1:?usage: block_removal_openmoji.sh teacher|prune|students}
source scripts/gpu/openmoji_lib.sh  # om_env, om_sizes, om_clock (left, stamp, verb, again), om_teacher, om_restore
om_env
CHAIN=${CHAIN:-block_removal}  # the work folder $RUNS/CHAIN and the carry .carry/CHAIN (sdxl_openmoji.sh runs this chain as its own)
C=$REPO/configs W=$RUNS/$CHAIN L=$RUNS/$CHAIN/logs
mkdir -p $L && cd $W || exit 1
PRESETS=${PRESETS:-base small tiny}
om_clock $([ -n "${SMOKE:-}" ] && echo 3000 || { [ "$PHASE" = teacher ] && echo 560 || echo 520; })
om_sizes
if [ -n "${SMOKE:-}" ]; then
  LCM_STEPS=${LCM_STEPS:-3}
  RECOVERY="train.max_steps=3 train.batch_size=8 train.checkpoint_every=3 eval.probe_samples=4 eval.steps=2 data.max_samples=64"
  LCMX="consistency.train.batch_size=8 data.max_samples=64" W8X="calib.num_prompts=4 calib.holdout_prompts=2 recon.iters=2 recon.batch_size=4 output.samples=0"
  NUM=${NUM:-16}
else
  LCM_STEPS=${LCM_STEPS:-600}
  RECOVERY="train.max_time_s=${RECOVERY_S:-200}" LCMX="" W8X="calib.num_prompts=256 recon.iters=${W8_ITERS:-200}"
  NUM=${NUM:-1024}
fi
finish() {  # every run's reports and logs (no weights) into $OUT/bro_reports.tgz (REPORTS: another name)
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used --format=csv,noheader >> $L/timeline.log
  tar czf $OUT/${REPORTS:-bro_reports}.tgz -C $W --exclude=checkpoints --exclude=cache --exclude='*.safetensors' --exclude='*.pt' \
    --exclude='*.bin' --exclude=images --exclude=tokenizer --exclude=text_encoder --exclude=vae logs outputs
  ls -la $OUT; tail -n 25 $L/timeline.log
}
lcm() {  # lcm NAME FROM [later]: the 2-step consistency student of pipeline FROM (LCM_STEPS steps; boxed to leave W8_S + EVAL_S),
  # then its W8 (later: not here)
  verb lcm-$1 distill --config $C/distill/openmoji_lcm.yaml --output outputs/lcm-$1 $(again lcm-$1) model.pretrained=$2 \
    consistency.train.max_steps=$LCM_STEPS consistency.sample_steps=[1,2] eval.metrics=false max_time_s=$(( $(left) - ${W8_S:-120} - ${EVAL_S:-100} )) \
    consistency.train.checkpoint_every=100 $LCMX || return 1
  [ -n "${3:-}" ] || w8 $1
}
w8() {  # w8 NAME: W8 of outputs/lcm-NAME/round-0 calibrated at 2 steps (recon and RTN pipelines); RTN-only when time is short
  local fast=""; [ "$(left)" -lt $(( ${W8_S:-120} + ${EVAL_S:-100} )) ] && fast="recon.method=rtn recon.iters=0"
  verb w8-$1 calibrate --config $C/calibrate/openmoji_student_w8.yaml --output outputs/w8-$1 --overwrite \
    model.pretrained=outputs/lcm-$1/round-0 calib.steps=2 parity.recon_not_worse_than_rtn=false $W8X $fast
}
evaluate_all() {  # one evaluate: every student (float, W8, W8 RTN) and the teacher's DDIM at 64 steps, same prompts and seeds
  python3 - "$NUM" $PRESETS > outputs/eval.yaml <<'PY'
import os, sys, yaml
num, presets = int(sys.argv[1]), ["unpruned"] + sys.argv[2:]
models = [{"name": "teacher DDIM", "path": "outputs/teacher-openmoji/pipeline", "steps": [64]}]
for p in presets:
    for name, path, steps in ((f"{p} float", f"outputs/lcm-{p}/round-0", [1, 2]), (f"{p} W8", f"outputs/w8-{p}/pipeline", [1, 2]),
                              (f"{p} W8 RTN", f"outputs/w8-{p}/rtn/pipeline", [2])):
        if os.path.isfile(os.path.join(path, "model_index.json")):
            models.append({"name": name, "path": path, "steps": steps})
print(yaml.safe_dump({"models": models, "reference": {"source": "openmoji", "resolution": 64},
                      "prompts": {"from_reference": num}, "seeds": [0], "guidance_scale": 3.0, "batch_size": 128,
                      "metrics": {"features": "clip", "clip": "outputs/clip-openmoji/clip"}}))
PY
  verb eval evaluate --config outputs/eval.yaml --output outputs/eval --overwrite
}

case $PHASE in
  teacher)
    # shellcheck disable=SC2086  # TEACHER_ARGS: more teacher overrides (sdxl_openmoji.sh: model.arch=small_xl)
    om_teacher ${TEACHER_ARGS:-} || { finish; exit 1; } ;;
  prune)
    om_restore $CHAIN
    pids=""
    for p in $PRESETS; do
      verb prune-$p prune --config $C/prune/openmoji_blocks.yaml --output outputs/prune-$p $(again prune-$p) \
        blocks.preset=$p model.pretrained=$T $RECOVERY &
      pids="$pids $!"
    done
    # the unpruned student beside them; its W8 only while a prune still runs (else the students call does it)
    (lcm unpruned $T later && for q in $pids; do kill -0 $q 2> /dev/null && { w8 unpruned; break; }; done) &
    wait ;;
  students)
    om_restore $CHAIN
    for p in $PRESETS; do
      [ -f outputs/prune-$p/pipeline/model_index.json ] && lcm $p outputs/prune-$p/pipeline &
    done
    wait
    [ -f outputs/w8-unpruned/pipeline/model_index.json ] || w8 unpruned  # the prune call ran out of time for it
    evaluate_all ;;
  *) echo "unknown phase $PHASE (teacher | prune | students)"; exit 2 ;;
esac
finish
