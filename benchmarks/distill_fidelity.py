"""Fidelity of distilled students to their teacher, in latent space, on the same noise and prompts.

For a `pocketdiff distill` output folder: the teacher's classifier-free-guided DDIM at
`--ref-steps` (default 64) is the reference; every round's student at its own step count and
the teacher's DDIM at `--teacher-steps` are compared to it by the mean squared difference of
the final latents (same prompts, same initial noise, same w, the students' DDIM spacing for
every model). No feature network is involved, so it works for any domain and any size; FD /
CLIP score come from `pocketdiff evaluate` (or the run's eval.metrics).

    python benchmarks/distill_fidelity.py --run outputs/distill-openmoji --out fidelity.json --device cuda
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from _checkout import use_checkout  # noqa: E402

use_checkout()


def main(argv=None) -> int:
    from diffusers import DDIMScheduler, UNet2DConditionModel

    from pocketdiff.config import load_config
    from pocketdiff.data import load_captions
    from pocketdiff.models import load_pipeline, vae_scale_factor
    from pocketdiff.outputs import read_json, write_json
    from pocketdiff.sampling import ddim_sample, encode_prompts, randn_latents
    from pocketdiff.train.distill import Config, w_embedding_fn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a pocketdiff distill output folder")
    p.add_argument("--out", required=True)
    p.add_argument("--teacher", default=None, help="teacher pipeline (default: the run's model.pretrained)")
    p.add_argument("--w", type=float, default=None, help="guidance scale (default: the run's guidance.scale)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--ref-steps", type=int, default=64)
    p.add_argument("--teacher-steps", default="32,16,8,4,2,1")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)

    run = Path(args.run)
    cfg = load_config(Config, run / "config.yaml")
    teacher_src = args.teacher or cfg.model.pretrained
    if not teacher_src:
        p.error("the run built a random teacher (model.pretrained: null): pass --teacher")
    w = cfg.guidance.scale if args.w is None else args.w
    device = torch.device(args.device)
    pipe = load_pipeline(teacher_src)
    pipe.to(device)
    prompts = list(dict.fromkeys(load_captions(cfg.data)))[: args.num_prompts]
    first = sorted(run.glob("round-*"), key=lambda f: int(f.name.split("-")[1]))
    if not first:
        p.error(f"{run}: no round folders")
    spacing_sched = DDIMScheduler.from_pretrained(str(first[0] / "scheduler"))
    t_sched = DDIMScheduler.from_config(spacing_sched.config, prediction_type=pipe.scheduler.config.prediction_type)
    side = cfg.data.resolution // vae_scale_factor(pipe)
    ch = pipe.unet.config.in_channels

    # (text embeddings, empty-prompt embeddings, initial noise) per batch: the same for every model and
    # step count, so encoded once
    batches = []
    for s in range(0, len(prompts), args.batch):
        chunk = prompts[s : s + args.batch]
        noise = randn_latents((len(chunk), ch, side, side),
                              [torch.Generator().manual_seed(args.seed + s + i) for i in range(len(chunk))], device)
        batches.append((encode_prompts(pipe, chunk, device), encode_prompts(pipe, [""] * len(chunk), device), noise))

    @torch.no_grad()
    def sample(unet, sched, steps, cfg_guided):
        fn = w_embedding_fn(unet) if not cfg_guided and unet.config.time_cond_proj_dim else None
        outs = []
        for cond, unc, noise in batches:
            outs.append(ddim_sample(unet, sched, cond, unc if cfg_guided else None, steps=steps,
                                    guidance_scale=w if (cfg_guided or fn) else 1.0, latents=noise, w_embedding_fn=fn).cpu())
        return torch.cat(outs)

    t0 = time.time()
    ref = sample(pipe.unet, t_sched, args.ref_steps, True)
    result = {"run": str(run), "teacher_source": teacher_src, "guidance_scale": w, "prompts": len(prompts), "reference_steps": args.ref_steps,
              "timestep_spacing": t_sched.config.timestep_spacing, "reference_variance": float(ref.var()),
              "metric": "mean squared difference of final latents to the teacher's reference", "teacher": {}, "students": {}}
    for n in [int(x) for x in args.teacher_steps.split(",") if x]:
        result["teacher"][str(n)] = float((sample(pipe.unet, t_sched, n, True) - ref).pow(2).mean())
    for folder in first:
        meta = read_json(folder / "distill.json")
        unet = UNet2DConditionModel.from_pretrained(str(folder / "unet")).to(device).eval()
        sched = DDIMScheduler.from_pretrained(str(folder / "scheduler"))
        n = int(meta["num_inference_steps"])
        x = sample(unet, sched, n, False)  # w-conditioned: w through timestep_cond; folded: one pass at w = 1
        result["students"][folder.name] = {"steps": n, "stage": meta["stage"], "mse": float((x - ref).pow(2).mean()),
                                           "teacher_same_steps_mse": result["teacher"].get(str(n))}
    result["seconds"] = time.time() - t0
    write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
