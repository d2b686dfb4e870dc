"""Feature extractors and CLIP models for the metrics, loaded safely and named honestly.

- `load_clip(source)`: a transformers `CLIPModel` + `CLIPProcessor` from a local folder (checked
  first: a folder that is not a CLIP model is an error naming it) or a hub id.
- `CLIPImageFeatures`: the image tower of a CLIP model as a torchmetrics FID feature module
  (uint8 or [0, 1] images in, projected image embeddings out).
- `TensorCLIP`: a thin adapter for torchmetrics' `CLIPScore`, whose 1.9 release expects
  `get_image_features` / `get_text_features` to return tensors while transformers 5 returns
  model outputs (torchmetrics issue #3407, fixed after 1.9.0).
- `inception_fid(...)`: torchmetrics' FrechetInceptionDistance on the FID Inception-v3 of
  `pocketdiff.evaluate.inception` (weights read with safetensors or
  ``torch.load(weights_only=True)``), and `inception_label`: "FID" only for the standard weights.
- `module_fingerprint(module)`: a sha256 over a module's tensors (the reference-statistics
  cache key includes it, so new weights invalidate cached statistics).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError
from pocketdiff.outputs import read_json

CLIP_META = "pocketdiff_clip.json"  # written by train-clip beside the CLIPModel files
DEFAULT_HUB_CLIP = "openai/clip-vit-large-patch14"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not source.startswith((".", "~", "/"))
        and all(c.isalnum() or c in "-_." for c in source.replace("/", ""))
    )


# ----------------------------------------------------------------------------- CLIP


@dataclass
class LoadedCLIP:
    model: Any  # transformers.CLIPModel (eval mode)
    processor: Any  # transformers.CLIPProcessor
    source: str
    label: str  # e.g. "shapes-CLIP" or "openai/clip-vit-large-patch14"
    meta: dict  # pocketdiff_clip.json of a trained domain CLIP ({} otherwise)

    @property
    def image_size(self) -> int:
        return int(self.model.config.vision_config.image_size)


def check_clip_folder(path: Path, key: str = "metrics.clip") -> dict:
    """Raise PocketdiffError naming `path` unless it holds a transformers CLIPModel + processor."""
    path = Path(path)
    if not path.is_dir():
        raise PocketdiffError(f"{key}: {path} is not a folder")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise PocketdiffError(f"{key}: {path} has no config.json (not a transformers CLIP model folder)")
    cfg = read_json(cfg_file, key)
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type != "clip":
        what = f"model_type {model_type!r}" if model_type else f"no model_type (class {cfg.get('_class_name')!r})" if isinstance(cfg, dict) else "not a mapping"
        raise PocketdiffError(f"{key}: {path} is not a CLIP model (config.json has {what}; expected model_type 'clip', a transformers CLIPModel folder)")
    if not (any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json"))):
        raise PocketdiffError(f"{key}: {path} has no *.safetensors weights (pocketdiff loads safetensors only)")
    if not ((path / "preprocessor_config.json").is_file() or (path / "processor_config.json").is_file()):
        raise PocketdiffError(f"{key}: {path} has no preprocessor_config.json / processor_config.json (save the CLIPProcessor beside the model)")
    if not ((path / "tokenizer.json").is_file() or (path / "vocab.json").is_file()):
        raise PocketdiffError(f"{key}: {path} has no tokenizer (tokenizer.json or vocab.json + merges.txt)")
    meta_file = path / CLIP_META
    if meta_file.is_file():
        try:
            return json.loads(meta_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PocketdiffError(f"{key}: {meta_file} is not valid JSON ({_first_line(e)})") from None
    return {}


def resolve_clip_source(source: str, key: str = "metrics.clip") -> str:
    """`pocketdiff:NAME` -> the folder shipped in pocketdiff/assets/ (`pocketdiff.shipped`, as for
    shipped teachers); anything else unchanged. A missing asset is an error naming `key`."""
    from pocketdiff.shipped import resolve_shipped

    try:
        return resolve_shipped(source)
    except PocketdiffError as e:
        raise PocketdiffError(f"{key}: {e}") from None


def load_clip(source: str, device: Optional[torch.device] = None, key: str = "metrics.clip", label: Optional[str] = None) -> LoadedCLIP:
    """A CLIPModel + CLIPProcessor from a local folder or a hub id (no download for folders)."""
    from transformers import CLIPModel, CLIPProcessor

    text = str(source).strip()
    if not text:
        raise PocketdiffError(f"{key}: empty CLIP model path")
    text = resolve_clip_source(text, key)  # pocketdiff:clip-shapes -> pocketdiff/assets/clip-shapes
    path = Path(text).expanduser()
    meta: dict = {}
    if path.exists():
        meta = check_clip_folder(path, key)
        src, kwargs = str(path), {"local_files_only": True}
    elif _looks_like_hub_id(text):
        src, kwargs = text, {}
    else:
        raise PocketdiffError(f"{key}: {text}: no such folder (and not a hub id like 'openai/clip-vit-large-patch14')")
    try:
        model = CLIPModel.from_pretrained(src, use_safetensors=True, **kwargs)
        processor = CLIPProcessor.from_pretrained(src, **kwargs)
    except PocketdiffError:
        raise
    except Exception as e:  # noqa: BLE001 - offline hub, wrong files: one line naming the source
        hint = "" if path.exists() else " (offline? pass a local CLIP folder)"
        raise PocketdiffError(f"{key}: cannot load CLIP model {text}: {type(e).__name__}: {_first_line(e)}{hint}") from None
    if type(model).__name__ != "CLIPModel":  # pragma: no cover - from_pretrained returns the class asked for
        raise PocketdiffError(f"{key}: {text} is not a CLIP model")
    model.eval().requires_grad_(False)
    if device is not None:
        model.to(device)
    if label is None:
        domain = meta.get("domain")
        label = f"{domain}-CLIP" if domain else (path.name if path.exists() else text)
    return LoadedCLIP(model=model, processor=processor, source=text, label=label, meta=meta)


def _pooled(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    pooled = getattr(out, "pooler_output", None)
    if isinstance(pooled, torch.Tensor):
        return pooled
    if isinstance(out, (tuple, list)):
        return out[0]
    raise PocketdiffError(f"CLIP features: unexpected output {type(out).__name__}")


class TensorCLIP(nn.Module):
    """A CLIPModel whose get_image_features / get_text_features return projected tensors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def get_image_features(self, pixel_values: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return _pooled(self.model.get_image_features(pixel_values, *args, **kwargs))

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *args, **kwargs) -> torch.Tensor:
        return _pooled(self.model.get_text_features(input_ids, attention_mask, *args, **kwargs))


