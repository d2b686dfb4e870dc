"""Block-reconstruction PTQ speed and error on an SD-2.1-size UNet with random weights.

    python benchmarks/calibrate_sd21.py --out result.json [--arch sd21] [--device cuda]
    python benchmarks/calibrate_sd21.py --out tiny.json --arch tiny --device cpu   # quick check
    python benchmarks/calibrate_sd21.py --out sdxl.json --arch sdxl   # SDXL base's UNet at 1024 px (128x128 latents)

An SDXL-family arch (`sdxl`, `tiny_xl`, `small_xl`) is conditioned as StableDiffusionXLPipeline conditions it: random
text embeddings of both encoders' width, a random pooled embedding, and the time ids of its resolution (original =
target size, crop (0, 0)). The product's own path at SDXL size (`pocketdiff calibrate` on a saved SDXL folder) is
scripts/gpu/sdxl_size.sh with configs/sdxl/calibrate_smoke.yaml.

What it measures (JSON):
- `activations`: per-block output std / max-abs on the calibration inputs (random weights
  with perturbed norm affines must keep them realistic: no fp16-range blow-up);
- `timing`: seconds per optimisation iteration of every block (after warm-up) at the given
  batch, precision and compile settings, their sum over the UNet, the capture-pass cost, and
  the projected whole-UNet wall time for each iteration count of `--iters`;
- `sweep`: for representative blocks (or `--blocks all|name,name`), reconstruction error
  against iterations: block-output MSE of RTN (max-abs), RTN at the searched scale, and
  AdaRound after N iterations (hard rounding), plus wall time and the fraction of weights
  still soft;
- `full` (with `--full-iters N`): a real whole-UNet calibration through
  `pocketdiff.compress.quant.reconstruct.reconstruct_unet` (sequential mode by default): measured
  wall time, peak GPU memory (whole and per block) and held-out UNet cosine and NMSE of RTN and
  of the reconstruction; `--stream` streams it per block, `--memory-cap-gib` caps the process
  (torch.cuda.set_per_process_memory_fraction), `--reference RESULT.json` compares its error with
  an earlier run's `full` section (same model, data and seeds: the defaults of this script).

Calibration inputs come from the production path: DDIM trajectories of the (random) UNet
recorded by `collect_unet_inputs`, with random text embeddings (cond + uncond).
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from _checkout import use_checkout  # noqa: E402

use_checkout()

from pocketdiff.archs import ARCHS, default_resolution  # noqa: E402


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def build_unet(arch: str, resolution: int, seed: int, device, norm_scale: float):
    from diffusers import DDIMScheduler, UNet2DConditionModel

    from pocketdiff.models import perturb_norm_affines, scheduler_config, unet_config

    cfg = unet_config(arch, "epsilon", resolution)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**cfg)
    perturb_norm_affines(unet, seed, scale=norm_scale)
    unet.to(device).eval().requires_grad_(False)
    return unet, DDIMScheduler(**scheduler_config("epsilon")), cfg


def calib_set(unet, scheduler, cfg, trajectories: int, steps: int, seed: int, device, guidance: float = 3.0,
              pixels: int | None = None):
    """Calibration inputs from DDIM trajectories with random text conditioning: every field of the UNet family's
    conditioning drawn (SD: the prompt embeddings, the same draws as before the family seam); SDXL's time ids those
    of `pixels`-square images."""
    from pocketdiff.compress.quant.calib_data import collect_unet_inputs
    from pocketdiff.conditioning import drawn_conditioning

    g = torch.Generator("cpu").manual_seed(seed)
    side = cfg["sample_size"]
    draw = lambda v: torch.randn(v.shape, generator=g)  # noqa: E731
    pixels = pixels or side * 8
    cond = drawn_conditioning(unet, trajectories, draw, pixels).to(device)
    uncond = drawn_conditioning(unet, 1, draw, pixels).to(device)
    return collect_unet_inputs(unet, scheduler, cond, uncond, steps=steps, guidance_scale=guidance,
                               latent_shape=(cfg["in_channels"], side, side), seed=seed, batch_size=8)


@torch.no_grad()
def activation_stats(unet, blocks, calib, device, batch):
    from pocketdiff.compress.quant.blocks import first_tensor, unet_forward

    stats = {b.name: {"std": 0.0, "max_abs": 0.0} for b in blocks if b.kind != "rest"}
    unit_block = {u.name: b.name for b in blocks if b.kind != "rest" for u in b.units}
    handles = []
    acc = {k: [0.0, 0] for k in stats}

    def make(u):
        def hook(m, a, o):
            t = first_tensor(o).float()
            s = stats[unit_block[u.name]]
            s["max_abs"] = max(s["max_abs"], float(t.abs().max()))
            acc[unit_block[u.name]][0] += float((t.double() ** 2).sum())
            acc[unit_block[u.name]][1] += t.numel()
        return hook

    for b in blocks:
        if b.kind == "rest":
            continue
        for u in b.units:
            handles.append(unet.get_submodule(u.exit).register_forward_hook(make(u)))
    try:
        for s in range(0, len(calib), batch):
            unet_forward(unet, calib.batch_kwargs(s, min(len(calib), s + batch), device, torch.float32))
    finally:
        for h in handles:
            h.remove()
    for k, (sq, n) in acc.items():
        stats[k]["std"] = (sq / max(n, 1)) ** 0.5
    return stats


def _params(b) -> int:
    return sum(p.numel() for u in b.units for p in u.module.parameters())


def _channels(b) -> int:
    return max((p.shape[0] for u in b.units for p in u.module.parameters() if p.dim() > 1), default=1)


def pick_blocks(blocks, spec: str, per_sample: dict):
    real = [b for b in blocks if b.kind != "rest"]
    if spec == "all":
        return real
    if spec == "representative":
        # per kind: the block with the most parameters and the one with the most compute
        # (parameters x output positions, e.g. the 64x64 transformer with the largest attention maps)
        chosen = []
        for kind in ("stem", "resnet", "transformer", "downsample", "upsample", "head"):
            cands = [b for b in real if b.kind == kind]
            if not cands:
                continue
            for key in (_params, lambda b: _params(b) * per_sample[b.name]["out"] / max(1, _channels(b))):
                best = max(cands, key=key)
                if best not in chosen:
                    chosen.append(best)
        return chosen
    names = [s.strip() for s in spec.split(",") if s.strip()]
    found = [b for b in real if b.name in names]
    missing = set(names) - {b.name for b in found}
    if missing:
        raise SystemExit(f"unknown blocks: {sorted(missing)}; known: {[b.name for b in real]}")
    return found


def sweep_variants(args, base) -> list[tuple[str, "ReconConfig"]]:
    """(label, ReconConfig) per swept variant: --sweep-variants, else one per --sweep-lrs rate, else
    the recipe alone (label ''). Overrides are typed and checked as the verbs' command lines are,
    before any calibration data is built."""
    from pocketdiff.config import with_overrides
    from pocketdiff.errors import ConfigError

    if args.sweep_variants and args.sweep_lrs:
        raise SystemExit("--sweep-variants and --sweep-lrs: give one (a variant can set lr=...)")
    if args.sweep_lrs:
        specs = [f"lr={x.strip()}" for x in args.sweep_lrs.split(",") if x.strip()]
    else:
        specs = [v.strip() for v in (args.sweep_variants or "").split(";")] or [""]
    try:
        return [(spec, with_overrides(base, [x.strip() for x in spec.split(",") if x.strip()])) for spec in specs]
    except ConfigError as e:
        raise SystemExit(f"--sweep-variants: {e}") from None


def compare_with_reference(full: dict, path: str) -> dict:
    """The full run's error next to an earlier run's (same model, data and seeds): the ratios of
    NMSE and of 1 - cosine (reconstruction and RTN); `within_5_percent` when the reconstruction's
    are at most 1.05x the reference's."""
    import json

    ref = json.loads(Path(path).read_text(encoding="utf-8"))["full"]
    ratios = {"nmse_recon": full["unet_nmse_recon"] / ref["unet_nmse_recon"],
              "cosine_gap_recon": (1 - full["unet_cosine_recon"]) / (1 - ref["unet_cosine_recon"]),
              "nmse_rtn": full["unet_nmse_rtn"] / ref["unet_nmse_rtn"],
              "cosine_gap_rtn": (1 - full["unet_cosine_rtn"]) / (1 - ref["unet_cosine_rtn"])}
    return {"reference": {"file": Path(path).name, **{k: ref.get(k) for k in ("devices", "mode", "wall_s", "peak_gpu_memory_gb",
                                                                           "unet_cosine_recon", "unet_nmse_recon",
                                                                           "unet_cosine_rtn", "unet_nmse_rtn")}},
            "vs_reference": {**{k: round(v, 4) for k, v in ratios.items()},
                             "within_5_percent": ratios["nmse_recon"] <= 1.05 and ratios["cosine_gap_recon"] <= 1.05}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="sd21", choices=ARCHS, help="sdxl: SDXL base's UNet (two text widths, pooled embedding, time ids)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--resolution", type=int, default=None, help="pixels (default: 512 for sd15/sd21, the arch's own otherwise)")
    p.add_argument("--bits", type=int, default=8)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--iters", default="0,100,250,500,1000", help="iteration counts of the sweep / projection")
    p.add_argument("--blocks", default="representative", help="representative | all | comma-separated block names")
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--steps", type=int, default=16, help="DDIM steps per trajectory (all recorded, cond + uncond)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--sweep-lrs", default=None,
                   help="comma list: sweep every iteration count at each of these rounding learning rates (default: the recipe's)")
    p.add_argument("--sweep-variants", default=None,
                   help="';'-separated recon overrides, each a comma list of key=value (e.g. 'round_weight=0.001;warmup=0,lr=1e-2'): "
                        "sweep every iteration count under each (an empty variant is the recipe itself)")
    p.add_argument("--lr-fan-in-ref", default=None,
                   help="recon.lr_fan_in_ref: an integer, or none (one learning rate for every layer)")
    p.add_argument("--lr-schedule", default=None, choices=["constant", "cosine"])
    p.add_argument("--round-weight", type=float, default=None)
    p.add_argument("--warmup", type=float, default=None)
    p.add_argument("--autocast", default="auto", choices=["auto", "bf16", "fp16", "off"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile-mode", default=None)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--scale-init", default="mse", choices=["mse", "maxabs"])
    p.add_argument("--no-learn-scale", action="store_true", help="plain AdaRound (scales fixed at their init)")
    p.add_argument("--timing-iters", type=int, default=20, help="timed iterations per block (after warm-up)")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--full-iters", type=int, default=None, help="also run a whole-UNet calibration at this many iterations")
    p.add_argument("--full-mode", default="sequential", choices=["sequential", "independent"])
    p.add_argument("--devices", default="", help="comma list (e.g. cuda:0,cuda:1): independent mode runs one worker per device")
    p.add_argument("--stream", action="store_true", help="recon.stream: pinned host cache, only the block being reconstructed on the GPU")
    p.add_argument("--memory-cap-gib", type=float, default=None, help="cap this process's CUDA memory (set before anything is built)")
    p.add_argument("--reference", default=None, help="an earlier result JSON whose `full` section the full run is compared with")
    p.add_argument("--holdout", type=int, default=64, help="held-out inputs (whole trajectories) for the sweep and the full run")
    p.add_argument("--norm-scale", type=float, default=0.1, help="perturb_norm_affines scale")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def recon_base(args):
    """The recipe every measurement starts from: the recon flags given, the recipe's defaults for the rest."""
    from pocketdiff.compress.quant.block_recon import ReconConfig

    overrides = {k: v for k, v in (("lr", args.lr), ("round_weight", args.round_weight), ("warmup", args.warmup),
                                                   ("lr_schedule", args.lr_schedule)) if v is not None}
    if args.lr_fan_in_ref is not None:
        overrides["lr_fan_in_ref"] = None if args.lr_fan_in_ref.lower() == "none" else int(args.lr_fan_in_ref)
    return ReconConfig(iters=1, batch_size=args.batch, autocast=args.autocast, compile=args.compile,
                       compile_mode=args.compile_mode, channels_last=args.channels_last, scale_init=args.scale_init,
                       learn_scale=not args.no_learn_scale, stream=args.stream, **overrides)


@dataclasses.dataclass
class Run:
    """One benchmark run's state, filled in step by step (main); `result` is the JSON written after every phase."""
    args: argparse.Namespace
    out: Path
    device: torch.device
    cap: Optional[int]  # the process's CUDA memory cap in bytes (--memory-cap-gib)
    resolution: Optional[int]
    result: dict
    # set by the steps (None until then): the recipe and swept variants (start); the UNet, its scheduler and config, the
    # calibration inputs (build_model); the held-out inputs (collect_holdout); the blocks, per-sample bytes, layer specs,
    # swept blocks, float weights, RTN results and initial scales, capture settings, iteration counts (describe_blocks)
    base: Any = None
    variants: Any = None
    t0: float = 0.0
    unet: Any = None
    scheduler: Any = None
    ucfg: Any = None
    calib: Any = None
    held: Any = None
    blocks: Any = None
    per_sample: Any = None
    specs: Any = None
    swept: Any = None
    weights: Any = None
    rtn_res: Any = None
    init_scales: Any = None
    tf32: bool = False
    cap_ac: Any = None
    iters_list: Any = None

    def save(self) -> None:  # after every phase (atomically), so that a run stopped by a time limit keeps what it measured
        from pocketdiff.outputs import write_json

        write_json(self.out, self.result)

    def block_data(self, b, data=None):
        """Block `b`'s captured inputs and outputs on `data` (the calibration set by default), and the capture's seconds."""
        from pocketdiff.compress.quant.block_recon import precision
        from pocketdiff.compress.quant.blocks import Request, capture

        sync(self.device)
        tc = time.time()
        with precision(self.tf32):
            caps = capture(self.unet, data if data is not None else self.calib, [Request(u, inputs=True, output=True) for u in b.units],
                           device=self.device, batch_size=16, store_device=self.device, autocast=self.cap_ac)
        sync(self.device)
        return caps, time.time() - tc

    def timed_block(self, b, caps, opts):
        """reconstruct_block on `caps` with `opts`, synchronised: (its result, its seconds)."""
        from pocketdiff.compress.quant.block_recon import reconstruct_block

        sync(self.device)
        ts = time.time()
        res = reconstruct_block(b, caps, [c.output for c in caps], self.weights, self.specs, self.rtn_res, self.init_scales,
                                opts, self.device)
        sync(self.device)
        return res, time.time() - ts


def start(args) -> Run:
    """Step 1: the device (and its memory cap, before anything is built), the result's header, the recipe and the
    swept variants (bad overrides fail here, before the UNet and its data are built)."""
    device = torch.device(args.device)
    cap = int(args.memory_cap_gib * 2 ** 30) if args.memory_cap_gib else None
    if cap and device.type == "cuda":
        from pocketdiff.device import cap_cuda_memory

        cap_cuda_memory(cap, device)
    resolution = args.resolution or (512 if args.arch in ("sd15", "sd21") else None)
    result: dict = {"args": vars(args), "torch": torch.__version__, "python": platform.python_version(),
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"}
    run = Run(args, Path(args.out), device, cap, resolution, result)
    run.base = recon_base(args)
    run.variants = sweep_variants(args, run.base)
    return run


def build_model(run: Run) -> None:
    """Step 2: the random-weight UNet and the calibration inputs of its DDIM trajectories."""
    args, result = run.args, run.result
    run.t0 = time.time()
    run.unet, run.scheduler, run.ucfg = build_unet(args.arch, run.resolution, args.seed, run.device, args.norm_scale)
    result["unet_params"] = sum(p.numel() for p in run.unet.parameters())
    result["latent_size"] = run.ucfg["sample_size"]
    result["build_s"] = round(time.time() - run.t0, 2)
    t = time.time()
    run.calib = calib_set(run.unet, run.scheduler, run.ucfg, args.trajectories, args.steps, args.seed + 1, run.device,
                          pixels=run.resolution or default_resolution(args.arch))
    sync(run.device)
    result["calibration"] = {"samples": len(run.calib), "collect_s": round(time.time() - t, 2)}
    print(f"{len(run.calib)} calibration inputs in {result['calibration']['collect_s']} s", file=sys.stderr, flush=True)


def describe_blocks(run: Run) -> None:
    """Step 3: the UNet's blocks, their layers' quantisation specs, and the activations on the calibration inputs;
    then the float weights and RTN / initial scales of the layers the later steps reconstruct."""
    from pocketdiff.compress.quant.block_recon import capture_settings, layer_inits
    from pocketdiff.compress.quant.blocks import build_blocks, order_blocks
    from pocketdiff.compress.quant.quantizer import layer_specs
    from pocketdiff.compress.quant.reconstruct import float_weights

    args, result, unet = run.args, run.result, run.unet
    run.blocks = blocks = build_blocks(unet)
    run.per_sample = order_blocks(unet, blocks, run.calib, run.device)
    names = [g for b in blocks for g in b.layers]
    run.specs = layer_specs(names, {g: unet.get_submodule(g).weight.shape for g in names}, args.bits, args.group_size)
    result["blocks"] = [{"name": b.name, "kind": b.kind, "layers": len(b.layers),
                         "params": int(sum(unet.get_submodule(g).weight.numel() for g in b.layers)),
                         "bytes_per_sample": run.per_sample[b.name]} for b in blocks]
    act = activation_stats(unet, blocks, run.calib, run.device, 8)
    result["activations"] = act
    result["activations_max_abs"] = max(v["max_abs"] for v in act.values())
    run.save()

    result["recon_config"] = dataclasses.asdict(run.base)
    run.swept = [] if args.no_sweep else pick_blocks(blocks, args.blocks, run.per_sample)
    if args.no_timing and args.full_iters is None:  # only the swept blocks need scales (the search is slow on a CPU)
        names = [g for b in run.swept for g in b.layers]
    run.weights = float_weights(unet, names)
    run.rtn_res, run.init_scales = layer_inits(run.weights, run.specs, run.base, run.device)
    run.tf32, run.cap_ac = capture_settings(run.base, run.device)
    run.iters_list = [int(x) for x in args.iters.split(",") if x.strip()]


def time_blocks(run: Run) -> None:
    """Step 4 (unless --no-timing): seconds per optimisation iteration of every block, its fixed evaluation cost, the
    capture pass, and the projected whole-UNet wall time per iteration count."""
    args, result, base = run.args, run.result, run.base
    timing = []
    capture_total = 0.0
    for b in run.blocks:
        if b.kind == "rest":
            continue
        caps, tc = run.block_data(b)
        capture_total += tc
        run.timed_block(b, caps, dataclasses.replace(base, iters=3, fallback=True))  # warm-up
        _, total = run.timed_block(b, caps, dataclasses.replace(base, iters=args.timing_iters))
        # reconstruct_block also evaluates 3 candidates (fixed cost): time it with iters=0 via method=rtn
        _, fixed = run.timed_block(b, caps, dataclasses.replace(base, method="rtn", iters=0))
        per_iter = max(0.0, total - fixed) / args.timing_iters
        timing.append({"name": b.name, "kind": b.kind, "s_per_iter": per_iter, "eval_s": fixed, "capture_s": tc})
        result["timing"] = {"blocks": timing, "partial": True}
        run.save()
        print(f"timing {b.name}: {per_iter * 1000:.2f} ms/iter, eval {fixed:.2f} s, capture {tc:.2f} s", file=sys.stderr, flush=True)
        del caps
    s_iter = sum(t["s_per_iter"] for t in timing)
    fixed = sum(t["eval_s"] for t in timing)
    result["timing"] = {
        "blocks": timing,
        "s_per_iter_all_blocks": s_iter,
        "eval_s_all_blocks": fixed,
        "capture_s_all_blocks_independent": capture_total,
        "capture_s_sequential_estimate": 2 * capture_total,
        "projected_wall_s": {str(n): round(n * s_iter + fixed + 2 * capture_total + result["calibration"]["collect_s"], 1)
                             for n in run.iters_list},
    }
    run.save()


def collect_holdout(run: Run) -> None:
    """Step 5: held-out inputs (other prompts and seeds) of the sweep and the full run, collected once (the float UNet
    is never modified)."""
    args = run.args
    if not args.no_sweep or args.full_iters is not None:
        run.held = calib_set(run.unet, run.scheduler, run.ucfg, max(1, args.holdout // (2 * args.steps)), args.steps,
                             args.seed + 99, run.device)
        run.result["holdout_samples"] = len(run.held)


def sweep_rows(run: Run, b) -> list[dict]:
    """Block `b`'s error against iterations, per swept variant: on its calibration inputs and held-out ones."""
    from pocketdiff.compress.quant.block_recon import block_mse
    from pocketdiff.compress.quant.quantizer import dequant

    device, specs = run.device, run.specs
    caps, _ = run.block_data(b)
    hcaps, _ = run.block_data(b, run.held)
    htargets = [c.output for c in hcaps]
    h_rtn = block_mse(b, hcaps, htargets, {g: dequant(*run.rtn_res[g], specs[g]).to(device) for g in b.layers}, device)
    rows = []
    for n, (label, variant) in [(n, v) for n in run.iters_list for v in (run.variants if n > 0 else run.variants[:1])]:
        opts = dataclasses.replace(variant, iters=n, method="adaround" if n > 0 else "rtn", fallback=False)
        res, wall = run.timed_block(b, caps, opts)
        s = res.stats
        row = {"iters": n, "lr": opts.lr, "rounding_lrs": s.get("rounding_lr"), "variant": label, "wall_s": round(wall, 3), "mse_rtn": s["mse_rtn_calib"], "mse_init": s["mse_init_calib"],
               "mse_recon": s["mse_recon_calib"], "target_power": s["target_power"], "soft_fraction": s.get("soft_fraction")}
        row["ratio_vs_rtn"] = row["mse_recon"] / max(row["mse_rtn"], 1e-30)
        h = block_mse(b, hcaps, htargets, {g: dequant(layer.codes, layer.scale, specs[g]).to(device) for g, layer in res.layers.items()}, device)
        row.update(holdout_mse_rtn=h_rtn, holdout_mse_recon=h, holdout_ratio_vs_rtn=h / max(h_rtn, 1e-30))
        rows.append(row)
        print(f"sweep {b.name} iters={n} {label or 'recipe'} lr={opts.lr:g} (per layer {row['rounding_lrs']}): rtn {row['mse_rtn']:.3e} init {row['mse_init']:.3e} recon {row['mse_recon']:.3e} "
              f"({row['ratio_vs_rtn']:.3f}x rtn; held-out {row['holdout_ratio_vs_rtn']:.3f}x) soft {row['soft_fraction']} "
              f"{row['wall_s']:.1f}s", file=sys.stderr, flush=True)
    del caps, hcaps
    return rows


def sweep_blocks(run: Run) -> None:
    """Step 6 (unless --no-sweep): error against iterations on the selected blocks (--blocks)."""
    sweep = []
    for b in run.swept:
        sweep.append({"name": b.name, "kind": b.kind, "rows": sweep_rows(run, b)})
        run.result["sweep"] = sweep
        run.save()
    run.result["sweep"] = sweep


def full_run(run: Run) -> None:
    """Step 7 (with --full-iters): a whole-UNet calibration, its wall time, peak GPU memory and held-out error."""
    import copy

    from pocketdiff.compress.quant.block_recon import LayerResult
    from pocketdiff.compress.quant.blocks import build_blocks
    from pocketdiff.compress.quant.metrics import compare_unets
    from pocketdiff.compress.quant.reconstruct import reconstruct_unet, write_weights

    args, device, unet, specs = run.args, run.device, run.unet, run.specs
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    opts = dataclasses.replace(run.base, iters=args.full_iters, mode=args.full_mode)
    sync(device)
    ts = time.time()
    results, info = reconstruct_unet(unet, run.calib, specs, opts, device=device, seed=args.seed,
                                     devices=[d for d in args.devices.split(",") if d] or None,
                                     log=lambda m: print(m, file=sys.stderr, flush=True), memory_cap_bytes=run.cap)
    sync(device)
    wall = time.time() - ts
    recon_peak = max(info.get("peak_gpu_bytes", 0), torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    q = copy.deepcopy(unet)
    write_weights(q, {g: lr for r in results for g, lr in r.layers.items()}, specs)
    r = copy.deepcopy(unet)
    write_weights(r, {g: LayerResult(c, s, "rtn") for g, (c, s) in info["rtn"].items()}, specs)
    cmp = compare_unets(unet, {"rtn": r, "recon": q}, build_blocks(unet), run.held, device, batch=8)
    full = run.result["full"] = {
        "iters": args.full_iters, "mode": args.full_mode, "devices": args.devices or str(device), "wall_s": round(wall, 2),
        "wall_s_including_collect": round(wall + run.result["calibration"]["collect_s"], 2),
        "peak_gpu_memory_gb": round(max(recon_peak, torch.cuda.max_memory_allocated(device)) / 2 ** 30, 2) if recon_peak else None,
        "reconstruct_peak_gpu_gib": round(recon_peak / 2 ** 30, 2) if recon_peak else None,
        "memory_cap_gib": args.memory_cap_gib, "stream": args.stream, "autocast": args.autocast,
        "unet_cosine_rtn": cmp["unets"]["rtn"]["cosine_mean"], "unet_cosine_recon": cmp["unets"]["recon"]["cosine_mean"],
        "unet_nmse_rtn": cmp["unets"]["rtn"]["nmse"], "unet_nmse_recon": cmp["unets"]["recon"]["nmse"],
        "blocks_improved": sum(1 for v in cmp["blocks"].values() if v["recon"]["mse"] < v["rtn"]["mse"]),
        "blocks": [{"name": res.name, "chosen": res.stats.get("chosen"), "time_s": res.stats.get("time_s"),
                    "peak_gpu_gib": res.stats.get("peak_gpu_gib"), "cache_on_device": res.stats.get("cache_on_device"),
                    "mse_rtn_calib": res.stats.get("mse_rtn_calib"), "mse_recon_calib": res.stats.get("mse_recon_calib"),
                    "mse_rtn": cmp["blocks"].get(res.name, {}).get("rtn", {}).get("mse"),
                    "mse_recon": cmp["blocks"].get(res.name, {}).get("recon", {}).get("mse")} for res in results],
    }
    if args.reference:
        full.update(compare_with_reference(full, args.reference))
    print(f"full: {wall:.1f} s, cosine rtn {full['unet_cosine_rtn']:.6f} recon {full['unet_cosine_recon']:.6f}",
          file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """1. the flags, device and recipe (start); 2. the UNet and its calibration inputs (build_model); 3. its blocks,
    specs and activations (describe_blocks); 4. per-block timing (time_blocks); 5. held-out inputs (collect_holdout);
    6. the error sweep (sweep_blocks); 7. the whole-UNet run (full_run). The result is saved after every phase."""
    args = parse_args(argv)
    run = start(args)
    build_model(run)
    describe_blocks(run)
    if not args.no_timing:
        time_blocks(run)
    collect_holdout(run)
    if not args.no_sweep:
        sweep_blocks(run)
    if args.full_iters is not None:
        full_run(run)
    run.result["total_s"] = round(time.time() - run.t0, 2)
    run.save()
    print(f"wrote {run.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
