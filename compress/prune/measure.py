"""What `pocketdiff prune` measures: teacher-relative error on fixed probes, FD / CLIP through
`pocketdiff.evaluate`'s public API, and the importance plots of the report page."""
from __future__ import annotations

from pathlib import Path

import torch

from pocketdiff.conditioning import Conditioning, encode_conditioning, pixel_size

from .config import Config



@torch.no_grad()
def _encode(pipe, items: list[dict], generator: torch.Generator, device) -> tuple[torch.Tensor, Conditioning]:
    """(latents, the family's `Conditioning` of the items' captions)."""
    from pocketdiff.data import collate

    batch = collate(items)
    x = batch["pixel_values"].to(device)
    dist = pipe.vae.encode(x).latent_dist
    eps = torch.randn(dist.mean.shape, generator=generator).to(device)
    latents = (dist.mean + dist.std * eps) * pipe.vae.config.scaling_factor
    return latents, encode_conditioning(pipe, list(batch["text"]), device, resolution=pixel_size(latents, pipe.vae))


def _calibration_batches(pipe, dataset, n: int, batch_size: int, generator: torch.Generator, device):
    order = torch.randperm(len(dataset), generator=generator).tolist()
    while len(order) < n:
        order += order
    order = order[:n]
    for start in range(0, n, batch_size):
        items = [dataset[i] for i in order[start : start + batch_size]]
        yield _encode(pipe, items, generator, device)


class Probe:
    """Fixed (x_t, t, text) inputs and the teacher's outputs on them: the teacher-relative
    error of a student is mean((s - t)^2) and its ratio to mean(t^2)."""

    def __init__(self, pipe, teacher, dataset, n: int, seed: int, device, batch_size: int = 16, guidance_scale: float = 3.0):
        from pocketdiff.sampling import default_w_embedding_fn

        g = torch.Generator().manual_seed(seed * 31 + 17)
        w_fn = default_w_embedding_fn(teacher)
        T = pipe.scheduler.config.num_train_timesteps
        self.batches = []
        idx = list(range(len(dataset)))[-n:] if n <= len(dataset) else [i % len(dataset) for i in range(n)]
        ts = ((torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=g, dtype=torch.float64)) * T / n).long().clamp(0, T - 1)
        for s in range(0, n, batch_size):
            items = [dataset[i] for i in idx[s : s + batch_size]]
            lat, emb = _encode(pipe, items, g, device)
            noise = torch.randn(lat.shape, generator=g).to(device)
            t = ts[s : s + len(items)].to(device)
            x = pipe.scheduler.add_noise(lat, noise, t)
            kw = {}
            if w_fn is not None:  # guidance-conditioned: the evaluation guidance scale
                kw["timestep_cond"] = w_fn(torch.full((len(items),), float(guidance_scale))).to(device, emb.dtype)
            with torch.no_grad():
                ref = teacher(x, t, **emb.unet_kwargs(), **kw).sample.float()
            self.batches.append((x, t, emb, kw, ref))

    @torch.no_grad()
    def error(self, unet) -> dict:
        if not self.batches:
            return {}
        se, ref2, n = 0.0, 0.0, 0
        for x, t, emb, kw, ref in self.batches:
            out = unet(x, t, **emb.unet_kwargs(), **kw).sample.float()
            se += float(((out - ref) ** 2).sum())
            ref2 += float((ref ** 2).sum())
            n += ref.numel()
        return {"mse_to_teacher": se / n, "relative_mse": se / max(ref2, 1e-12), "samples": sum(b[0].shape[0] for b in self.batches)}


def external_metrics(cfg: Config, pipe, unets: dict, out: Path, device, steps: int = 25, guidance_scale: float = 3.0) -> dict:
    """FD and CLIP score of each named UNet (same pipeline otherwise) through pocketdiff.evaluate."""
    if not cfg.eval.metrics:
        return {"available": False, "reason": "eval.metrics is false"}
    try:
        from pocketdiff.evaluate import MetricConfig, MetricSetup, evaluate_pipelines
    except ImportError as e:
        return {"available": False, "reason": f"pocketdiff.evaluate is not importable: {e}"}
    e = cfg.eval
    mcfg = MetricConfig(fd=True, clip_score=bool(e.clip), features=e.features, clip=e.clip,
                        inception_weights=e.inception_weights, batch_size=e.batch_size)
    setup = MetricSetup(mcfg, cfg.data, device)
    captions = list(setup.reference_captions())
    prompts = [captions[i % len(captions)] for i in range(e.num_samples)]
    models = [{"name": name, "pipe": pipe, "unet": unet} for name, unet in unets.items()]
    results = evaluate_pipelines(models, prompts, [steps], setup, out / "eval", seeds=e.seeds,
                                 guidance_scale=guidance_scale, batch_size=e.batch_size,
                                 resolution=cfg.data.resolution, device=device, grid_prompts=8)
    by_name = {r["model"]: {k: r.get(k) for k in ("fd", "fd_std", "clip_score", "clip_score_std", "features",
                                                   "clip_model_label", "num_samples", "num_seeds", "steps")}
               for r in results}
    res: dict = {"available": True, "results": by_name, "page": "eval/index.html"}
    fd0 = by_name.get("before_pruning", {}).get("fd")
    for key in ("after_pruning", "after_recovery"):
        fd = by_name.get(key, {}).get("fd")
        if fd0 and fd is not None:
            res[f"fd_ratio_{key}"] = fd / fd0
    return res


def plot_importance(plan: list[dict], path: Path, title: str, mode: str = "per_group") -> Path:
    """Left: sorted normalised scores per group; right: histogram of kept vs pruned units
    (whole_groups: one unit = one GroupNorm group, scored by its channels' sum)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=100)
    kept_all, pruned_all = [], []
    for g in plan:
        s = torch.tensor(g["scores"], dtype=torch.float64)
        mask = torch.zeros(len(s), dtype=torch.bool)
        mask[torch.tensor(g["keep"], dtype=torch.long)] = True
        if mode == "whole_groups":
            G = g["groupnorm_groups_before"]
            s = s.reshape(G, -1).sum(1)
            mask = mask.reshape(G, -1).all(1)
        s = s / (float(s.abs().mean()) or 1.0)
        order = torch.argsort(s)
        xs = torch.linspace(0, 1, len(s))
        a1.plot(xs.tolist(), s[order].tolist(), lw=1, alpha=0.7)
        kept_all += s[mask].tolist()
        pruned_all += s[~mask].tolist()
    unit = "GroupNorm groups" if mode == "whole_groups" else "channels"
    a1.set_xlabel(f"rank / {unit} (per ResNet block)")
    a1.set_ylabel("importance / block mean")
    a1.set_title(f"sorted importance of {unit}")
    a1.grid(alpha=0.3)
    if kept_all:
        a2.hist(kept_all, bins=40, alpha=0.6, label=f"kept ({len(kept_all)})")
    if pruned_all:
        a2.hist(pruned_all, bins=40, alpha=0.6, label=f"pruned ({len(pruned_all)})")
    a2.set_xlabel("importance / block mean")
    a2.set_ylabel(unit)
    a2.set_title(title)
    a2.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
