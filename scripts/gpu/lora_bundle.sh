#!/usr/bin/env bash
# LoRA slots at SD-2.1 size (issue 65 item 3) on one H100's LiteRT GPU delegate (NVIDIA Vulkan): benchmarks/lora_bundle.py
# measure on the `tiny` phone preset's UNet (326.8 M, int8 kept int8 on the GPU, 3x3 convs lowered, 512 px) exported
# three times as the tiny phone bundle ships it, in 4 layer-cut chunks (unet_chunks=4; export --unet-chunks 1 for one
# whole graph): plain, lora_slots rank 4 and rank 16 (q, k, v, out of every attention; each chunk takes its own slots'
# factors by the whole UNet's names). Each in a fresh process, one UNet step = the 4 chunks in sequence
# (runtime/chunks.run_parts), every row with its unet_chunks:
# the cost per UNet step (median of STEPS=20 timed steps, run + readback; no LoRA, then with one), memory by phase and
# the process's peaks (the memory ledger: runtime/memory.PeakSampler, host RSS / VmHWM and the GPU by NVML), each
# against plain; and the swap run-bundle --lora / BundleRunner.set_lora makes between images (LoraFeeds.load of a
# diffusers / PEFT file, then the first step with its factors): to a LoRA of the slots' rank, to a rank-4 one
# (zero-padded), back to none; and each slotted layout's no-LoRA output against plain's (no_lora_max_abs_vs_plain).
# The text encoder and decoder are not in the bundles: the slots change the UNet only.
# Here first, on the 2-core box (litert-torch; no device time; not yet run at this size: ~7-15 min per export estimated
# from the tiny unet_chunks=4 phone bundle's 6 min 52 s - 14 min with its text encoder and decoder, 6.4 GB peak RSS;
# runs/lora_sd21 ~1 GB):
#   .venv/bin/python benchmarks/lora_bundle.py export runs/lora_sd21
#   .venv/bin/python benchmarks/sd21_bundle.py pack runs/lora_sd21/plain:plain runs/lora_sd21/r4:r4 runs/lora_sd21/r16:r16 \
#     --dest .devbundle/lora --max-golden-mb 0.5
# Then staged as startup_levers.sh is (the tree leaves ~5 MB per call for carried files):
#   bash scripts/gpu/stage.sh split .whl .devbundle/lora --every .gl --part-mb 4.7 --then "bash scripts/gpu/lora_bundle.sh"
#   and the calls it prints, back to back (each carries .gl and one part; the last one installs, unpacks and measures).
#   A machine that already holds /tmp/lora_bundles and /tmp/site needs only: carry [".gl"], bash scripts/gpu/lora_bundle.sh
# Writes $OUT/lora_bundle_<gpu>.json (copy it to benchmarks/results/) and $OUT/lora_bundle.log. The measuring call: ~3 min
# (three processes, each a cold compile of the 4 chunks, ~15-30 s in all, and 4 x 20 steps); with the staging calls ~8-10
# min of device time in all (not yet run). STEPS, LAYOUT_TIMEOUT (240 s a process) override the defaults.
# SMOKE=1: the same end to end on this machine's Vulkan (lavapipe): the shapes teacher's UNet exported three times in 2
# chunks (~6 min on the 2-core box, then ~70 s to measure: run 2026-12-07, each layout fully accelerated, the slotted
# ones' no-LoRA output within 0.013 of plain's (max |out| 4.6), the swaps back to none exact), packed and unpacked as above:
#   SMOKE=1 RUNS=/tmp/lora_bundle OUT=/tmp/lora_bundle/out bash scripts/gpu/lora_bundle.sh
set -u
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/lora_bundle.log") 2>&1
say() { echo "[$(date +%H:%M:%S)] $*"; }
if [ -n "${SMOKE:-}" ]; then
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  PY=$REPO/.venv/bin/python RUNS=${RUNS:?SMOKE=1 needs RUNS=/tmp/...}
  mkdir -p "$RUNS" && cd "$RUNS" || exit 1
  BUNDLES=$RUNS/bundles
  if [ ! -d "$BUNDLES" ]; then
    say "export (smoke: the shapes teacher's UNet, plain, r4, r16)"
    $PY "$REPO"/benchmarks/lora_bundle.py export "$RUNS/export" --smoke || exit 1
    rm -rf "$RUNS/pack" && $PY "$REPO"/benchmarks/sd21_bundle.py pack "$RUNS/export/plain:plain" "$RUNS/export/r4:r4" \
      "$RUNS/export/r16:r16" --dest "$RUNS/pack" --max-golden-mb 0.5 || exit 1
    $PY "$REPO"/benchmarks/sd21_bundle.py unpack "$RUNS/pack" "$BUNDLES" || exit 1
  fi
  GPU=cpu
else
  source "$REPO/scripts/gpu/vulkan_env.sh"
  source "$REPO/scripts/gpu/env.sh" || exit 3  # cd /tmp/runs: the repo's pocketdiff/ would shadow the installed one
  PY=python3
  BUNDLES=/tmp/lora_bundles
  [ -d "$BUNDLES/plain" ] || { say "unpack"; $PY "$REPO"/benchmarks/sd21_bundle.py unpack "$REPO/.devbundle/lora" "$BUNDLES" || exit 5; }
  say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader); $(nproc) cores; set up in $SECONDS s"
  GPU=$(gpu_tag gpu)
fi
say "layouts: $(ls "$BUNDLES" | tr '\n' ' ')"
$PY "$REPO"/benchmarks/lora_bundle.py measure "$BUNDLES" --out "$OUT/lora_bundle_${GPU:-gpu}.json" --steps "${STEPS:-20}" \
  --timeout "${LAYOUT_TIMEOUT:-240}" 2>&1 | grep -v '^INFO: \|^WARNING: All log messages'
say "done in $SECONDS s: $OUT/lora_bundle_${GPU:-gpu}.json"
