"""`pocketdiff distill-decoder`: a norm-free VAE decoder distilled from the user's decoder.

1. load the user's VAE (AutoencoderKL folder or pipeline folder) and captioned images; the first
   `data.max_samples` items of the seed's shuffle train, the next `holdout` items are held out
2. encode every image once (posterior mean and std); with `samples.pipeline`, also generate latents with that
   pipeline (the teacher or a distilled student) for the training captions: what users decode
3. fold the up path's GroupNorms into per-channel affines with statistics pooled over
   `calibration_images` training latents (pocketdiff/normfree.py)
4. fine-tune the folded decoder to the original decoder's outputs on posterior samples (MSE),
   with the project's loop (progress bar, logs.jsonl, checkpoints, `--resume latest`)
5. held-out PSNR of the folded decoder before and after the fine-tune against the whole decode
   (the same latents), a side-by-side page, and OUTPUT/vae: a stock diffusers AutoencoderKL folder
   (the user's encoder, the folded decoder) that `export` takes as `model.vae`
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from pocketdiff.config import DataConfig
from pocketdiff.data import ImageCaptionDataset, InMemoryImageCaptionDataset, collate, load_captioned_dataset
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.models import build_vae, count_params, load_vae, vae_scale_factor
from pocketdiff.normfree import calibrate_group_stats, fold_group_norms, up_path_norm_names
from pocketdiff.report import img, plot_curves, save_grid, table, write_page

from .loop import BatchRandom, LoopConfig, make_accelerator, train_loop

STUDENTS = ("norm_free",)
HELD_SAMPLES = 64  # held-out captions whose generated latents the report measures (samples.pipeline)


@dataclasses.dataclass
class SamplesConfig:
    """Latents a pipeline generates, trained on beside the images' posteriors (a decoder distilled on encoded
    images alone decodes a generator's latents worse: docs/MEASUREMENTS.md)."""

    pipeline: Optional[str] = None  # a pipeline folder (the teacher or a distilled student) whose VAE is `vae`; null: images only
    count: int = 512  # generated for the first `count` training captions (and up to HELD_SAMPLES held-out captions for the report)
    steps: int = 16
    guidance_scale: float = 3.0
    batch_size: int = 64

    def __post_init__(self) -> None:
        require(self.count >= 1, "samples.count", f"must be >= 1, got {self.count}")
        require(self.steps >= 1, "samples.steps", f"must be >= 1, got {self.steps}")
        require(self.batch_size >= 1, "samples.batch_size", f"must be >= 1, got {self.batch_size}")


@dataclasses.dataclass
class Config:
    seed: int = 0
    vae: Optional[str] = None  # the user's VAE: AutoencoderKL folder or pipeline folder
    arch: Optional[str] = None  # no vae: a built random VAE of this arch (smoke, tests)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    holdout: int = 64  # items after the first data.max_samples of the shuffle: held out for PSNR
    student: str = "norm_free"
    calibration_images: int = 256  # training latents whose pooled statistics the fold uses
    train: LoopConfig = dataclasses.field(default_factory=LoopConfig)
    report_images: int = 8
    samples: SamplesConfig = dataclasses.field(default_factory=SamplesConfig)

    def __post_init__(self) -> None:
        require((self.vae is None) != (self.arch is None), "vae", "give exactly one of vae (a folder) and arch (a built random VAE)")
        require(self.student in STUDENTS, "student", f"must be one of {STUDENTS}, got {self.student!r}")
        require(self.data.max_samples is not None, "data.max_samples",
                "must be set: the training items (the next `holdout` items of the shuffle are held out)")
        require(self.holdout >= 1, "holdout", f"must be >= 1, got {self.holdout}")
        require(self.calibration_images >= 1, "calibration_images", f"must be >= 1, got {self.calibration_images}")
        require(self.report_images >= 1, "report_images", f"must be >= 1, got {self.report_images}")


class _Latents(torch.utils.data.Dataset):
    def __init__(self, mean: torch.Tensor, std: torch.Tensor):
        self.mean, self.std = mean, std

    def __len__(self) -> int:
        return self.mean.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"mean": self.mean[i], "std": self.std[i]}


def _collate(items: list[dict]) -> dict:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


