"""`pocketdiff train-teacher`: text-to-image latent diffusion training with Accelerate.

1. load captioned data and build (or load) the pipeline, tokenizer built from the captions
2. train the VAE when the recipe asks for it (tiny models), then fix its latent scaling
3. train the UNet (and the text encoder, optionally) on the diffusion loss, with caption
   dropout for classifier-free guidance, EMA, checkpoints and `--resume latest`
4. save a stock diffusers pipeline folder, a sample grid, the loss curve and a page
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from pocketdiff.conditioning import conditioning_from_ids, family_of, tokenize_prompts, zero_rows, zero_unconditional
from pocketdiff.config import DataConfig
from pocketdiff.data import ImageCaptionDataset, InMemoryImageCaptionDataset, collate, load_captioned_dataset
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.models import ModelConfig, check_resolution, count_params, load_or_build, save_pipeline, vae_scale_factor
from pocketdiff.report import img, plot_curves, save_grid, write_page
from pocketdiff.sampling import generate

from .loop import BatchRandom, LoopConfig, make_accelerator, train_loop, use_ema_weights
from .losses import diffusion_loss


@dataclasses.dataclass
class VaeTrainConfig:
    """Training of a tiny VAE from scratch (steps = 0 keeps the built/loaded VAE as is)."""

    steps: int = 0
    lr: float = 1e-3
    batch_size: int = 32
    kl_weight: float = 1e-6
    checkpoint_every: int = 200
    max_time_s: float = 0.0  # > 0: wall-time budget of the VAE phase (stops with a checkpoint)

    def __post_init__(self) -> None:
        require(self.steps >= 0, "vae.steps", "must be >= 0")
        require(self.max_time_s >= 0, "vae.max_time_s", "must be >= 0")
        require(self.kl_weight >= 0, "vae.kl_weight", "must be >= 0")


@dataclasses.dataclass
class SampleConfig:
    """The fixed prompts and seeds of the sample grid written after training."""

    prompts: list[str] = dataclasses.field(default_factory=list)
    steps: int = 25
    guidance_scale: float = 3.0
    seed: int = 0


@dataclasses.dataclass
class Config:
    seed: int = 0
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: LoopConfig = dataclasses.field(default_factory=LoopConfig)
    vae: VaeTrainConfig = dataclasses.field(default_factory=VaeTrainConfig)
    caption_dropout: float = 0.1
    train_text_encoder: bool = True
    samples: SampleConfig = dataclasses.field(default_factory=SampleConfig)

    def __post_init__(self) -> None:
        require(0.0 <= self.caption_dropout < 1.0, "caption_dropout", f"must be in [0, 1), got {self.caption_dropout}")


class _DiffusionModel(torch.nn.Module):
    """What the optimizer (and DDP) sees: the UNet, plus the text encoders (one per text tower of the model's
    family: two for SDXL) when they are trained.

    The whole prediction goes through `forward`, so DDP's hooks average the gradients."""

    def __init__(self, unet, text_encoders: dict, train_text_encoder: bool, vae_factor: int, zero_dropped: bool = False):
        super().__init__()
        self.unet = unet
        self.towers = list(text_encoders)  # attribute names (the pipeline's: text_encoder, text_encoder_2), so
        for name, encoder in text_encoders.items():  # checkpoint keys stay text_encoder.* for the SD family
            setattr(self, name, encoder)
            encoder.requires_grad_(train_text_encoder)
        self.vae_factor = vae_factor
        self.zero_dropped = zero_dropped  # dropped captions as zero rows (the folder's force_zeros_for_empty_prompt)

    def forward(self, input_ids, noisy_latents, timesteps, dropped):
        # the family's conditioning (pocketdiff.conditioning), inside forward so the text encoders train with the UNet
        h, w = noisy_latents.shape[-2:]
        cond = conditioning_from_ids([getattr(self, n) for n in self.towers], input_ids, self.unet.config,
                                     (h * self.vae_factor, w * self.vae_factor))
        if self.zero_dropped:
            cond = zero_rows(cond, dropped, family_of(self.unet.config))
        return self.unet(noisy_latents, timesteps, **cond.unet_kwargs()).sample