def processor_norm(processor: Any) -> tuple[list[float], list[float]]:
    ip = getattr(processor, "image_processor", processor)
    mean = list(getattr(ip, "image_mean", None) or [0.48145466, 0.4578275, 0.40821073])
    std = list(getattr(ip, "image_std", None) or [0.26862954, 0.26130258, 0.27577711])
    return mean, std


def preprocess_images(images: torch.Tensor, image_size: int, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] or float [0, 1] images [N, 3, H, W] -> normalised CLIP input at `image_size`.

    Square inputs are resized (bicubic, antialiased); non-square ones are resized on the short
    side and centre-cropped, as CLIPImageProcessor does.
    """
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    h, w = x.shape[-2:]
    if (h, w) != (image_size, image_size):
        scale = image_size / min(h, w)
        nh, nw = max(image_size, round(h * scale)), max(image_size, round(w * scale))
        x = torch.nn.functional.interpolate(x, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)
        top, left = (nh - image_size) // 2, (nw - image_size) // 2
        x = x[..., top : top + image_size, left : left + image_size].clamp(0, 1)
    return (x - mean.view(1, -1, 1, 1).to(x)) / std.view(1, -1, 1, 1).to(x)


class CLIPImageFeatures(nn.Module):
    """FID feature module: images -> CLIP projected image embeddings [N, projection_dim].

    Accepts uint8 [0, 255] or float [0, 1] images of any size (resized to the CLIP's own).
    Never leaves eval mode; `num_features` tells torchmetrics the dimension.
    """

    def __init__(self, model: nn.Module, processor: Any) -> None:
        super().__init__()
        self.vision_model = model.vision_model
        self.visual_projection = model.visual_projection
        self.image_size = int(model.config.vision_config.image_size)
        mean, std = processor_norm(processor)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32), persistent=False)
        self.num_features = int(self.visual_projection.out_features)
        self.eval()

    def train(self, mode: bool = True) -> "CLIPImageFeatures":
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        dev = self.mean.device
        x = preprocess_images(images.to(dev), self.image_size, self.mean, self.std)
        dtype = next(self.vision_model.parameters()).dtype
        pooled = self.vision_model(pixel_values=x.to(dtype)).pooler_output
        return self.visual_projection(pooled).float()


# ----------------------------------------------------------------------------- Inception


def inception_label(info: dict) -> str:
    """"FID (...)" only for the standard weights; other weights give an FD named by their file."""
    if info.get("standard"):
        return "FID (Inception-v3 pool3, 2048-d)"
    return f"FD (Inception-v3 pool3, 2048-d; weights {Path(info['weights']).name}, not the standard FID weights)"


def inception_fid(weights_path: Optional[str] = None):
    """(torchmetrics FrechetInceptionDistance on pocketdiff's FID Inception-v3, weights info).

    The network is `pocketdiff.evaluate.inception.FIDInceptionV3` (torch-fidelity's network,
    which needs torchvision, is not used); weights come from `weights_path` (.pth state dict
    read with ``torch.load(weights_only=True)``, or .safetensors) or, without one, from the torch
    hub cache / a one-time download of torch-fidelity's weights file.
    """
    from torchmetrics.image.fid import FrechetInceptionDistance

    from .inception import load_fid_inception

    module, info = load_fid_inception(weights_path)
    fid = FrechetInceptionDistance(feature=module, reset_real_features=False, normalize=False)
    return fid, info


# ----------------------------------------------------------------------------- hashing


def module_fingerprint(module: nn.Module, extra: Any = None) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) plus `extra` (JSON)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if extra is not None:
        h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()