class _Decoder(torch.nn.Module):
    """What the loop trains: the student VAE's post_quant_conv and decoder (unscaled latents -> [-1, 1])."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae
        vae.requires_grad_(False)
        vae.decoder.requires_grad_(True)
        if getattr(vae, "post_quant_conv", None) is not None:
            vae.post_quant_conv.requires_grad_(True)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z).sample


def _images(cfg: Config) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """([N, 3, r, r] training images, [holdout, 3, r, r] held-out images) in [-1, 1], and their captions."""
    n = int(cfg.data.max_samples)
    ds = load_captioned_dataset(dataclasses.replace(cfg.data, max_samples=n + cfg.holdout))
    if len(ds) < n + cfg.holdout:
        raise PocketdiffError(f"data: {len(ds)} items, fewer than data.max_samples={n} + holdout={cfg.holdout}")
    items = InMemoryImageCaptionDataset(ImageCaptionDataset(ds))
    batch = collate([items[i] for i in range(len(ds))])
    x, text = batch["pixel_values"].float(), list(batch["text"])
    return x[:n], x[n:], text[:n], text[n:]


def generated_latents(cfg: Config, captions: list, like: torch.Tensor) -> torch.Tensor:
    """[len(captions), C, h, w] unscaled latents that `samples.pipeline` generates for `captions` (seeded by
    cfg.seed); refused when its latents are not the shape of `like`'s (another VAE, another resolution)."""
    from pocketdiff.models import load_pipeline
    from pocketdiff.sampling import generate

    s = cfg.samples
    pipe = load_pipeline(s.pipeline)
    z = generate(pipe, captions, steps=s.steps, guidance_scale=s.guidance_scale, seed=cfg.seed, resolution=cfg.data.resolution,
                 output_type="latent", batch_size=s.batch_size, progress=True)
    if tuple(z.shape[1:]) != tuple(like.shape[1:]):
        raise PocketdiffError(f"samples.pipeline: {s.pipeline} generates latents {tuple(z.shape[1:])}, the VAE {cfg.vae} "
                              f"encodes {tuple(like.shape[1:])} at data.resolution={cfg.data.resolution}")
    return z / float(pipe.vae.config.scaling_factor)


