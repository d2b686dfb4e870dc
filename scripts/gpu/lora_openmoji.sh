#!/usr/bin/env bash
# Few steps as a portable LoRA on OpenMoji (issue 65 item 2): the consistency student trained as a LoRA over the
# teacher (configs/distill/openmoji_lora.yaml, rank 8 on LCM-LoRA's targets) against the same recipe training the whole
# UNet, at 2 and 4 steps (FD and CLIP score, OpenMoji-CLIP); the LoRA's file, sha256, rank and size; and the same LoRA
# applied to a second teacher fine-tuned from the same base on a style subset of OpenMoji (STYLE_GROUPS, default
# flags: 270 emoji of one look) against that teacher's own 64 DDIM steps (LCM-LoRA's portability claim, measured).
# Three calls chained on ONE warm H100 (each within 30 s of the last: /tmp/runs stays), as block_removal_openmoji.sh:
#
#   bash scripts/gpu/lora_openmoji.sh teacher    # carry .whl_om .devdata (or the wheels env.sh installs from .whl)
#       base teacher (VAE 1,500 steps, UNet TEACHER_STEPS=2000 steps at batch 256 within TEACHER_S=400 s) beside a
#       small OpenMoji CLIP (width 128, 2,000 steps). ~560 s.
#   bash scripts/gpu/lora_openmoji.sh students   # no carry
#       at once on the one GPU: the LoRA student and the full student (LCM_STEPS=600 steps each, batch 128, no metrics
#       here) and the style teacher (train-teacher from the base on the subset, STYLE_STEPS=400 steps at batch 128,
#       within STYLE_S=300 s). ~520 s.
#   bash scripts/gpu/lora_openmoji.sh eval       # no carry
#       two `pocketdiff evaluate` runs (NUM=1024 prompts, one seed, guidance 3 for the teachers' DDIM): on OpenMoji,
#       the base teacher's DDIM at 64, the full and the LoRA student at 2 and 4; on the style subset (its captions and
#       images), the style teacher's DDIM at 64 (and at 2, 4: what plain few-step sampling gives), the style teacher
#       with the LoRA fused by `model.lora` under the LoRA student's LCMScheduler at 2 and 4, and the base teacher +
#       LoRA at 2 and 4 on the same prompts (does the style survive?). Then scripts/gpu/lora_openmoji_table.py writes
#       $OUT/lora_openmoji_<gpu>.json (copy it to benchmarks/results/). ~300 s.
# Each call returns lora_reports.tgz (every run's reports and logs so far, no weights); the teacher call also
# teacher16.tgz.* and clip16.tgz (a lost machine restarts from them: put them in .carry/lora and carry that, no .devdata).
# One H100 in all: about 23 minutes of command time (560 + 520 + 300 s, estimated from few_step_openmoji.sh's and
# block_removal_openmoji.sh's calls of the same teacher, CLIP and 600-step consistency runs; not yet run).
# RESUME=1: carry on runs an earlier call stopped at their time box. SMOKE=1: the same chain on this CPU at toy size
# (a few steps, 16 captions), OUT and RUNS set by the caller:
#   SMOKE=1 RUNS=/tmp/lora_smoke OUT=/tmp/lora_smoke/out bash scripts/gpu/lora_openmoji.sh teacher   # then students, eval
set -u
PHASE=${1:?usage: lora_openmoji.sh teacher|students|eval}
source scripts/gpu/openmoji_lib.sh; om_env
C=$REPO/configs W=$RUNS/lora L=$RUNS/lora/logs
mkdir -p $L && cd $W || exit 1
# the LoRA student trains through peft (the CUDA image has it; diffusers 0.42 wants peft >= 0.17)
python3 -c "import peft, diffusers; print('peft', peft.__version__, 'diffusers', diffusers.__version__)" | tee -a $L/timeline.log || exit 1
om_clock $([ -n "${SMOKE:-}" ] && echo 3000 || { [ "$PHASE" = teacher ] && echo 560 || echo 520; }); om_sizes
STYLE_GROUPS=${STYLE_GROUPS:-flags}
if [ -n "${SMOKE:-}" ]; then
  LCM_STEPS=${LCM_STEPS:-3} LCMX="consistency.train.batch_size=8 consistency.train.checkpoint_every=3 data.max_samples=64"
  STYLE="train.max_steps=3 train.batch_size=8 samples.steps=2" NUM=${NUM:-16} EVAL_BATCH=16
  W8X="calib.num_prompts=8 calib.holdout_prompts=4 recon.iters=2 recon.batch_size=4 recon.forward_batch=8 output.samples=2"
