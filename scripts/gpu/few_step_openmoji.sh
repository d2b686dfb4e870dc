#!/usr/bin/env bash
# Few-step students on OpenMoji (issue 36): progressive distillation (PD) to 1 step against
# consistency distillation (LCM) on the same teacher, one H100, three calls of under 10 minutes each
# (a fresh machine per call; what a later call needs comes back in $OUT and is carried again):
#
#   bash scripts/gpu/few_step_openmoji.sh teacher   # call 1: carry .whl .devdata
#       OpenMoji teacher (configs/teacher/openmoji.yaml: VAE 1,500 steps, UNet time-boxed to 300 s at
#       batch 256, as the session-1 teacher) beside a small OpenMoji CLIP (configs/clip/openmoji.yaml at
#       width 128, 2,000 steps: 5 MB in fp16, so that it travels with the teacher). Back: teacher16.tgz.*,
#       clip16.tgz, teacher_reports.tgz. Put teacher16.tgz.* and clip16.tgz in .carry/few_step/.
#   bash scripts/gpu/few_step_openmoji.sh lcm       # call 2: carry .whl .devdata .carry/few_step
#       configs/distill/openmoji_lcm.yaml, LCM_STEPS (600) steps at batch 128, FD (openmoji-CLIP) and
#       CLIP score at 1, 2, 4, 8 steps and the teacher's DDIM at 1, 2, 4, 8, 64; FD at 2 steps at every CURVE_EVERY-th (100) step; LCM_ARGS: more overrides, LCM_NAME: the run's name
#       (eval.curve_steps: the GPU-hours to the target). Back: lcm_reports.tgz
#   SWEEP='NAME:overrides;NAME:overrides' bash scripts/gpu/few_step_openmoji.sh sweep   # carry .carry/few_step (after setup)
#       consistency variants side by side on the one GPU (FD and CLIP score at 2 steps every CURVE_EVERY steps; their seconds
#       are not GPU-hours); few_step_table.py --sweep gathers them. `setup` (carry .whl .devdata) readies a fresh machine
#       whose next call carries the teacher: the three do not fit one call's 64 MiB.
#   bash scripts/gpu/few_step_openmoji.sh pd        # call 3: carry .whl .devdata .carry/few_step
#       configs/distill/openmoji.yaml from a 16-step grid: guided stage GUIDED_STEPS (400), rounds
#       8 -> 4 -> 2 -> 1 (PD_ROUNDS: 350, 350, 400, 400; PD_FINAL=2 stops at 2), EMA decay PD_EMA (0.99),
#       progressive.top_step_input=noise; per round FD and CLIP score of the student and the teacher's DDIM at its count
#       and at 64 (NO_METRICS=1: none). Back: pd_reports.tgz
#
#   bash scripts/gpu/few_step_openmoji.sh decoder   # call 5, on the machine the pd (or lcm) phase left warm (its student
#       in outputs/pd, or outputs/lcm with DECODER_FROM=lcm): issue 33 item 2 on what users decode. distill-decoder on the
#       teacher's VAE and the 2-step student's samples (configs/decoder/openmoji.yaml samples.pipeline, the rest of the
#       budget), then benchmarks/decoder_paths.py on the
#       student's 2-step samples for the 495 held-out captions (--latents-from): PSNR against the whole decode and
#       FD (openmoji-CLIP) against the real images, per decoder path. Back: decoder_paths_student_openmoji.json
#       DECODER_ARGS: more overrides of distill-decoder (e.g. "train.max_steps=12000 samples.count=2048")
#
# Then, on any machine: python3 scripts/gpu/few_step_table.py --lcm LCM_RUN --pd PD_RUN --out
# benchmarks/results/few_step_openmoji_h100.json (LCM_RUN, PD_RUN: the unpacked report folders).
#
# A phase whose run stops at BUDGET_S goes on with RESUME=1 in the next call of the same warm machine
# (outputs/ stays in /tmp/runs; the distill verb resumes from its last checkpoint, metrics included).
#
# Cut to fit ~30 minutes of one H100 (against configs/distill/openmoji.yaml's full recipe): the teacher
# trains 300 s (not 30,000 steps); the CLIP is narrower and shorter; PD starts from 16 steps, not 64
# (no 32- and 16-step rounds), with 350-400 steps per round; LCM trains 600 steps (the recipe's);
# metrics on 1,024 captions x 1 seed (not 2,048 x 2). GPU-seconds are the distill reports' training
# wall time (`train_seconds`, metrics and grids excluded), summed over the rounds up to each count.
# Carry sizes: teacher16 ~23 MB, clip16 ~4 MB, OpenMoji (.devdata) ~19 MB, the wheels this needs ~8 MB (no ai-edge-litert,
# no bitsandbytes); with ~33 MB of tracked files a fresh machine cannot take the teacher, the data and the wheels
# at once (64 MiB). So chain the calls on one warm machine (each next call within its 30 s idle release; the wheels,
# the data and outputs/ stay in /tmp): teacher with .whl .devdata, then lcm, pd, decoder with .whl only
# (2026-11-27, one H100: teacher 455 s, lcm 516 s, pd 546 s + RESUME=1 93 s of command time; later that day, one H200:
# setup 5 s, sweep 479 s, pd with PD_FINAL=2 425 s, lcm (600 steps) 290 s).
set -u
PHASE=${1:?usage: few_step_openmoji.sh setup|teacher|lcm|sweep|pd|decoder}
source scripts/gpu/openmoji_lib.sh  # om_env (env.sh), om_clock (left, stamp, verb), om_teacher, om_restore, om_fp16
om_env
C=$REPO/configs L=$RUNS/few_step
mkdir -p $L outputs
LCM_STEPS=${LCM_STEPS:-600} GUIDED_STEPS=${GUIDED_STEPS:-400} PD_ROUNDS=${PD_ROUNDS:-[350,350,400,400]}
# the recipe's 0.999 is for rounds of 4,000-8,000 steps: over 350-400 it leaves 67-70 % of each round's starting
# weights in the saved EMA (the stop-38 PD students kept the unguided start: CLIP score 4 against 10); 0.99 leaves 2-3 %
PD_EMA=${PD_EMA:-0.99}
METRICS="eval.metrics=true eval.num_images=1024 eval.metric_seeds=[0] eval.reference_steps=64 eval.clip=outputs/clip-openmoji/clip"
# NO_METRICS=1: no FD / CLIP score per round (a pd run that only has to give the decoder phase its 2-step student)
[ -n "${NO_METRICS:-}" ] && METRICS="eval.metrics=false"
om_clock 540  # this call's training budget (BUDGET_S): the distill verb stops (with a checkpoint) past it
om_sizes  # VAE 1,500 steps and the 128-wide CLIP of 2,000 steps; this chain's teacher is time-boxed to 300 s at batch 256
TEACHER="train.batch_size=256 train.max_time_s=300"
distill() {  # distill NAME CONFIG ARGS...: one distill run, time-boxed, its reports into $OUT/NAME_reports.tgz
  local name=$1 config=$2; shift 2
  stamp "start $name ($(left) s left)"
  local again=--overwrite  # RESUME=1: carry on a run an earlier call of this warm machine stopped at its budget
  [ -n "${RESUME:-}" ] && [ -d outputs/$name/checkpoints ] && again="--resume latest"
  timeout $(( $(left) + 60 )) python3 -m pocketdiff distill --config $config --output outputs/$name $again \
    max_time_s=$(left) $METRICS "$@" > $L/$name.log 2>&1
  stamp "end $name exit $?"
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader >> $L/timeline.log
  cp $L/$name.log $L/timeline.log outputs/$name/ 2>/dev/null
  tar czf $OUT/${name}_reports.tgz -C outputs --exclude=checkpoints --exclude=cache --exclude=images --exclude='*.safetensors' \
    --exclude='*.pt' $name
  tail -3 $L/$name.log
}

