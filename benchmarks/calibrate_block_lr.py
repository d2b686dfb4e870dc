"""AdaRound on one SD-2.1 block at several rounding learning rates: does a large fan-in need a
smaller lr? (compress/reconstruct.py `lr_fan_in_ref`.) Random norm-perturbed SD-2.1 UNet,
calibration inputs from its own DDIM trajectories (as calibrate_sd21.py), W8, no fallback; the
block's hard-rounded output MSE relative to RTN on the calibration set and on held-out inputs.

    python benchmarks/calibrate_block_lr.py --out r.json --device cpu --resolution 256 \\
        --block up_blocks.0.upsamplers.0 --iters 250 --lrs 3e-2,1.2e-2,4.8e-3,3e-3
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from _checkout import use_checkout  # noqa: E402

use_checkout()

from calibrate_sd21 import build_unet, calib_set  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--block", default="up_blocks.0.upsamplers.0")
    p.add_argument("--iters", type=int, default=250)
    p.add_argument("--lrs", default="3e-2,1.2e-2,4.8e-3,3e-3", help="comma list of rounding learning rates (one lr for the block)")
    p.add_argument("--trajectories", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)

    from pocketdiff.compress.blocks import Request, build_blocks, capture
    from pocketdiff.compress.quant import dequant, layer_specs
    from pocketdiff.compress.reconstruct import ReconConfig, block_mse, float_weights, layer_inits, reconstruct_block
    from pocketdiff.outputs import write_json

    torch.manual_seed(0)
    t0 = time.time()
    unet, sched, ucfg = build_unet("sd21", args.resolution, 0, args.device, 0.1)
    calib = calib_set(unet, sched, ucfg, args.trajectories, args.steps, 1, args.device)
    held = calib_set(unet, sched, ucfg, 1, args.steps, 99, args.device)
    found = [b for b in build_blocks(unet) if b.name == args.block]
    if not found:
        p.error(f"--block {args.block}: not a block of the SD-2.1 UNet")
    b = found[0]
    specs = layer_specs(b.layers, {g: unet.get_submodule(g).weight.shape for g in b.layers}, 8, None)
    weights = float_weights(unet, b.layers)
    reqs = [Request(u, inputs=True, output=True) for u in b.units]
    caps = capture(unet, calib, reqs, device=args.device, batch_size=8, store_device=args.device)
    hcaps = capture(unet, held, reqs, device=args.device, batch_size=8, store_device=args.device)
    result = {"benchmark": "calibrate_block_lr", "args": vars(args), "torch": torch.__version__, "block": b.name,
              "fan_in": {g: int(weights[g][0].numel()) for g in b.layers}, "calib_samples": len(calib),
              "holdout_samples": len(held), "setup_s": round(time.time() - t0, 1), "runs": []}
    for lr in [float(x) for x in args.lrs.split(",") if x.strip()]:
        opts = ReconConfig(iters=args.iters, batch_size=args.batch, lr=lr, lr_fan_in_ref=None, fallback=False)
        rtn_res, init = layer_inits(weights, specs, opts, args.device)
        ts = time.time()
        res = reconstruct_block(b, caps, [c.output for c in caps], weights, specs, rtn_res, init, opts, args.device, seed=0)
        targets = [c.output for c in hcaps]
        h_rtn = block_mse(b, hcaps, targets, {g: dequant(*rtn_res[g], specs[g]) for g in b.layers}, args.device)
        h = block_mse(b, hcaps, targets, {g: dequant(v.codes, v.scale, specs[g]) for g, v in res.layers.items()}, args.device)
        row = {"lr": lr, "calib_ratio_vs_rtn": res.stats["mse_recon_calib"] / res.stats["mse_rtn_calib"],
               "holdout_ratio_vs_rtn": h / h_rtn, "soft_fraction": res.stats.get("soft_fraction"), "wall_s": round(time.time() - ts, 1)}
        result["runs"].append(row)
        print(f"[calibrate_block_lr] {b.name} lr {lr:g}: {row['calib_ratio_vs_rtn']:.3f}x RTN "
              f"(held-out {row['holdout_ratio_vs_rtn']:.3f}x), soft {row['soft_fraction']:.3f}", flush=True)
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