else
  LCM_STEPS=${LCM_STEPS:-600} LCMX="consistency.train.checkpoint_every=100"
  STYLE="train.max_steps=${STYLE_STEPS:-400} train.batch_size=128 train.max_time_s=${STYLE_S:-300}" NUM=${NUM:-1024} EVAL_BATCH=128
  W8X="calib.num_prompts=${W8_PROMPTS:-512}"
fi
S=outputs/style-data T2=outputs/teacher-style/pipeline
finish() {  # every run's reports and logs (no weights) into $OUT/lora_reports.tgz
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used --format=csv,noheader >> $L/timeline.log
  tar czf $OUT/lora_reports.tgz -C $W --exclude=checkpoints --exclude=cache --exclude='*.safetensors' --exclude='*.pt' \
    --exclude='*.bin' --exclude=images --exclude=tokenizer --exclude=text_encoder --exclude=vae --exclude=style-data logs outputs
  ls -la $OUT; tail -n 25 $L/timeline.log
}
style_data() {  # the style subset: OpenMoji's metadata rows of STYLE_GROUPS beside a link to the same zip (source openmoji)
  python3 - "$DATA_ROOT/openmoji" $S "$STYLE_GROUPS" <<'PY'
import json, os, sys
src, dst, groups = sys.argv[1], sys.argv[2], set(sys.argv[3].split(","))
rows = [r for r in map(json.loads, open(os.path.join(src, "metadata.jsonl"), encoding="utf-8")) if r.get("group") in groups]
if not rows:
    sys.exit(f"no OpenMoji rows in groups {sorted(groups)}")
os.makedirs(dst, exist_ok=True)
with open(os.path.join(dst, "metadata.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
link = os.path.join(dst, "openmoji_128_png32.zip")
if not os.path.exists(link):
    os.symlink(os.path.join(os.path.abspath(src), "openmoji_128_png32.zip"), link)
print(f"style subset: {len(rows)} emoji of {sorted(groups)}")
PY
}
pack_students() {  # the full student (its UNet in fp16), the W8 student's UNet and int8 file, the LoRA: $OUT/students.tgz.*
  python3 - outputs/full/round-0 /tmp/full16 <<'PY'
import shutil, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst, ignore=shutil.ignore_patterns("vae", "text_encoder", "tokenizer"))
for f in (dst / "unet").glob("*.safetensors"):
    save_file({k: v.half() if v.is_floating_point() else v for k, v in load_file(f).items()}, f)
PY
  local w8=() f; for f in outputs/full-w8/pipeline/unet outputs/full-w8/pipeline/scheduler outputs/full-w8/pipeline/model_index.json \
    outputs/full-w8/unet_int8.safetensors outputs/full-w8/unet_int8.json outputs/full-w8/report.json; do [ -e $f ] && w8+=($f); done
  tar czf /tmp/students.tgz -C /tmp full16 -C $W outputs/lora/round-0/pytorch_lora_weights.safetensors "${w8[@]}" \
    && split -b 15m /tmp/students.tgz $OUT/students.tgz. && ls -la /tmp/students.tgz
}
distill() {  # distill NAME ARGS...: configs/distill/openmoji_lora.yaml on the base teacher, metrics left to the eval call
  verb $1 distill --config $C/distill/openmoji_lora.yaml --output outputs/$1 $(again $1) model.pretrained=$T \
    consistency.train.max_steps=$LCM_STEPS consistency.sample_steps=[2,4] eval.metrics=false max_time_s=$(( $(left) - 20 )) $LCMX "${@:2}"
}
lcm_folder() {  # the style teacher under the LoRA student's LCMScheduler (the LoRA itself is fused by evaluate's model.lora)
  python3 -c "import sys
from diffusers import LCMScheduler
from pocketdiff.models import load_pipeline, save_pipeline
p = load_pipeline(sys.argv[1]); p.scheduler = LCMScheduler.from_pretrained(sys.argv[2], subfolder='scheduler'); save_pipeline(p, sys.argv[3])" \
    $T2 outputs/lora/round-0 outputs/teacher-style-lcm
}
evaluate_both() {  # the OpenMoji evaluate and the style-subset evaluate, same prompts-per-set, seed and CLIP
  python3 - "$NUM" "$EVAL_BATCH" "$W/$S" <<'PY'
import sys, yaml
num, batch, style = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
lora = "outputs/lora/round-0/pytorch_lora_weights.safetensors"
common = {"prompts": {"from_reference": num}, "seeds": [0], "guidance_scale": 3.0, "batch_size": batch,
          "metrics": {"features": "clip", "clip": "outputs/clip-openmoji/clip"}}
few = {"steps": [2, 4], "guidance_mode": "none"}  # students fold w = 3 (distill.json says so too)
base = [{"name": "teacher DDIM", "path": "outputs/teacher-openmoji/pipeline", "steps": [64]},
        {"name": "full student", "path": "outputs/full/round-0", **few},
        {"name": "LoRA student", "path": "outputs/lora/round-0", **few}]
styled = [{"name": "style teacher DDIM", "path": "outputs/teacher-style/pipeline", "steps": [2, 4, 64]},
          {"name": "style teacher + LoRA", "path": "outputs/teacher-style-lcm", "lora": [{"path": lora, "scale": 1.0}], **few},
          {"name": "base teacher + LoRA", "path": "outputs/lora/round-0", **few}]
# the subset is small (270 flags): two seeds, spaced wider than its images, give FD twice the samples
for name, models, ref, seeds in (("openmoji", base, {"source": "openmoji", "resolution": 64}, [0]),
                                 ("style", styled, {"source": "openmoji", "path": style, "resolution": 64}, [0, 100000])):
    with open(f"outputs/eval-{name}.yaml", "w") as f:
        f.write(yaml.safe_dump({"models": models, "reference": ref, **common, "seeds": seeds}))
PY
  verb eval-openmoji evaluate --config outputs/eval-openmoji.yaml --output outputs/eval-openmoji --overwrite
  verb eval-style evaluate --config outputs/eval-style.yaml --output outputs/eval-style --overwrite
}

case $PHASE in
  teacher)
    om_teacher || { finish; exit 1; } ;;
  students)
    om_restore lora
    style_data || { finish; exit 1; }
    distill lora &
    distill full student.lora_rank=null &
    # the style teacher: the base fine-tuned on the subset (its VAE and text encoder as they are; EMA short enough for the run)
    verb style train-teacher --config $C/teacher/openmoji.yaml --output outputs/teacher-style $(again teacher-style) \
      model.pretrained=$T vae.steps=0 data.path=$S train.lr=1.0e-4 train.warmup_steps=0 train.ema_decay=0.99 \
      train.checkpoint_every=100 $STYLE &
    wait ;;
  eval)
    om_restore lora
    [ -f outputs/lora/round-0/pytorch_lora_weights.safetensors ] && [ -f $T2/model_index.json ] && [ -f outputs/full/round-0/model_index.json ] \
      || { echo "students missing: run (or RESUME=1) the students phase first"; finish; exit 1; }
    lcm_folder || { finish; exit 1; }
    # issue 64 item 4 needs the full student's W8 (calibrated on its own 2-step, guidance-free trajectories; beside the evals)
    # and both students back on the CPU machine (benchmarks/img2img_openmoji.py runs there)
    [ -n "${NO_W8:-}" ] || verb full-w8 calibrate --config $C/calibrate/openmoji_student_w8.yaml --output outputs/full-w8 --overwrite \
      model.pretrained=outputs/full/round-0 calib.steps=2 calib.guidance_scale=1.0 $W8X &
    evaluate_both
    wait
    pack_students
    gpu=$(gpu_tag cpu)
    python3 $REPO/scripts/gpu/lora_openmoji_table.py --runs $W --device "${gpu:-cpu}" --style "$STYLE_GROUPS" \
      --out $OUT/lora_openmoji_${gpu:-cpu}.json ;;
  *) echo "unknown phase $PHASE (teacher | students | eval)"; exit 2 ;;
esac
finish
