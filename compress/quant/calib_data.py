"""Timestep-aware calibration data (Q-Diffusion): the UNet inputs of the model's own sampler.

`collect_unet_inputs` runs the sampler the model samples with on the given prompt embeddings:
`pocketdiff.sampling.ddim_sample`, or `consistency_sample` for a consistency (LCM) student (its
scheduler an LCMScheduler: the LCM grid's timesteps and the re-noised latents the student sees),
and records, through its `callback`, the UNet inputs at `per_trajectory` steps spread evenly
over each trajectory: latents, timesteps, the conditioning's fields (prompt embeddings, and a
family's pooled embeddings / time ids; conditional and unconditional both under classifier-free
guidance), the guidance embedding of a w-conditioned student and
class labels when the UNet has a class embedding. A consistency student runs without
classifier-free guidance, as it samples: w through its embedding, or none (guidance folded in).
The set's meta names the sampler ("ddim" / "consistency") and the trajectory's timesteps.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch

from pocketdiff.conditioning import Conditioning, as_conditioning
from pocketdiff.consistency_sampling import is_consistency_scheduler, scheduler_lcm_timesteps
from pocketdiff.errors import PocketdiffError
from pocketdiff.sampling import consistency_sample, default_w_embedding_fn, ddim_sample, randn_latents, scheduler_timesteps

from .blocks import CONDITIONING_KEYS, CalibSet


def trajectory_indices(steps: int, per_trajectory: int) -> list[int]:
    """`per_trajectory` step indices spread evenly over 0..steps-1 (all steps when 0 or >= steps)."""
    if steps < 1:
        raise PocketdiffError(f"calibration sampler steps must be >= 1, got {steps}")
    if per_trajectory <= 0 or per_trajectory >= steps:
        return list(range(steps))
    return sorted(set(np.linspace(0, steps - 1, per_trajectory).round().astype(int).tolist()))


def has_class_embedding(unet) -> bool:
    return getattr(unet, "class_embedding", None) is not None


def calibration_sampler(scheduler) -> str:
    """The sampler calibration follows: "consistency" under diffusers' LCMScheduler, else "ddim"."""
    return "consistency" if is_consistency_scheduler(scheduler) else "ddim"


def sampler_timesteps(scheduler, steps: int) -> list[int]:
    """The timesteps of a `steps`-step trajectory of `calibration_sampler(scheduler)` (descending)."""
    if calibration_sampler(scheduler) == "consistency":
        return [int(t) for t in scheduler_lcm_timesteps(scheduler, steps)]
    return [int(t) for t in scheduler_timesteps(scheduler, steps).tolist()]


