#!/usr/bin/env bash
# Issue 33 item 2 on one GPU: the one-pass (norm-free) decoder against the whole decoder on real images.
# The OpenMoji teacher's VAE recipe (configs/decoder/openmoji_teacher_vae.yaml at the GPU batch of
# configs/teacher/openmoji.yaml; items 4000.. held out), the OpenMoji CLIP (configs/clip/openmoji.yaml; kept in
# /tmp/clip-openmoji for later calls of a warm machine; or CLIP_DIR, one trained beside this job), `pocketdiff distill-decoder` (configs/decoder/openmoji.yaml),
# then benchmarks/decoder_paths.py on the 495 held-out images: PSNR and FD (openmoji-CLIP) per path.
# Repo root; carried: .whl/ and .devdata/ (OpenMoji). Writes $OUT/decoder_paths_openmoji_<gpu>.json, the runs'
# reports ($OUT/decoder_openmoji_reports.tgz) and $OUT/decoder_openmoji.log.
set -u
source scripts/gpu/env.sh || exit 3
exec > >(tee -a "$OUT/decoder_openmoji.log") 2>&1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print tolower($2)}')
C=$REPO/configs; L=$RUNS/decoder_openmoji && mkdir -p $L && cd $L || exit 1
say() { echo "[$(date +%H:%M:%S)] $*"; }
if [ ! -f vae/pipeline/vae/config.json ]; then
  say "VAE (teacher recipe: 4000 steps, batch 64, lr 5e-4; first 4000 items)"
  python3 -m pocketdiff train-teacher --config $C/decoder/openmoji_teacher_vae.yaml --output vae --overwrite \
    vae.batch_size=64 vae.lr=5.0e-4 vae.max_time_s=${VAE_S:-200} vae.checkpoint_every=500 > vae.log 2>&1 || { tail -20 vae.log; exit 4; }
fi
CLIP=${CLIP_DIR:-/tmp/clip-openmoji/clip}  # CLIP_DIR: a CLIP another job trains (waited for: its report.json)
if [ -n "${CLIP_DIR:-}" ]; then
  say "waiting for the CLIP of $CLIP_DIR"
  for _ in $(seq 600); do [ -f "$CLIP_DIR/../report.json" ] && break; sleep 1; done
elif [ ! -f $CLIP/config.json ]; then
  say "OpenMoji CLIP"
  python3 -m pocketdiff train-clip --config $C/clip/openmoji.yaml --output /tmp/clip-openmoji --overwrite save_dtype=fp16 \
    > clip.log 2>&1 || { tail -20 clip.log; exit 5; }
fi
if [ ! -f decoder/vae/config.json ]; then
  say "distill-decoder"
  python3 -m pocketdiff distill-decoder --config $C/decoder/openmoji.yaml --output decoder --resume latest vae=$L/vae/pipeline \
    train.max_time_s=${DECODER_S:-150} > decoder.log 2>&1 || { tail -20 decoder.log; exit 6; }
fi
say "decoder paths"
python3 $REPO/benchmarks/decoder_paths.py --vae vae/pipeline --student decoder/vae --data openmoji --resolution 64 \
  --images 495 --one-pass 8x16/4/2 8x8/4/2 --clip $CLIP --out $OUT/decoder_paths_openmoji_${GPU:-gpu}.json
tar czf $OUT/decoder_openmoji_reports.tgz --exclude=checkpoints --exclude='*.safetensors' --exclude='*.bin' vae decoder *.log
say "done"
