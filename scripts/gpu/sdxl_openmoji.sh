#!/usr/bin/env bash
# The SDXL family on OpenMoji (issue 63 item 5): an SDXL-shaped small teacher (model.arch=small_xl: two text towers,
# pooled embedding and time ids, a 12.2 M text_time UNet; pocketdiff/archs_xl.py) -> block removal + output/feature KD
# with the KOALA-style presets (koala_1b, koala_700m: pocketdiff/unet_blocks.py) -> 2-step consistency student -> W8
# (calibrate) -> FD and CLIP score (OpenMoji-CLIP) against the unpruned 2-step student and the teacher's 64 DDIM steps;
# then, on the 2-core box, the W8 koala_700m student -> `export` bundle -> the bundle's FD and CLIP score beside the W8
# pipeline's on the same prompts. The GPU part is block_removal_openmoji.sh's chain run with CHAIN=sdxl_openmoji, the
# XL teacher and the KOALA presets. On small_xl the presets keep 56 % (koala_1b, 6.85 M) and 48 % (koala_700m, 5.83 M)
# of the UNet, not SDXL's 45 % / 30 %: the teacher's lowest stage has 2 transformer blocks, not 10 (both keep 1).
# Three calls chained on ONE warm H100 (each within 30 s of the last: /tmp/runs stays), then one step here:
#
#   bash scripts/gpu/sdxl_openmoji.sh teacher    # carry .whl_om .devdata (as block_removal_openmoji.sh)
#       the XL teacher (VAE 1,500 steps, UNet TEACHER_STEPS=2000 steps at batch 256 within TEACHER_S=360 s) beside a small
#       OpenMoji CLIP (2,000 steps). Budget 540 s.
#   bash scripts/gpu/sdxl_openmoji.sh prune      # no carry
#       koala_1b and koala_700m block removal + KD at once (RECOVERY_S=200 s each) beside the unpruned consistency student
#       (LCM_STEPS=600), then its W8. Budget 480 s.
#   bash scripts/gpu/sdxl_openmoji.sh students   # no carry
#       the two presets' consistency students at once, each then W8; one `pocketdiff evaluate` (NUM=1024 captions, seed
#       0, guidance 3) of every student (float and W8 at 1 and 2 steps, W8 RTN at 2) and the teacher's DDIM at 64; then
#       sdxl_openmoji_table.py gpu -> $OUT/sdxl_openmoji_<gpu>.json (+ .png), and for the bundle step $OUT/w8_students.tgz.*
#       (the W8 students of unpruned and BUNDLE_PRESET=koala_700m as scripts/gpu/w8_carry.py slims them: the UNet as its
#       int8 checkpoint, rebuilt bit for bit here; text encoders and VAE in float16; ~25 MB) and clip16.tgz: 6 files,
#       ~31 MB in the toy run. Budget 500 s for the chain, ~20 s more for the table and the packing.
#   Here, on the 2-core box (the export needs litert-torch + tensorflow, which the GPU machine has not), FROM = the
#   students call's returned folder (files_at):
#   FROM=<files_at> RUNS=/tmp/sdxl_bundle bash scripts/gpu/sdxl_openmoji.sh bundle
#       `pocketdiff export --config configs/export/calibrated_int8.yaml` of the koala_700m W8 student (2 steps, embedded
#       guidance, every component checked on the GPU delegate, lavapipe: ~4 min), then one `pocketdiff evaluate` on
#       NUM_BUNDLE=128 captions: the bundle (kind: bundle, lavapipe, ~7 s an image on the loaded box) beside both W8
#       students as pipelines (CPU); sdxl_openmoji_table.py bundle adds its rows and writes
#       benchmarks/results/sdxl_openmoji_<gpu>.json (~20 min in all, no device time).
# Each GPU call returns sxo_reports.tgz (every run's reports and logs so far, no weights); the teacher call also
# teacher16.tgz.* and clip16.tgz (a lost machine restarts from them: put them in .carry/sdxl_openmoji and carry that,
# without .devdata). One H100: 540 + 480 + 500 s = 25.3 minutes of command time at most (estimated from
# block_removal_openmoji.sh's calls on one H200, 486 + 389 + 306 s with three presets; the XL teacher is 1.4x the
# `small` one's UNet; not yet run). RESUME=1: carry on runs an earlier call stopped at their box.
# SMOKE=1: the same chain on this CPU at toy size (a few steps, 16 captions; NUM_BUNDLE=8), OUT and RUNS set by the caller:
#   SMOKE=1 RUNS=/tmp/sxo OUT=/tmp/sxo/out bash scripts/gpu/sdxl_openmoji.sh teacher   # then prune, students,
#   FROM=/tmp/sxo/out SMOKE=1 RUNS=/tmp/sxo OUT=/tmp/sxo/out bash scripts/gpu/sdxl_openmoji.sh bundle
set -u
PHASE=${1:?usage: sdxl_openmoji.sh teacher|prune|students|bundle}
REPO=$PWD
BUNDLE_PRESET=${BUNDLE_PRESET:-koala_700m}
export CHAIN=sdxl_openmoji REPORTS=sxo_reports PRESETS="${PRESETS:-koala_1b koala_700m}" TEACHER_ARGS="model.arch=small_xl"
export TEACHER_S=${TEACHER_S:-360}
chain() {  # chain PHASE BUDGET: the phase of block_removal_openmoji.sh's chain under this call's settings
  BUDGET_S=${BUDGET_S:-$([ -n "${SMOKE:-}" ] && echo 3000 || echo $2)} bash scripts/gpu/block_removal_openmoji.sh $1
}
case $PHASE in
  teacher) chain teacher 540 ;;
  prune) chain prune 480 ;;
  students)
    chain students 500 || true
    source scripts/gpu/openmoji_lib.sh && om_env  # the installed package and $RUNS (nothing reinstalled)
    W=$RUNS/$CHAIN; cd $W || exit 1
    gpu=$(gpu_tag cpu)
    python3 $REPO/scripts/gpu/sdxl_openmoji_table.py gpu --runs $W --device "${gpu:-cpu}" --out $OUT/sdxl_openmoji_${gpu:-cpu}.json \
      || echo "no table: the students phase did not reach its evaluate"
    mkdir -p /tmp/w8_students && rm -rf /tmp/w8_students/*
    for p in unpruned $BUNDLE_PRESET; do
      [ -f outputs/w8-$p/pipeline/model_index.json ] && python3 $REPO/scripts/gpu/w8_carry.py slim outputs/w8-$p /tmp/w8_students/w8-$p
    done
    python3 $REPO/scripts/gpu/w8_carry.py link /tmp/w8_students  # the VAE and text encoders both students have from the teacher
    [ -n "$(ls /tmp/w8_students)" ] && pack /tmp/w8_students w8_students $(ls /tmp/w8_students)
    tar czf $OUT/clip16.tgz -C outputs/clip-openmoji clip
    ls -la $OUT ;;
  bundle)  # here (the 2-core box): the export and the bundle's evaluate; no GPU
    FROM=${FROM:?FROM=<the folder the students call returned: w8_students.tgz.*, clip16.tgz, sdxl_openmoji_<gpu>.json>}
    FROM=$(cd "$FROM" && pwd)
    export PATH=$REPO/.venv/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
    RUNS=${RUNS:?bundle needs RUNS=/tmp/...}; W=$RUNS/sdxl_openmoji_bundle L=$W/logs; mkdir -p $L && cd $W || exit 1
    table=$(ls $FROM/sdxl_openmoji_*.json 2>/dev/null | head -1)
    [ -n "$table" ] || { echo "no sdxl_openmoji_<gpu>.json in $FROM"; exit 1; }
    gpu=$(basename $table .json); gpu=${gpu#sdxl_openmoji_}
    rm -rf outputs && mkdir -p outputs/clip-openmoji
    cat $FROM/w8_students.tgz.* | tar xzf - -C outputs && tar xzf $FROM/clip16.tgz -C outputs/clip-openmoji || exit 1
    for d in outputs/w8-*; do python3 $REPO/scripts/gpu/w8_carry.py restore $d > /dev/null || exit 1; done
    P=$BUNDLE_PRESET NUM_BUNDLE=${NUM_BUNDLE:-$([ -n "${SMOKE:-}" ] && echo 8 || echo 128)}
    echo "[$(date +%T)] export $P" | tee -a $L/timeline.log
    python3 -m pocketdiff export --config $REPO/configs/export/calibrated_int8.yaml --output outputs/bundle-$P --overwrite \
      int8.checkpoint=outputs/w8-$P steps=2 > $L/export.log 2>&1 || { tail -20 $L/export.log; exit 1; }
    python3 - "$NUM_BUNDLE" "$P" > outputs/eval-bundle.yaml <<'PY'
import os, sys, yaml
num, p = int(sys.argv[1]), sys.argv[2]
models = [{"name": f"{q} W8", "path": f"outputs/w8-{q}/pipeline", "steps": [2]} for q in ("unpruned", p)
          if os.path.isfile(f"outputs/w8-{q}/pipeline/model_index.json")]
models.append({"name": f"{p} bundle", "kind": "bundle", "path": f"outputs/bundle-{p}", "steps": [2]})
print(yaml.safe_dump({"models": models, "reference": {"source": "openmoji", "resolution": 64},
                      "prompts": {"from_reference": num}, "seeds": [0], "guidance_scale": 3.0, "batch_size": 16,
                      "metrics": {"features": "clip", "clip": "outputs/clip-openmoji/clip"}}))
PY
    echo "[$(date +%T)] evaluate $NUM_BUNDLE captions" | tee -a $L/timeline.log
    python3 -m pocketdiff evaluate --config outputs/eval-bundle.yaml --output outputs/eval-bundle --overwrite > $L/eval.log 2>&1 \
      || { tail -20 $L/eval.log; exit 1; }
    echo "[$(date +%T)] done" | tee -a $L/timeline.log
    dest=${DEST:-$([ -n "${SMOKE:-}" ] && echo $OUT || echo $REPO/benchmarks/results)}
    python3 $REPO/scripts/gpu/sdxl_openmoji_table.py bundle --json $table --preset $P --eval outputs/eval-bundle/report.json \
      --export outputs/bundle-$P/report.json --out $dest/sdxl_openmoji_$gpu.json ;;
  *) echo "unknown phase $PHASE (teacher | prune | students on the GPU; bundle here)"; exit 2 ;;
esac
