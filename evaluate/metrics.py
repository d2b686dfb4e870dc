"""The metrics: FD / FID (torchmetrics `FrechetInceptionDistance`) and CLIP score (torchmetrics
`CLIPScore`), with reference statistics computed once and cached under a content hash.

`MetricSetup` is built once (from a `MetricConfig` and the reference `DataConfig`) and reused
for every model, step count and seed (and across distillation / pruning rounds):

    setup = MetricSetup(MetricConfig(features="clip", clip="pocketdiff/assets/clip-shapes"),
                        reference=DataConfig(source="shapes", shapes_count=2048, resolution=32))
    setup.prepare()              # reference statistics: cache hit, or computed and cached
    setup.fd(images_uint8)       # generated images [N, 3, H, W] uint8 -> float
    setup.clip_score(images_uint8, prompts)

Names are honest: FD on CLIP features is "FD (shapes-CLIP)" (never "FID"); FID means
Inception-v3 pool3 features with the standard TF-port weights (`pocketdiff.evaluate.inception`,
bit-identical to torch-fidelity's network); other Inception weights give "FD (Inception-v3 ...;
weights NAME, ...)".

Reference cache: `<cache_dir>/fd-<key>.safetensors` holds torchmetrics' real-feature sums
(`real_features_sum`, `real_features_cov_sum`, `real_features_num_samples`), where `key` is a
sha256 of (the data config, a sha256 over every reference image's stored bytes and caption,
the feature extractor's weights and preprocessing, the torchmetrics version). Changing the
data, its size or resolution, or the extractor gives a new key: stale statistics are never read.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from pocketdiff.config import DataConfig
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.outputs import atomic_path

from .features import (
    DEFAULT_HUB_CLIP,
    CLIPImageFeatures,
    LoadedCLIP,
    TensorCLIP,
    inception_fid,
    inception_label,
    load_clip,
    module_fingerprint,
)

log = logging.getLogger(__name__)

FEATURES = ("inception", "clip")
CACHE_FORMAT = 1


@dataclasses.dataclass
class MetricConfig:
    """What is measured. Defaults are the standard ones for real models (Inception FID,
    OpenAI CLIP ViT-L/14); small domains use a trained domain CLIP for both."""

    fd: bool = True
    clip_score: bool = True
    features: str = "inception"  # inception (FID) | clip (FD on the CLIP model's image embeddings)
    inception_weights: Optional[str] = None  # local Inception weights (.pth state dict / .safetensors) for offline use
    clip: Optional[str] = DEFAULT_HUB_CLIP  # CLIP folder (e.g. pocketdiff/assets/clip-shapes) or hub id
    clip_label: Optional[str] = None  # name in reports; default: "<domain>-CLIP" from the folder, else its name
    fd_min_samples: Optional[int] = None  # warn below this many samples (default: 10 x feature dimension)
    batch_size: int = 64  # feature extraction batch
    reference_clip_samples: int = 512  # real images scored against their own captions (0: off)
    cache_dir: Optional[str] = None  # reference statistics; default $POCKETDIFF_CACHE or ~/.cache/pocketdiff

    def __post_init__(self) -> None:
        require(self.features in FEATURES, "metrics.features", f"must be one of {FEATURES}, got {self.features!r}")
        require(self.batch_size >= 1, "metrics.batch_size", "must be >= 1")
        require(self.fd_min_samples is None or self.fd_min_samples >= 2, "metrics.fd_min_samples", "must be >= 2")
        require(self.reference_clip_samples >= 0, "metrics.reference_clip_samples", "must be >= 0")
        if self.clip_score or (self.fd and self.features == "clip"):
            require(bool(self.clip and str(self.clip).strip()), "metrics.clip",
                    "a CLIP folder or hub id is needed for CLIP score and for features=clip")


def default_cache_dir() -> Path:
    env = os.environ.get("POCKETDIFF_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "pocketdiff"
    return base / "reference-stats"


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Float [0, 1] (or uint8) images -> uint8 [N, 3, H, W] on the CPU (rounded as PNGs are)."""
    if images.dtype == torch.uint8:
        return images.cpu()
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def iter_reference_batches(dataset, batch: int):
    """(uint8 images [B, 3, R, R], captions) batches of a captioned datasets.Dataset."""
    for start in range(0, len(dataset), batch):
        rows = dataset[start : start + batch]
        arr = np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in rows["image"]])
        yield torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous(), list(rows["text"])


