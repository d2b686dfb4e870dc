#!/usr/bin/env bash
# Issue 33's delegate-time ratio on a GPU machine (real Vulkan driver): the whole SD-2.1-size VAE decoder
# against the one-pass tiled decode, side by side in one process (benchmarks/decoder_side_by_side.py).
# Repo root; carried: .whl/, .gl/, and .devdec/ holding vae_decoder.tflite.xz (the whole decoder: export with
# configs/sd21/export.yaml components=[vae_decoder] vae_tiling.enabled=false device_profile.enforce=false),
# vae_decoder_head.tflite.xz and vae_up_tile.tflite.xz of a one-pass bundle, and that bundle's manifest.json.
# Writes $OUT/decoder_side_by_side_sd21_<gpu>.json.
set -u
source scripts/gpu/vulkan_env.sh
source scripts/gpu/env.sh || exit 3
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print tolower($2)}')
D=/tmp/devdec && mkdir -p $D
python3 - "$REPO/.devdec" "$D" <<'PY' || exit 4
import lzma, shutil, sys
from pathlib import Path
for f in Path(sys.argv[1]).glob("*.xz"):
    with lzma.open(f) as src, open(Path(sys.argv[2]) / f.stem, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
python3 "$REPO/benchmarks/decoder_side_by_side.py" --whole $D/vae_decoder.tflite --head $D/vae_decoder_head.tflite \
  --up $D/vae_up_tile.tflite --tiling "$REPO/.devdec/manifest.json" --repeats ${REPEATS:-30} \
  --out "$OUT/decoder_side_by_side_sd21_${GPU:-gpu}.json"