class _VaeModel(torch.nn.Module):
    """Encode, sample, decode in one forward (so DDP sees the call); returns (recon, kl)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, x, rng: BatchRandom):
        dist = self.vae.encode(x).latent_dist
        z = dist.mean + dist.std * rng.randn(*dist.mean.shape[1:])
        return self.vae.decode(z).sample, dist.kl()


def train_vae(cfg: Config, vae, dataset, out: Path, resume: Optional[str], acc) -> dict:
    """Step 2: reconstruction + KL training of the VAE, then its latent scaling factor."""
    loop = dataclasses.replace(cfg.train, max_steps=cfg.vae.steps, lr=cfg.vae.lr, batch_size=cfg.vae.batch_size,
                               ema_decay=0.0, checkpoint_every=cfg.vae.checkpoint_every, warmup_steps=0, max_time_s=cfg.vae.max_time_s)

    def vae_loss(model, batch, rng: BatchRandom):
        x = batch["pixel_values"].to(rng.device)
        recon, kl = model(x, rng)
        return F.mse_loss(recon.float(), x.float()) + cfg.vae.kl_weight * kl.mean()

    vae.requires_grad_(True)
    result = train_loop(loop, model=_VaeModel(vae), loss_fn=vae_loss, dataset=dataset, collate=collate,
                        ckpt_dir=out / "checkpoints" / "vae", seed=cfg.seed + 1, resume=resume, desc="vae",
                        log_path=out / "logs.jsonl", accelerator=acc)
    vae.requires_grad_(False)
    vae.eval()
    with torch.no_grad():  # scaling factor: unit variance of the latents of the first items
        n = min(len(dataset), 256)
        x = collate([dataset[i] for i in range(n)])["pixel_values"].to(vae.device)
        std = vae.encode(x).latent_dist.mean.float().std().item()
    vae.register_to_config(scaling_factor=1.0 / max(std, 1e-6))
    return {"steps": result.steps, "final_loss": result.final_loss, "losses": result.losses, "scaling_factor": 1.0 / max(std, 1e-6)}


def run(cfg: Config, out: Path, resume: Optional[str] = None) -> dict:
    # 1. data and model
    torch.manual_seed(cfg.seed)
    hf_ds = load_captioned_dataset(cfg.data)
    captions = list(hf_ds["text"])
    dataset = InMemoryImageCaptionDataset(ImageCaptionDataset(hf_ds))
    try:
        pipe = load_or_build(cfg.model, captions=captions, resolution=cfg.data.resolution)
    except PocketdiffError as e:
        if cfg.model.pretrained is None and "resolution" in str(e):
            raise PocketdiffError(f"data.resolution={cfg.data.resolution}: {e}") from None
        raise
    check_resolution(pipe, cfg.data.resolution)
    report: dict = {"data": {"source": cfg.data.source, "items": len(dataset), "resolution": cfg.data.resolution}}

    # 2. VAE
    acc = make_accelerator(cfg.train, out)
    if cfg.vae.steps > 0:
        if cfg.model.pretrained or cfg.model.vae:
            raise PocketdiffError("vae.steps > 0 trains a VAE from scratch; it cannot be combined with model.pretrained / model.vae")
        report["vae"] = train_vae(cfg, pipe.vae, dataset, out, resume, acc)
    pipe.vae.requires_grad_(False).eval().to(acc.device)

    # 3. UNet (+ text encoder)
    encoders = {"text_encoder" + t: getattr(pipe, "text_encoder" + t) for t in family_of(pipe.unet).towers}
    model = _DiffusionModel(pipe.unet, encoders, cfg.train_text_encoder, vae_scale_factor(pipe.vae), zero_unconditional(pipe))
    scheduler = pipe.scheduler
    vae = pipe.vae

    def loss_fn(m, batch, rng: BatchRandom):
        x = batch["pixel_values"].to(rng.device)
        with torch.no_grad():
            dist = vae.encode(x).latent_dist
            latents = (dist.mean + dist.std * rng.randn(*dist.mean.shape[1:])) * vae.config.scaling_factor
        drop = rng.rand() < cfg.caption_dropout
        texts = ["" if d else t for d, t in zip(drop.tolist(), batch["text"])]
        ids = tuple(i.to(rng.device) for i in tokenize_prompts(pipe, texts))
        dropped = drop.to(rng.device)
        return diffusion_loss(lambda noisy, t: m(ids, noisy, t, dropped), scheduler, latents, rng)

    result = train_loop(cfg.train, model=model, loss_fn=loss_fn, dataset=dataset, collate=collate,
                        ckpt_dir=out / "checkpoints" / "unet", seed=cfg.seed, resume=resume, desc="unet",
                        log_path=out / "logs.jsonl", accelerator=acc)
    use_ema_weights(result, model)

    # 4. outputs
    pipe.unet.eval()
    for encoder in encoders.values():
        encoder.eval()
    pipeline_dir = save_pipeline(pipe, out / "pipeline")
    report.update({
        "pipeline_dir": str(pipeline_dir), "steps": result.steps, "final_loss": result.final_loss,
        "losses": result.losses, "skipped_steps": result.skipped_steps, "stopped_early": result.stopped_early,
        "params": {"unet": count_params(pipe.unet), "text_encoder": sum(count_params(e) for e in encoders.values()), "vae": count_params(pipe.vae)},
        "prediction_type": scheduler.config.prediction_type,
    })
    sections = []
    curves = {"unet": result.losses}
    if "vae" in report:
        curves["vae"] = report["vae"]["losses"]
    plot_curves(curves, out / "loss.png", "step", "loss", "training loss", logy=True)
    sections.append(("Loss", img("loss.png")))
    prompts = list(cfg.samples.prompts) or captions[:8]
    if prompts:
        images = generate(pipe, prompts, steps=cfg.samples.steps, guidance_scale=cfg.samples.guidance_scale,
                          seed=cfg.samples.seed, resolution=cfg.data.resolution)
        save_grid(images, out / "samples.png", ncols=min(4, len(prompts)), labels=prompts, cell=128)
        report["samples"] = {"grid": "samples.png", "prompts": prompts, "steps": cfg.samples.steps, "guidance_scale": cfg.samples.guidance_scale}
        sections.append((f"Samples (DDIM {cfg.samples.steps} steps, guidance {cfg.samples.guidance_scale})", img("samples.png")))
    write_page(out / "index.html", "pocketdiff train-teacher", sections, report)
    return report