@torch.no_grad()
def collect_unet_inputs(
    unet,
    scheduler,
    cond_emb: Union[Conditioning, torch.Tensor],
    uncond_emb: Union[Conditioning, torch.Tensor, None],
    *,
    steps: int,
    guidance_scale: float,
    latent_shape: Sequence[int],
    seed: int,
    per_trajectory: int = 0,
    batch_size: int = 16,
    class_label: Optional[int] = None,
    store_dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> CalibSet:
    """Sample one trajectory per row of `cond_emb` (a `Conditioning` of P rows, or prompt embeddings
    [P, L, D]); trajectory i starts from noise of
    ``torch.Generator("cpu").manual_seed(seed + i)``. Returns the recorded UNet inputs (CPU)."""
    cond_emb, uncond_emb = as_conditioning(cond_emb), as_conditioning(uncond_emb)
    P = cond_emb.batch_size
    if P == 0:
        raise PocketdiffError("calibration needs at least one prompt (got zero)")
    device = cond_emb.device
    sampler = calibration_sampler(scheduler)
    timesteps = sampler_timesteps(scheduler, steps)
    keep = set(trajectory_indices(steps, per_trajectory))
    w_fn = default_w_embedding_fn(unet)
    consistency = sampler == "consistency"
    use_cfg = not consistency and w_fn is None and uncond_emb is not None and float(guidance_scale) != 1.0
    lcm_w = float(guidance_scale) if w_fn is not None else 1.0  # a folded consistency student: one pass, no w
    if has_class_embedding(unet) and class_label is None:
        raise PocketdiffError("the UNet has a class embedding: set calib.class_label (the class fed during sampling)")
    if consistency and has_class_embedding(unet):
        raise PocketdiffError("a consistency (LCMScheduler) student with a class embedding: its sampler feeds no class "
                              "labels, so calibration cannot follow it")
    rec: dict[str, list] = {"sample": [], "timestep": [], **{k: [] for k in CONDITIONING_KEYS.values()}, "timestep_cond": [],
                            "class_labels": []}
    step_of: list[int] = []
    for start in range(0, P, batch_size):
        end = min(P, start + batch_size)
        B = end - start
        gens = [torch.Generator("cpu").manual_seed(int(seed) + i) for i in range(start, end)]
        noise = randn_latents((B, *latent_shape), gens, device)
        cond = cond_emb[start:end]
        uncond = None
        if uncond_emb is not None:
            uncond = uncond_emb[start:end] if uncond_emb.batch_size == P else uncond_emb
        n_rows = 2 * B if use_cfg else B
        extra = {}
        labels = None
        if class_label is not None and has_class_embedding(unet):
            labels = torch.full((n_rows,), int(class_label), device=device, dtype=torch.long)
            extra["class_labels"] = labels
        tcond = None
        if w_fn is not None:
            tcond = w_fn(torch.full((B,), float(guidance_scale), dtype=torch.float32)).to(device)

        def callback(i, t, x_in, t_batch, emb):
            if i not in keep:
                return
            rec["sample"].append(x_in.detach().to("cpu", store_dtype))
            rec["timestep"].append(t_batch.detach().cpu())
            for name, v in emb.tensors().items():
                rec[CONDITIONING_KEYS[name]].append(v.detach().to("cpu", store_dtype))
            if tcond is not None:
                rec["timestep_cond"].append(tcond.detach().to("cpu", store_dtype))
            if labels is not None:
                rec["class_labels"].append(labels.detach().cpu())
            step_of.extend([i] * x_in.shape[0])

        if consistency:  # the student's own steps: noise of step i > 0 from the trajectory's generator, as `generate`
            consistency_sample(unet, scheduler, cond, noise, steps, lcm_w, gens, callback=callback)
        else:
            ddim_sample(unet, scheduler, cond, uncond, steps=steps, guidance_scale=guidance_scale, latents=noise,
                        extra_unet_kwargs=extra, callback=callback, progress=progress)
    if not rec["sample"]:
        raise PocketdiffError("calibration recorded zero UNet inputs")
    out = {k: torch.cat(v) for k, v in rec.items() if v}
    calib = CalibSet(**out, meta={"steps": steps, "guidance_scale": lcm_w if consistency else float(guidance_scale),
                                  "cfg": use_cfg, "prompts": P, "step_indices": sorted(keep), "sampler": sampler,
                                  "timesteps": timesteps})
    bad = [k for k, v in calib.tensors().items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise PocketdiffError(f"calibration inputs contain NaN/inf ({', '.join(bad)}): the model diverges while sampling")
    calib.meta["step_of"] = step_of
    return calib


def subsample(calib: CalibSet, max_samples: Optional[int]) -> CalibSet:
    """At most `max_samples` rows, evenly spaced (keeps the spread over timesteps and prompts)."""
    n = len(calib)
    if not max_samples or n <= max_samples:
        return calib
    idx = torch.from_numpy(np.linspace(0, n - 1, max_samples).round().astype(np.int64))
    out = calib.select(idx)
    if "step_of" in calib.meta:
        out.meta["step_of"] = [calib.meta["step_of"][i] for i in idx.tolist()]
    return out
