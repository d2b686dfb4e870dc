#!/usr/bin/env bash
# SD-2.1-size calibration on ONE GPU with the process capped at 24 GiB, streamed per block (issue 17).
# Repo root, .whl/ carried; one mode per call, each under 9 minutes on an H100:
#   bash scripts/gpu/sd21_calibrate.sh verb-w8   # `pocketdiff calibrate` on configs/sd21/calibrate_smoke.yaml, W8, 500 it.
#   bash scripts/gpu/sd21_calibrate.sh verb-w4   # the same at W4 (conv_in / conv_out at 8 bits)
#   bash scripts/gpu/sd21_calibrate.sh bench-w8  # benchmarks/calibrate_sd21.py --full-iters 500: the harness, model, data and
#                                                # seeds of the two-GPU reference run, on one GPU, compared with it
#   bash scripts/gpu/sd21_calibrate.sh cuda-tests  # the CUDA-only tests (streamed host EMA, queued bitsandbytes AdamW8bit
#                                                # against the stock step): pytest -rA into $OUT/cuda_tests_<gpu>.txt
# The verb modes record the host peak too (issue 35): the report's host_peak_rss_gb and host_memory (VmHWM, the
# predicted need, the per-phase peaks; recipe host_cap_gib: 32) and /usr/bin/time -v's maximum RSS where it exists.
# TIMEOUT=510: the watchdog of the run in seconds.
# Writes $OUT/calibrate_sd21_<mode>_<gpu>.json (wall time, peak memory, per-block seconds and peak, UNet cosine and
# NMSE of the reconstruction and of RTN), the run's log and reports; prints a summary.
set -u
MODE=${1:-verb-w8}
source scripts/gpu/env.sh
GPU=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())" 2>/dev/null || echo gpu)
L=$RUNS/sd21_calibrate_$MODE && rm -rf $L && mkdir -p $L && cd $L || exit 1
NAME=calibrate_sd21_${MODE/-/_}_$GPU
T0=$(date +%s)
case $MODE in
  verb-w8|verb-w4)
    BITS=${MODE#verb-w}
    EXTRA=""; [ "$BITS" = 4 ] && EXTRA="recon.autocast=auto"  # W4: bf16 (auto), measured harmless at 4 bits
    TIMEV=""; [ -x /usr/bin/time ] && TIMEV="/usr/bin/time -v -o time_v.txt"
    timeout ${TIMEOUT:-510} $TIMEV python3 -m pocketdiff calibrate --config $REPO/configs/sd21/calibrate_smoke.yaml --output run \
      quant.bits=$BITS $EXTRA > calibrate.log 2>&1
    RC=$?
    WALL=$(( $(date +%s) - T0 ))
    python3 - "$RC" "$WALL" "$NAME" "$BITS" "$EXTRA" <<'PY'
import json, os, sys, torch
rc, wall, name, bits, extra = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
out = {"command": f"pocketdiff calibrate --config configs/sd21/calibrate_smoke.yaml --output run quant.bits={bits} {extra}".strip(),
       "exit_code": rc, "process_wall_s": wall, "device_name": torch.cuda.get_device_name(0), "torch": torch.__version__,
       "gpu_total_gib": round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 2)}
if os.path.isfile("run/report.json"):
    r = json.load(open("run/report.json"))
    keys = ("bits", "mode", "iters", "wall_time_s", "timings", "peak_gpu_memory_gb", "memory", "host_peak_rss_gb", "host_memory",
            "unet_cosine", "unet_cosine_rtn",
            "unet_nmse", "unet_nmse_rtn", "blocks_improved", "blocks_evaluated", "calibration", "parity")
    out.update({k: r[k] for k in keys if k in r})
    out["nmse_recon_over_rtn"] = r["unet_nmse"] / max(r["unet_nmse_rtn"], 1e-30)
    out["blocks"] = [{k: b.get(k) for k in ("name", "kind", "chosen", "time_s", "peak_gpu_gib", "cache_on_device", "mse_rtn", "mse_recon")}
                     for b in r["blocks"]]
if os.path.isfile("time_v.txt"):  # /usr/bin/time -v: the whole process's peak, in kbytes (KiB)
    kb = [int(l.split(":")[1]) for l in open("time_v.txt") if "Maximum resident set size" in l]
    if kb:
        out["time_v_max_rss_kb"] = kb[0]
        out["time_v_max_rss_gib"] = round(kb[0] / 2 ** 20, 3)
        out["time_v_max_rss_gb_decimal"] = round(kb[0] * 1024 / 1e9, 3)
json.dump(out, open(f"{os.environ['OUT']}/{name}.json", "w"), indent=1)
print(f"{name}: host peak {out.get('host_peak_rss_gb')} GiB (predicted {out.get('host_memory', {}).get('predicted_gb')} GiB, "
      f"time -v {out.get('time_v_max_rss_gib')} GiB)")
print(f"{name}: exit {rc}, process {wall} s, report wall {out.get('wall_time_s')} s, peak {out.get('peak_gpu_memory_gb')} GiB, "
      f"cosine {out.get('unet_cosine')} (RTN {out.get('unet_cosine_rtn')}), NMSE {out.get('unet_nmse')} (RTN {out.get('unet_nmse_rtn')})")
if "timings" in out:
    print("timings", out["timings"])
for b in out.get("blocks", []):
    print(f"  {b['name']:34s} {str(b['chosen']):9s} {b['time_s']} s  peak {b['peak_gpu_gib']} GiB")
PY
    ;;
  bench-w8)
    timeout ${TIMEOUT:-510} python3 $REPO/benchmarks/calibrate_sd21.py --out $OUT/$NAME.json --no-sweep --no-timing --full-iters 500 \
      --full-mode independent --stream --memory-cap-gib 24 --autocast fp16 \
      --reference $REPO/benchmarks/results/calibrate_sd21_full_w8_500it_lrfan_2xh200.json > calibrate.log 2>&1
    RC=$?
    python3 - "$OUT/$NAME.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); f = r.get("full", {})
print({k: v for k, v in f.items() if k != "blocks"})
for b in f.get("blocks", []):
    print(f"  {b['name']:34s} {str(b['chosen']):9s} {b['time_s']} s  peak {b.get('peak_gpu_gib')} GiB")
PY
    ;;
  cuda-tests)
    NAME=cuda_tests_$GPU
    (cd $REPO && timeout ${TIMEOUT:-510} python3 -P -m pytest -rA -p no:cacheprovider \
      "tests/train/test_ema.py" "tests/train/test_memory.py::test_queued_bitsandbytes_adamw8bit_matches_the_stock_step") \
      > $OUT/$NAME.txt 2>&1
    RC=$?
    tail -15 $OUT/$NAME.txt
    cp $OUT/$NAME.txt $REPO/benchmarks/results/ 2>/dev/null
    echo "$MODE: exit $RC in $(( $(date +%s) - T0 )) s"
    exit $RC ;;
  *) echo "unknown mode $MODE (verb-w8 | verb-w4 | bench-w8 | cuda-tests)"; exit 2 ;;
esac
cp calibrate.log $OUT/$NAME.log
[ -d run ] && reports run $OUT/$NAME-report.tgz
cp $OUT/$NAME.json $REPO/benchmarks/results/ 2>/dev/null
tail -3 calibrate.log
rm -rf $L  # the run folder holds ~6 GB of pipeline weights
echo "$MODE: exit $RC in $(( $(date +%s) - T0 )) s"
exit $RC