case $PHASE in
  teacher)
    stamp "start teacher and CLIP"
    # DECODER=1: issue 33's decoder paths beside them (its own held-out VAE, this CLIP): scripts/gpu/decoder_openmoji.sh
    [ -n "${DECODER:-}" ] && (cd $REPO && CLIP_DIR=$RUNS/outputs/clip-openmoji/clip VAE_S=150 DECODER_S=120 \
      bash scripts/gpu/decoder_openmoji.sh > $L/decoder.log 2>&1) &
    om_teacher  # waits for the decoder paths too
    stamp "end teacher and CLIP"
    cp $L/*.log outputs/teacher-openmoji/; tar czf $OUT/teacher_reports.tgz -C outputs --exclude='*.safetensors' \
      --exclude=checkpoints --exclude='*.pt' teacher-openmoji clip-openmoji
    tail -n 2 $L/teacher.log $L/clip.log ;;
  setup)  # only the wheels and the data into /tmp (a first call that carries .whl .devdata; the next carries .carry/few_step)
    echo "set up: $(ls /tmp/site | wc -l) entries in /tmp/site, $(ls /tmp/devdata) in /tmp/devdata" ;;
  lcm)
    om_restore few_step
    distill ${LCM_NAME:-lcm} $C/distill/openmoji_lcm.yaml consistency.train.max_steps=$LCM_STEPS \
      consistency.train.checkpoint_every=${CURVE_EVERY:-100} eval.curve_steps=[2] ${LCM_ARGS:-} ;;
  sweep)  # consistency variants side by side on one GPU: FD at 2 steps against training steps (not GPU-hours: they share it)
    om_restore few_step
    IFS=';' read -ra variants <<< "${SWEEP:?SWEEP='name:overrides;name:overrides'}"
    for v in "${variants[@]}"; do
      # shellcheck disable=SC2086  # the overrides are words
      distill ${v%%:*} $C/distill/openmoji_lcm.yaml consistency.train.max_steps=$LCM_STEPS consistency.sample_steps=[2] \
        consistency.train.checkpoint_every=${CURVE_EVERY:-100} eval.curve_steps=[2] ${v#*:} &
    done
    wait ;;
  pd)
    om_restore few_step
    distill pd $C/distill/openmoji.yaml progressive.start_steps=16 progressive.final_steps=${PD_FINAL:-1} progressive.top_step_input=noise \
      guided.train.max_steps=$GUIDED_STEPS progressive.round_max_steps=$PD_ROUNDS \
      guided.train.ema_decay=$PD_EMA progressive.train.ema_decay=$PD_EMA ;;
  decoder)
    om_restore few_step
    FROM=${DECODER_FROM:-pd}  # whose 2-step student's samples: pd (the recommended method) or lcm
    student=$(python3 -c "import glob, json, os, sys
found = [os.path.dirname(p) for p in sorted(glob.glob(f'outputs/{sys.argv[1]}/round-*/distill.json'))
         if json.load(open(p)).get('num_inference_steps') == 2 or json.load(open(p)).get('method') == 'consistency']