@torch.no_grad()
def _encode(vae, x: torch.Tensor, batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    means, stds = [], []
    for i in range(0, x.shape[0], batch):
        d = vae.encode(x[i:i + batch]).latent_dist
        means.append(d.mean)
        stds.append(d.std)
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def decode01(vae, z: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """[N, 3, H, W] images in [0, 1] (clamped) from unscaled latents."""
    return torch.cat([(vae.decode(z[i:i + batch]).sample * 0.5 + 0.5).clamp(0, 1) for i in range(0, z.shape[0], batch)])


def _mean_min(v: np.ndarray) -> dict:
    return {"mean": round(float(v.mean()), 3), "min": round(float(v.min()), 3)}


def psnr_per_image(ref: torch.Tensor, out: torch.Tensor) -> np.ndarray:
    mse = ((ref.double() - out.double()) ** 2).flatten(1).mean(1).clamp_min(1e-12)
    return (10.0 * torch.log10(1.0 / mse)).numpy()


def _with_samples(mean: torch.Tensor, std: torch.Tensor, generated: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The posteriors and the generated latents (std 0: used as they are) in one seeded random order, so that
    the fold's calibration latents (the first ones) mix both in proportion."""
    order = torch.randperm(mean.shape[0] + generated.shape[0], generator=torch.Generator().manual_seed(seed))
    return torch.cat([mean, generated])[order], torch.cat([std, torch.zeros_like(generated)])[order]


def fold_student(teacher, latents: torch.Tensor, calibration_images: int, batch: int = 64):
    """A copy of `teacher` with its up path folded on the statistics of the first `calibration_images` latents."""
    student = copy.deepcopy(teacher)
    names = up_path_norm_names(student)
    calib = latents[:calibration_images]
    stats = calibrate_group_stats(student, [calib[i:i + batch] for i in range(0, calib.shape[0], batch)], names)
    fold_group_norms(student, stats)
    return student, names


def _side_by_side(out: Path, x: torch.Tensor, whole: torch.Tensor, folded: torch.Tensor, tuned: torch.Tensor) -> str:
    n = x.shape[0]
    rows = []
    for i in range(n):
        rows += [(x[i] * 0.5 + 0.5).clamp(0, 1), whole[i], folded[i], tuned[i]]
    labels = [s for _ in range(n) for s in ("image", "whole decoder", "folded", "fine-tuned")]
    save_grid(torch.stack(rows), out / "side_by_side.png", ncols=4, labels=labels, cell=128)
    return "side_by_side.png"


def run(cfg: Config, output_dir: Path, resume: Optional[str] = None) -> dict:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    teacher = load_vae(cfg.vae) if cfg.vae else build_vae(cfg.arch, cfg.data.resolution, cfg.seed)
    teacher = teacher.float().eval().requires_grad_(False)
    factor = vae_scale_factor(teacher)
    require(cfg.data.resolution % factor == 0, "data.resolution", f"must be a multiple of the VAE's factor {factor}")
    x_train, x_held, text_train, text_held = _images(cfg)
    mean, std = _encode(teacher, x_train)
    held = {"images": _encode(teacher, x_held)[0]}  # held-out latents: the images' posterior means (and generated ones)
    if cfg.samples.pipeline:  # one pipeline load, one sampling run: the training captions', then the held-out ones'
        train_text = text_train[:cfg.samples.count]
        z = generated_latents(cfg, train_text + text_held[:HELD_SAMPLES], mean)
        mean, std = _with_samples(mean, std, z[:len(train_text)], cfg.seed)
        held["samples"] = z[len(train_text):]
    student, names = fold_student(teacher, mean, cfg.calibration_images)
    whole = {k: decode01(teacher, z) for k, z in held.items()}
    folded = {k: decode01(student, z) for k, z in held.items()}
    whole_held, folded_held = whole["images"], folded["images"]

    def loss_fn(model, batch, rng: BatchRandom):
        mean, std = batch["mean"].to(rng.device), batch["std"].to(rng.device)  # on a CPU run the batch stays on the host
        z = mean + std * rng.randn(*mean.shape[1:])
        with torch.no_grad():
            target = teacher.decode(z).sample
        return F.mse_loss(model(z).float(), target.float())

    acc = make_accelerator(cfg.train, out)
    teacher.to(acc.device)  # the targets are decoded where the student trains
    model = _Decoder(student)
    result = train_loop(cfg.train, model=model, loss_fn=loss_fn, dataset=_Latents(mean, std), collate=_collate,
                        ckpt_dir=out / "checkpoints" / "decoder", seed=cfg.seed, resume=resume, desc="decoder",
                        log_path=out / "logs.jsonl", accelerator=acc)
    student.eval().requires_grad_(False).to("cpu")
    teacher.to("cpu")
    tuned = {k: decode01(student, z) for k, z in held.items()}
    tuned_held = tuned["images"]
    vae_dir = out / "vae"
    student.save_pretrained(str(vae_dir), safe_serialization=True)

    psnr = {"folded": psnr_per_image(whole_held, folded_held), "fine_tuned": psnr_per_image(whole_held, tuned_held)}
    images01 = (x_held * 0.5 + 0.5).clamp(0, 1)
    report = {
        "vae_dir": str(vae_dir), "student": cfg.student, "source": cfg.vae or f"built:{cfg.arch}",
        "folded_norms": len(names), "params": count_params(student.decoder), "factor": factor,
        "latent_channels": int(teacher.config.latent_channels),
        "data": {"source": cfg.data.source, "train_items": int(x_train.shape[0]), "held_out_items": int(x_held.shape[0]),
                 "train_latents": int(mean.shape[0]),  # the items' posteriors and the generated latents
                 "resolution": cfg.data.resolution},
        "steps": result.steps, "final_loss": result.final_loss, "stopped_early": result.stopped_early,
        "held_out_psnr_db": {k: _mean_min(v) for k, v in psnr.items()},  # against the whole decode of the same latents (posterior means)
        "samples": dataclasses.asdict(cfg.samples) if cfg.samples.pipeline else None,
        "held_out_samples_psnr_db": {  # the same on latents generated for held-out captions
            "folded": _mean_min(psnr_per_image(whole["samples"], folded["samples"])),
            "fine_tuned": _mean_min(psnr_per_image(whole["samples"], tuned["samples"]))} if "samples" in held else None,
        "reconstruction_psnr_db": {  # against the images themselves: what the VAE itself loses
            "whole": round(float(psnr_per_image(images01, whole_held).mean()), 3),
            "fine_tuned": round(float(psnr_per_image(images01, tuned_held).mean()), 3)},
        "losses": result.losses,
    }
    k = min(cfg.report_images, x_held.shape[0])
    grid = _side_by_side(out, x_held[:k], whole_held[:k], folded_held[:k], tuned_held[:k])
    plot_curves({"decoder": result.losses}, out / "loss.png", "step", "MSE to the whole decoder", "fine-tune loss", logy=True)
    rows = [[k2, v["mean"], v["min"]] for k2, v in report["held_out_psnr_db"].items()]
    rows += [[f"{k2}, generated latents", v["mean"], v["min"]] for k2, v in (report["held_out_samples_psnr_db"] or {}).items()]
    write_page(out / "index.html", "pocketdiff distill-decoder", [
        ("Held-out PSNR against the whole decoder (dB)", table(["decoder", "mean", "min"], rows)),
        ("Held-out images: image, whole decoder, folded (before fine-tune), fine-tuned", img(grid)),
        ("Loss", img("loss.png")),
    ], {k2: v for k2, v in report.items() if k2 != "losses"})
    return report
