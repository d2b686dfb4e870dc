"""Training data of `pocketdiff distill`: the VAE posterior of every image, encoded once and cached."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from pocketdiff.data import ImageCaptionDataset, collate
from pocketdiff.outputs import atomic_path

from .distill_config import Config


class LatentDataset(torch.utils.data.Dataset):
    """Items {"mean", "std", "text"}: the VAE posterior of each training image."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, texts: list[str]):
        self.mean, self.std, self.texts = mean, std, texts

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict:
        return {"mean": self.mean[i], "std": self.std[i], "text": self.texts[i]}


@torch.no_grad()
def _encode(vae, pixels: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    dist = vae.encode(pixels.to(device=device, dtype=vae.dtype)).latent_dist
    return dist.mean.float().cpu(), dist.std.float().cpu()


def encode_batch(resolution: int) -> int:
    """Images per VAE encoder call: 64 at 128 px and below, fewer as the pixels grow (4 at 512 px),
    so that the encoder's float32 activations stay within a 24 GB card's memory."""
    return max(1, min(64, 64 * 128 * 128 // (resolution * resolution)))


def build_latent_dataset(cfg: Config, pipe, images: ImageCaptionDataset, out: Path, acc) -> LatentDataset:
    """Encode every training image once (main process), save to DIR/cache, load everywhere."""
    from safetensors.torch import load_file, save_file

    texts = list(images.dataset["text"])
    fingerprint = hashlib.sha256(json.dumps({
        "data": dataclasses.asdict(cfg.data), "teacher": cfg.model.pretrained, "vae": cfg.model.vae,
        "arch": cfg.model.arch, "n": len(texts), "texts": hashlib.sha256("\n".join(texts).encode()).hexdigest(),
    }, sort_keys=True).encode()).hexdigest()
    path = out / "cache" / "latents.safetensors"
    if acc.is_main_process:
        fresh = True
        if path.is_file():
            from safetensors import safe_open

            try:
                with safe_open(str(path), "pt") as f:
                    fresh = (f.metadata() or {}).get("fingerprint") != fingerprint
            except Exception:  # noqa: BLE001 - an unreadable cache is rebuilt, like a stale one
                fresh = True
        if fresh:
            vae = pipe.vae.to(acc.device)
            means, stds = [], []
            step = encode_batch(cfg.data.resolution)
            for start in range(0, len(images), step):
                pix = collate([images[i] for i in range(start, min(start + step, len(images)))])["pixel_values"]
                m, s = _encode(vae, pix, acc.device)
                means.append(m)
                stds.append(s)
            with atomic_path(path) as tmp:
                save_file({"mean": torch.cat(means).contiguous(), "std": torch.cat(stds).contiguous()}, str(tmp),
                          metadata={"fingerprint": fingerprint})
    acc.wait_for_everyone()
    tensors = load_file(str(path))
    return LatentDataset(tensors["mean"], tensors["std"], texts)


class PixelDataset(torch.utils.data.Dataset):
    """`cache_latents: false`: items keep their pixels; the loss encodes them per batch."""

    def __init__(self, images: ImageCaptionDataset):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        return self.images[i]
