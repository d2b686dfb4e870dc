"""Recovery of a pruned UNet: knowledge distillation from the unpruned model.

The loss of one batch (all randomness from the loop's `BatchRandom`, so `--resume latest`
replays exactly):

    x_t = add_noise(z, eps, t),  z = VAE latents of real images, t ~ U[0, T)
    L = output_weight  * |student(x_t) - teacher(x_t)|^2              (output-level KD)
      + task_weight    * |student(x_t) - target(z, eps, t)|^2         (ordinary denoising loss)
      + feature_weight * sum_blocks |student_block(x_t) - teacher_block(x_t)|^2   (BK-SDM feature KD)

Feature KD compares the outputs of every down block, the mid block and every up block; after block removal
(`feature_pairs`) the student's stage outputs are compared with the teacher's stages they came from (a stage
that lost its downsampler with the teacher stage's output before its downsampler).
Internal-channel pruning keeps those outputs' shapes, so no projection is needed; stream
pruning (``prune.scope: stream / all``) narrows them, and the student's block outputs are
compared with the teacher's kept channels (`feature_channels`, from the pruning plan). Captions
are dropped with `caption_dropout` so the unconditional branch used by classifier-free
guidance is distilled too. Runs through `pocketdiff.train.loop.train_loop` (Accelerate,
atomic checkpoints, `--resume latest`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pocketdiff.conditioning import encode_conditioning, family_of, pixel_size, text_encoders, zero_rows, zero_unconditional
from pocketdiff.errors import require
from pocketdiff.sampling import default_w_embedding_fn
from pocketdiff.train.loop import BatchRandom, LoopConfig, train_loop, use_ema_weights
from pocketdiff.train.losses import diffusion_target


@dataclasses.dataclass
class RecoveryConfig:
    """The `recovery:` section (optimisation settings are the `train:` section)."""

    enabled: bool = True
    output_weight: float = 1.0
    task_weight: float = 0.0
    feature_weight: float = 0.0
    caption_dropout: float = 0.1
    # guidance-conditioned UNets (time_cond_proj_dim, e.g. a guided-distillation student):
    # w ~ U[w_min, w_max] per sample, the same for teacher and student (default: the
    # folder's distill.json guidance range, else [1, 8])
    w_min: Optional[float] = None
    w_max: Optional[float] = None

    def __post_init__(self) -> None:
        for key in ("output_weight", "task_weight", "feature_weight"):
            require(getattr(self, key) >= 0, f"recovery.{key}", "must be >= 0")
        require(self.output_weight + self.task_weight + self.feature_weight > 0, "recovery",
                "at least one of output_weight, task_weight, feature_weight must be positive")
        require(0.0 <= self.caption_dropout < 1.0, "recovery.caption_dropout", "must be in [0, 1)")
        if self.w_min is not None and self.w_max is not None:
            require(1.0 <= self.w_min <= self.w_max, "recovery.w_min", "needs 1 <= w_min <= w_max")


def block_names(unet: nn.Module) -> list[str]:
    names = [f"down_blocks.{i}" for i in range(len(unet.down_blocks))]
    if getattr(unet, "mid_block", None) is not None:
        names.append("mid_block")
    names += [f"up_blocks.{i}" for i in range(len(unet.up_blocks))]
    return names


class FeatureTap:
    """Forward hooks storing the outputs of named blocks (first element of tuple outputs)."""

    def __init__(self, model: nn.Module, names: list[str]):
        self.features: dict[str, torch.Tensor] = {}
        mods = dict(model.named_modules())
        self.handles = [mods[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name):
        def hook(mod, inputs, output):
            self.features[name] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def pop(self) -> dict[str, torch.Tensor]:
        f, self.features = self.features, {}
        return f

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def recover(
    cfg: RecoveryConfig,
    loop: LoopConfig,
    *,
    student: nn.Module,
    teacher: nn.Module,
    pipe,
    dataset,
    collate,
    ckpt_dir: Path,
    seed: int,
    resume: Optional[str] = None,
    log_path: Optional[Path] = None,
    w_range: tuple[float, float] = (1.0, 8.0),
    feature_channels: Optional[dict] = None,
    feature_pairs: Optional[dict] = None,
) -> dict:
    """Distil `teacher` (frozen) into `student` (trained in place). Returns losses and steps.

    `feature_channels` ({block name: kept channel indices or None}) selects the teacher's
    block-output channels the student kept (stream pruning). `feature_pairs` ({student block: teacher module},
    block removal) says which teacher output each student block output is matched with: the stage outputs of
    kept stages (default: the same block names in both).

    A guidance-conditioned teacher (``time_cond_proj_dim``) gets the same random
    ``timestep_cond`` as the student, w ~ U[`w_range`] per sample."""
    vae, encoders, scheduler = pipe.vae, text_encoders(pipe), pipe.scheduler
    zero_dropped = zero_unconditional(pipe)
    for m in (teacher, vae, *encoders):
        m.requires_grad_(False).eval()
    student.requires_grad_(True).train()
    pairs = (dict(feature_pairs) if feature_pairs is not None else {n: n for n in block_names(student)}) if cfg.feature_weight > 0 else {}
    names = list(pairs)
    tap_s = FeatureTap(student, names) if names else None
    tap_t = FeatureTap(teacher, sorted(set(pairs.values()))) if names else None
    parts: dict[str, float] = {}
    picks = {n: torch.as_tensor(i, dtype=torch.long) for n, i in (feature_channels or {}).items() if i is not None}
    w_fn = default_w_embedding_fn(teacher)  # guidance-conditioned teacher: w -> timestep_cond, else None

    def loss_fn(model, batch, rng: BatchRandom):
        dev = rng.device
        x = batch["pixel_values"].to(dev)
        with torch.no_grad():
            vae.to(dev)
            for encoder in encoders:
                encoder.to(dev)
            teacher.to(dev)
            dist = vae.encode(x).latent_dist
            latents = (dist.mean + dist.std * rng.randn(*dist.mean.shape[1:])) * vae.config.scaling_factor
            drop = rng.rand() < cfg.caption_dropout
            texts = ["" if d else t for d, t in zip(drop.tolist(), batch["text"])]
            emb = encode_conditioning(pipe, texts, dev, resolution=pixel_size(latents, vae))
            if zero_dropped:  # the folder's empty-prompt rule: dropped captions are zero rows
                emb = zero_rows(emb, drop.to(dev), family_of(pipe.unet))
            noise = rng.randn(*latents.shape[1:]).to(latents.dtype)
            t = rng.randint(0, scheduler.config.num_train_timesteps)
            noisy = scheduler.add_noise(latents, noise, t)
            kwargs = {}
            if w_fn is not None:
                w = w_range[0] + rng.rand() * (w_range[1] - w_range[0])
                kwargs["timestep_cond"] = w_fn(w).to(device=dev, dtype=emb.dtype)
            t_out = teacher(noisy, t, **emb.unet_kwargs(), **kwargs).sample.float()
            t_by_module = tap_t.pop() if tap_t else {}
            t_feat = {n: t_by_module[src] for n, src in pairs.items()}
            t_feat = {n: (f.index_select(1, picks[n].to(f.device)) if n in picks else f) for n, f in t_feat.items()}
        s_out = model(noisy, t, **emb.unet_kwargs(), **kwargs).sample.float()
        s_feat = tap_s.pop() if tap_s else {}
        loss = torch.zeros((), device=dev)
        if cfg.output_weight > 0:
            kd = F.mse_loss(s_out, t_out)
            parts["output_kd"] = float(kd.detach())
            loss = loss + cfg.output_weight * kd
        if cfg.task_weight > 0:
            task = F.mse_loss(s_out, diffusion_target(scheduler, latents, noise, t).float())
            parts["task"] = float(task.detach())
            loss = loss + cfg.task_weight * task
        if cfg.feature_weight > 0:
            feat = sum(F.mse_loss(s_feat[n].float(), t_feat[n].float()) for n in names)
            parts["feature_kd"] = float(feat.detach())
            loss = loss + cfg.feature_weight * feat
        return loss

    try:
        result = train_loop(loop, model=student, loss_fn=loss_fn, dataset=dataset, collate=collate, ckpt_dir=ckpt_dir,
                            seed=seed, resume=resume, desc="recovery", log_path=log_path)
    finally:
        if tap_s:
            tap_s.remove()
        if tap_t:
            tap_t.remove()
    use_ema_weights(result, student)
    student.eval()
    return {"steps": result.steps, "final_loss": result.final_loss, "losses": result.losses,
            "skipped_steps": result.skipped_steps, "last_loss_parts": dict(parts),
            "weights": {"output": cfg.output_weight, "task": cfg.task_weight, "feature": cfg.feature_weight},
            "w_range": list(w_range) if w_fn is not None else None}
