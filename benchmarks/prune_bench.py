"""Structured pruning on a UNet architecture: size, MACs, latency and memory before / after,
measured side by side in one run, plus the cost of pruning itself.

    python benchmarks/prune_bench.py --out result.json [--arch sd21] [--device cuda]
        [--ratio 0.3] [--min-weight-params 5000000] [--importance l1|l2|taylor|random]
        [--groupnorm whole_groups|per_group] [--batch 2] [--resolution 512] [--dtype fp16]

Random weights (diffusers initialisation, norm affines perturbed: identity ones measure a converter artefact);
`--importance taylor` accumulates gradients on synthetic latents / text embeddings (the
cost is what is measured here, not the choice). Quick check on CPU: `--arch tiny`.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _checkout import use_checkout  # noqa: E402

use_checkout()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(unet, inputs, device, iters: int, warmup: int) -> dict:
    x, t, cond = inputs
    with torch.no_grad():
        for _ in range(warmup):
            unet(x, t, **cond.unet_kwargs())
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            unet(x, t, **cond.unet_kwargs())
            _sync(device)
            times.append(time.perf_counter() - t0)
    out = {"median_s": statistics.median(times), "min_s": min(times), "iters": iters, "times_s": times}
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="tiny", choices=["tiny", "small", "sd15", "sd21"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--min-weight-params", type=int, default=None, help="target convs with at least this many weights (default: all ResNet convs)")
    ap.add_argument("--importance", default="l1")
    ap.add_argument("--groupnorm", default="whole_groups", choices=["whole_groups", "per_group"])
    ap.add_argument("--allocation", default="uniform", choices=["uniform", "global"])
    ap.add_argument("--round-to", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2, help="UNet batch (2 = classifier-free guidance)")
    ap.add_argument("--resolution", type=int, default=None, help="pixels (default: the arch's own)")
    ap.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"], help="default: fp16 on cuda, fp32 on cpu")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--taylor-samples", type=int, default=8)
    args = ap.parse_args(argv)

    from diffusers import DDIMScheduler, UNet2DConditionModel

    from pocketdiff.compress.prune.targets import layer_profile
    from pocketdiff.conditioning import Conditioning
    from pocketdiff.compress.prune.config import PruneSettings, TargetConfig
    from pocketdiff.compress.prune.pruning import macs_table, prune_unet
    from pocketdiff.compress.prune.importance import accumulate_diffusion_gradients
    from pocketdiff.compress.prune.model import load_pruned_unet
    from pocketdiff.models import (count_params, default_resolution, perturb_norm_affines, scheduler_config, unet_config, vae_config,
                                   vae_scale_factor)
    from pocketdiff.outputs import write_json

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype or ("fp16" if device.type == "cuda" else "fp32")]
    iters = args.iters or (20 if device.type == "cuda" else 3)
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)
    pt = "v_prediction" if args.arch == "sd21" else "epsilon"
    res = args.resolution or default_resolution(args.arch, "epsilon")
    conf = unet_config(args.arch, pt, res, vae_factor=vae_scale_factor(vae_config(args.arch)))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    unet = UNet2DConditionModel(**conf).eval()
    perturb_norm_affines(unet, 0)
    build_s = time.perf_counter() - t0

    settings = PruneSettings(ratio=args.ratio, importance=args.importance, groupnorm=args.groupnorm,
                             allocation=args.allocation, round_to=args.round_to,
                             targets=TargetConfig(min_weight_params=args.min_weight_params))
    side = conf["sample_size"]
    g = torch.Generator().manual_seed(0)
    inputs_cpu = (torch.randn(args.batch, conf["in_channels"], side, side, generator=g),
                  torch.full((args.batch,), 500, dtype=torch.long),
                  Conditioning(torch.randn(args.batch, 77, conf["cross_attention_dim"], generator=g)))

    grad_info = {}

    def gradient_fn(work, params):
        work.to(device)
        sched = DDIMScheduler(**scheduler_config(pt))
        gen = torch.Generator().manual_seed(1)
        n = args.taylor_samples
        bs = min(args.batch, n)
        batches = ((torch.randn(bs, conf["in_channels"], side, side, generator=gen).to(device),
                    Conditioning(torch.randn(bs, 77, conf["cross_attention_dim"], generator=gen)).to(device)) for _ in range((n + bs - 1) // bs))
        t1 = time.perf_counter()
        grad_info.update(accumulate_diffusion_gradients(work, sched, batches, n, params, gen))
        _sync(device)
        grad_info["seconds"] = time.perf_counter() - t1

    t0 = time.perf_counter()
    pruned, plan = prune_unet(unet, settings, gradient_fn=gradient_fn)
    prune_s = time.perf_counter() - t0

    prof_b, prof_a = layer_profile(unet), layer_profile(pruned)
    macs = macs_table(prof_b, prof_a, plan["targeted"])
    tb = sum(prof_b[n].params for n in plan["targeted"])
    ta = sum(prof_a[n].params for n in plan["targeted"])

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        pruned.save_pretrained(tmp)
        save_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in Path(tmp).iterdir())
        t0 = time.perf_counter()
        load_pruned_unet(tmp)
        load_s = time.perf_counter() - t0

    inputs = tuple(x.to(device) for x in inputs_cpu)
    inputs = (inputs[0].to(dtype), inputs[1], inputs[2].to(dtype=dtype))
    unet, pruned = unet.to(device), pruned.to(device)
    if dtype != torch.float32:
        unet, pruned = unet.to(dtype), pruned.to(dtype)
    # side by side, alternating, so drift (clocks, other load) hits both
    lat = {"before": [], "after": []}
    for r in range(3):
        lat["before"].append(time_forward(unet, inputs, device, iters, warmup if r == 0 else 1))
        lat["after"].append(time_forward(pruned, inputs, device, iters, warmup if r == 0 else 1))
    with torch.no_grad():
        out_b = unet(*inputs[:2], **inputs[2].unet_kwargs()).sample.float()
        out_a = pruned(*inputs[:2], **inputs[2].unet_kwargs()).sample.float()
    med = {k: statistics.median(t for r in v for t in r["times_s"]) for k, v in lat.items()}

    result = {
        "arch": args.arch, "resolution": res, "latent": side, "batch": args.batch, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
        "settings": {"ratio": args.ratio, "importance": args.importance, "groupnorm": args.groupnorm, "allocation": args.allocation,
                     "round_to": args.round_to, "min_weight_params": args.min_weight_params},
        "params_before": count_params(unet), "params_after": count_params(pruned),
        "targeted_convs": len(plan["targeted"]), "targeted_conv_params_before": tb, "targeted_conv_params_after": ta,
        "targeted_removed_fraction": 1 - ta / max(tb, 1),
        "macs_per_sample": {k: v for k, v in macs.items() if k != "per_conv"},
        "largest_targeted_convs": sorted(({"name": c["name"], "params_before": c["params_before"], "params_after": c["params_after"],
                                           "macs_before": c["macs_before"], "macs_after": c["macs_after"]}
                                          for c in macs["per_conv"] if c["targeted"]), key=lambda c: -c["params_before"])[:8],
        "groups": [{k: v for k, v in gp.items() if k not in ("keep", "scores")} for gp in plan["groups"]],
        "latency_s": {"before": med["before"], "after": med["after"], "speedup": med["before"] / med["after"],
                      "peak_mem_gib": {k: max(r.get("peak_mem_gib", 0.0) for r in v) for k, v in lat.items()}, "runs": lat},
        "untrained_output_relative_mse": float(((out_a - out_b) ** 2).mean() / (out_b ** 2).mean()),
        "seconds": {"build": build_s, "prune": prune_s, "save": save_s, "load": load_s},
        "taylor_gradients": grad_info or None,
        "pruned_folder_bytes": size,
        "note": "random weights; latency is one UNet forward at the given batch; quality needs trained weights + recovery",
    }
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("arch", "params_before", "params_after", "targeted_removed_fraction", "latency_s")},
                     indent=1, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