print(found[0] if found else '')" $FROM)
    [ -n "$student" ] || { echo "no 2-step $FROM student in outputs/$FROM: run the $FROM phase on this machine first"; exit 1; }
    stamp "distill-decoder on the teacher's VAE ($(left) s left)"
    python3 -m pocketdiff distill-decoder --config $C/decoder/openmoji.yaml --output outputs/decoder --resume latest \
      vae=outputs/teacher-openmoji/pipeline samples.pipeline=$student samples.steps=2 samples.guidance_scale=${GUIDANCE:-3.0} \
      train.max_time_s=$(( $(left) - ${PATHS_S:-180} )) ${DECODER_ARGS:-} > $L/decoder.log 2>&1 || { tail -20 $L/decoder.log; exit 1; }
    stamp "decoder paths on $student's samples"
    python3 $REPO/benchmarks/decoder_paths.py --latents-from $student --latent-steps 2 --latent-guidance ${GUIDANCE:-3.0} \
      --student outputs/decoder/vae --data openmoji --resolution 64 --images 495 --one-pass 8x16/4/2 \
      --clip outputs/clip-openmoji/clip --out $OUT/decoder_paths_student_openmoji.json > $L/paths.log 2>&1 || tail -20 $L/paths.log
    cp $L/decoder.log $L/paths.log $L/timeline.log $OUT/ ;;
  *) echo "unknown phase $PHASE (setup | teacher | lcm | sweep | pd | decoder)"; exit 2 ;;
esac
ls -la $OUT