def dataset_fingerprint(dataset) -> str:
    """sha256 over every item's stored image bytes and caption, in order (no decoding)."""
    import datasets

    raw = dataset.cast_column("image", datasets.Image(decode=False))
    h = hashlib.sha256()
    h.update(str(len(raw)).encode())
    for start in range(0, len(raw), 1024):
        rows = raw[start : start + 1024]
        for image, text in zip(rows["image"], rows["text"]):
            data = image.get("bytes") if isinstance(image, dict) else None
            if data is None:
                path = image.get("path") if isinstance(image, dict) else None
                data = Path(path).read_bytes() if path else b""
            h.update(hashlib.sha256(data).digest())
            h.update(hashlib.sha256(str(text).encode("utf-8")).digest())
    return h.hexdigest()


def describe_data(cfg: DataConfig) -> str:
    parts = [cfg.source]
    if cfg.path:
        parts.append(str(cfg.path))
    if cfg.source == "shapes":
        parts.append(f"count={cfg.shapes_count}")
    parts += [f"split={cfg.split}", f"{cfg.resolution}px", f"seed={cfg.seed}"]
    if cfg.max_samples:
        parts.append(f"max_samples={cfg.max_samples}")
    return " ".join(parts)


class MetricSetup:
    """Feature extractor, CLIP model and reference statistics, built once and reused.

    `reference` is the real-image set FD compares against (needed when `cfg.fd`).
    """

    def __init__(self, cfg: MetricConfig, reference: Optional[DataConfig] = None, device: Optional[torch.device | str] = None):
        self.cfg = cfg
        self.reference = reference
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.clip: Optional[LoadedCLIP] = None
        if cfg.clip_score or (cfg.fd and cfg.features == "clip"):
            self.clip = load_clip(str(cfg.clip), device=self.device, label=cfg.clip_label)
        self.clip_label = f"CLIP score ({self.clip.label})" if (cfg.clip_score and self.clip) else None
        self._fid = None
        self._clip_metric = None
        self.fd_label: Optional[str] = None
        self.feature_dim: Optional[int] = None
        self._extractor_fp: Optional[str] = None
        self.inception_weights: Optional[dict] = None  # features=inception: {"weights", "sha256", "standard"}
        if cfg.fd:
            self._build_fid()
        self.reference_info: dict = {}
        self._reference_dataset = None
        self._prepared = False

    # ------------------------------------------------------------------ builders

    def _build_fid(self) -> None:
        from torchmetrics.image.fid import FrechetInceptionDistance

        if self.cfg.features == "clip":
            assert self.clip is not None
            module = CLIPImageFeatures(self.clip.model, self.clip.processor)
            self._fid = FrechetInceptionDistance(feature=module, reset_real_features=False, normalize=False)
            self.feature_dim = module.num_features
            self.fd_label = f"FD ({self.clip.label})"
            extra = {"kind": "clip-image-embeds", "image_size": module.image_size, "mean": module.mean.tolist(), "std": module.std.tolist()}
            self._extractor_fp = module_fingerprint(module, extra)
        else:
            self._fid, self.inception_weights = inception_fid(self.cfg.inception_weights)
            self.feature_dim = 2048
            self.fd_label = inception_label(self.inception_weights)
            self._extractor_fp = module_fingerprint(self._fid.inception, {"kind": "fid-inception-v3-2048", "resize": "tf1-bilinear-299"})
        self._fid.to(self.device)

    @property
    def fd_min_samples(self) -> int:
        return int(self.cfg.fd_min_samples or 10 * (self.feature_dim or 1))

    def _clip_score_metric(self):
        if self._clip_metric is None:
            from torchmetrics.multimodal.clip_score import CLIPScore

            assert self.clip is not None
            model, processor = TensorCLIP(self.clip.model), self.clip.processor
            # on the images' device: torchmetrics moves the model there, but its running sums
            # stay where the metric is (a CPU metric fed CUDA images fails on the first update)
            self._clip_metric = CLIPScore(model_name_or_path=lambda: (model, processor)).to(self.device)
        return self._clip_metric

    # ------------------------------------------------------------------ reference

    def reference_dataset(self):
        if self._reference_dataset is None:
            from pocketdiff.data import load_captioned_dataset

            assert self.reference is not None
            self._reference_dataset = load_captioned_dataset(self.reference)
        return self._reference_dataset

    def reference_captions(self) -> list[str]:
        return list(self.reference_dataset()["text"])

    def cache_key(self, data_hash: str) -> str:
        import torchmetrics

        payload = {
            "format": CACHE_FORMAT,
            "data_config": dataclasses.asdict(self.reference) if self.reference is not None else None,
            "data_content_sha256": data_hash,
            "extractor": self._extractor_fp,
            "torchmetrics": torchmetrics.__version__,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def prepare(self) -> dict:
        """Reference statistics (from the cache or computed and cached) and the real-data CLIP score."""
        if self._prepared:
            return self.reference_info
        if self.reference is None:
            self._prepared = True
            return self.reference_info
        ds = self.reference_dataset()
        n = len(ds)
        if self.cfg.fd and n < 2:
            raise PocketdiffError(f"reference: {describe_data(self.reference)} has {n} image(s); FD needs at least 2 reference images")
        t0 = time.time()
        data_hash = dataset_fingerprint(ds)
        info: dict = {"data": describe_data(self.reference), "num_images": n, "data_sha256": data_hash}
        if self.cfg.fd:
            key = self.cache_key(data_hash)
            cache_dir = Path(self.cfg.cache_dir).expanduser() if self.cfg.cache_dir else default_cache_dir()
            path = cache_dir / f"fd-{key[:40]}.safetensors"
            info.update({"cache_key": key, "cache_file": str(path), "features": self.fd_label, "feature_dim": self.feature_dim})
            if path.is_file() and self._load_stats(path, n):
                info["cache"] = "hit"
            else:
                self._compute_stats(ds)
                self._save_stats(path, key)
                info["cache"] = "miss (computed)"
        info["seconds"] = round(time.time() - t0, 2)
        if self.cfg.clip_score and self.cfg.reference_clip_samples > 0:
            m = min(n, self.cfg.reference_clip_samples)
            images, caps = next(iter_reference_batches(ds.select(range(m)), m))
            info["clip_score_real"] = self.clip_score(images, caps)
            info["clip_score_real_samples"] = m
        self.reference_info = info
        self._prepared = True
        return info

    def _compute_stats(self, ds) -> None:
        fid = self._fid
        fid.real_features_sum.zero_()
        fid.real_features_cov_sum.zero_()
        fid.real_features_num_samples.zero_()
        with torch.no_grad():
            for images, _ in iter_reference_batches(ds, self.cfg.batch_size):
                fid.update(images.to(self.device), real=True)

    def _save_stats(self, path: Path, key: str) -> None:
        from safetensors.torch import save_file

        fid = self._fid
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "real_features_sum": fid.real_features_sum.detach().cpu().contiguous(),
            "real_features_cov_sum": fid.real_features_cov_sum.detach().cpu().contiguous(),
            "real_features_num_samples": fid.real_features_num_samples.detach().cpu().reshape(1).contiguous(),
        }
        meta = {"key": key, "features": str(self.fd_label), "data": describe_data(self.reference) if self.reference else ""}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)

    def _load_stats(self, path: Path, expected_n: int) -> bool:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                s = f.get_tensor("real_features_sum")
                c = f.get_tensor("real_features_cov_sum")
                n = f.get_tensor("real_features_num_samples")
        except Exception as e:  # noqa: BLE001 - a damaged cache entry is recomputed
            log.warning("reference cache %s unreadable (%s): recomputing", path, e)
            return False
        fid = self._fid
        if s.shape != fid.real_features_sum.shape or c.shape != fid.real_features_cov_sum.shape or int(n.reshape(-1)[0]) != expected_n:
            log.warning("reference cache %s does not match (shape or count): recomputing", path)
            return False
        fid.real_features_sum.copy_(s.to(fid.real_features_sum))
        fid.real_features_cov_sum.copy_(c.to(fid.real_features_cov_sum))
        fid.real_features_num_samples.fill_(int(n.reshape(-1)[0]))
        return True

    # ------------------------------------------------------------------ metrics

    @torch.no_grad()
    def measure(self, batches: Iterable[tuple[torch.Tensor, Sequence[str]]], fd: Optional[bool] = None,
                clip_score: Optional[bool] = None) -> dict:
        """Stream (images, prompts) batches through FD (against the reference) and CLIP score.

        Images are [B, 3, H, W] uint8 or float in [0, 1]; nothing is kept, so sets of any size
        fit. Returns {"fd", "clip_score", "num_samples"} (None for a metric that is off).
        """
        do_fd = self.cfg.fd if fd is None else fd
        do_clip = self.cfg.clip_score if clip_score is None else clip_score
        if do_fd and not self.cfg.fd:
            raise PocketdiffError("metrics.fd is off")
        if do_clip and not self.cfg.clip_score:
            raise PocketdiffError("metrics.clip_score is off")
        if do_fd:
            if self.reference is None:
                raise PocketdiffError("reference: FD needs a reference data set (set reference.source / path), or metrics.fd=false")
            self.prepare()
            self._fid.reset()  # keeps the real statistics (reset_real_features=False)
        metric = self._clip_score_metric() if do_clip else None
        if metric is not None:
            metric.reset()
        n = 0
        with warnings.catch_warnings():  # torchmetrics' notes on padding / truncation: counted in too_long()
            warnings.filterwarnings("ignore", message=".*max_length.*is ignored.*")
            warnings.filterwarnings("ignore", message=".*Encountered caption longer.*")
            for images, prompts in batches:
                images = to_uint8(images)
                if prompts is not None and len(prompts) != len(images):
                    raise PocketdiffError(f"CLIP score: {len(images)} images but {len(prompts)} prompts")
                n += len(images)
                for i in range(0, len(images), self.cfg.batch_size):
                    part = images[i : i + self.cfg.batch_size].to(self.device)
                    if do_fd:
                        self._fid.update(part, real=False)
                    if metric is not None:
                        metric.update(part, list(prompts[i : i + self.cfg.batch_size]))
        out: dict = {"fd": None, "clip_score": None, "num_samples": n}
        if do_fd:
            if n < 2:
                self._fid.reset()
                raise PocketdiffError(f"FD needs at least 2 generated images, got {n}")
            out["fd"] = float(self._fid.compute())
            self._fid.reset()
        if metric is not None:
            if n == 0:
                raise PocketdiffError("CLIP score: no images")
            out["clip_score"] = float(metric.compute())
            metric.reset()
        return out

    def fd(self, images) -> float:
        """FD / FID against the reference of generated images: a tensor [N, 3, H, W] (uint8, or
        float in [0, 1]) or an iterable of such batches."""
        batches = [images] if isinstance(images, torch.Tensor) else images
        return self.measure(((b, None) for b in batches), fd=True, clip_score=False)["fd"]

    def clip_score(self, images: torch.Tensor, prompts: Sequence[str]) -> float:
        """torchmetrics CLIPScore (100 x cosine, clamped at 0) of images against their prompts."""
        return self.measure([(images, list(prompts))], fd=False, clip_score=True)["clip_score"]

    def too_long(self, prompts: Sequence[str]) -> int:
        """How many prompts exceed the CLIP text tower's positions (CLIPScore truncates them,
        dropping the end token the text features are read from)."""
        if self.clip is None:
            return 0
        limit = int(self.clip.model.config.text_config.max_position_embeddings)
        ids = self.clip.processor.tokenizer(list(prompts))["input_ids"]
        return sum(len(x) > limit for x in ids)

    @torch.no_grad()
    def fd_between(self, images: torch.Tensor, reference_images: torch.Tensor) -> float:
        """FD between two image sets with this setup's features (no cache; e.g. student vs teacher)."""
        from torchmetrics.image.fid import FrechetInceptionDistance

        if self._fid is None:
            raise PocketdiffError("metrics.fd is off")
        if len(images) < 2 or len(reference_images) < 2:
            raise PocketdiffError(f"FD needs at least 2 images per set, got {len(images)} and {len(reference_images)}")
        fid = FrechetInceptionDistance(feature=self._fid.inception, reset_real_features=True, normalize=False).to(self.device)
        for real, batch in ((True, to_uint8(reference_images)), (False, to_uint8(images))):
            for i in range(0, len(batch), self.cfg.batch_size):
                fid.update(batch[i : i + self.cfg.batch_size].to(self.device), real=real)
        return float(fid.compute())

    def describe(self) -> dict:
        return {
            "fd": self.fd_label,
            "fd_feature_dim": self.feature_dim,
            "fd_min_samples": self.fd_min_samples if self.cfg.fd else None,
            "fd_inception_weights": self.inception_weights,
            "clip_score": self.clip_label,
            "clip_model": self.clip.source if self.clip else None,
            "reference": self.reference_info,
        }
