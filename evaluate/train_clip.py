"""`pocketdiff train-clip`: a small domain CLIP (image + text towers) for domain metrics.

1. load the captioned set, split off `holdout` items (the first ones of the seeded order)
   for retrieval accuracy; everything else trains
2. build the project tokenizer (pocketdiff.tokenizer) on the training captions and a
   transformers `CLIPModel` of the configured size
3. train with the symmetric contrastive loss; items with identical captions count as
   positives of each other (the shapes set repeats its 720 captions), AdamW + cosine
4. measure image->text and text->image top-1 / top-5 on the held-out items
5. save `DIR/clip/` (CLIPModel + CLIPProcessor via save_pretrained, vocab.json/merges.txt,
   `pocketdiff_clip.json` naming the domain, data and split), loss curve, report and page

`pocketdiff evaluate` uses the folder as FD feature extractor ("FD (shapes-CLIP)") and as
CLIPScore's model. The shapes CLIP shipped in `pocketdiff/assets/clip-shapes/` is made with
`configs/clip/shapes.yaml`; the OpenMoji one with `configs/clip/openmoji.yaml` (GPU).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from pocketdiff.config import DataConfig, renamed_value
from pocketdiff.data import load_captioned_dataset
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.names import OLD_PRECISIONS
from pocketdiff.outputs import write_json
from pocketdiff.report import img, plot_curves, table, write_page
from pocketdiff.device import resolve_device

from .features import CLIP_META, preprocess_images
from .retrieval import retrieval_accuracy

PRECISIONS = ("no", "bf16", "fp16")
AUGMENTS = ("none", "shift")


@dataclasses.dataclass
class ClipModelConfig:
    """Sizes of the two towers (transformers CLIPVisionConfig / CLIPTextConfig)."""

    image_size: int = 32
    patch_size: int = 4
    vision_width: int = 128
    vision_layers: int = 4
    vision_heads: int = 4
    text_width: int = 128
    text_layers: int = 4
    text_heads: int = 4
    max_length: int = 32  # text positions (tokens incl. start/end); longer captions are truncated
    projection_dim: int = 128
    vocab_size: int = 1024  # upper bound for the BPE tokenizer built on the captions

    def __post_init__(self) -> None:
        require(self.image_size >= 8, "model.image_size", "must be >= 8")
        require(self.patch_size >= 1 and self.image_size % self.patch_size == 0, "model.patch_size", f"must divide model.image_size={self.image_size}")
        require(self.vision_width % self.vision_heads == 0, "model.vision_heads", "must divide model.vision_width")
        require(self.text_width % self.text_heads == 0, "model.text_heads", "must divide model.text_width")
        require(self.max_length >= 4, "model.max_length", "must be >= 4")
        require(self.projection_dim >= 2, "model.projection_dim", "must be >= 2")


@dataclasses.dataclass
class ClipTrainConfig:
    steps: int = 1000
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 50
    mixed_precision: str = "no"  # no | bf16 | fp16 (CUDA only)
    augment: str = "none"  # none | shift (random translation on white, up to shift_px)
    shift_px: int = 2
    log_every: int = 50

    def __post_init__(self) -> None:
        require(self.steps >= 1, "train.steps", "must be >= 1")
        require(self.batch_size >= 2, "train.batch_size", "must be >= 2 (contrastive loss)")
        require(self.lr > 0, "train.lr", "must be > 0")
        require(self.mixed_precision in PRECISIONS, "train.mixed_precision", f"must be one of {PRECISIONS}")
        require(self.augment in AUGMENTS, "train.augment", f"must be one of {AUGMENTS}")
        require(self.shift_px >= 0, "train.shift_px", "must be >= 0")


@dataclasses.dataclass
class Config:
    seed: int = 0
    domain: str = "shapes"  # names the metrics: "FD (shapes-CLIP)", "CLIP score (shapes-CLIP)"
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    holdout: int = 512  # held-out items (first of the seeded order) for retrieval accuracy
    model: ClipModelConfig = dataclasses.field(default_factory=ClipModelConfig)
    train: ClipTrainConfig = dataclasses.field(default_factory=ClipTrainConfig)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: Optional[int] = None  # torch CPU threads (None: torch's default)
    save_dtype: str = "fp32"  # fp32 | fp16 (halves the folder; loads back as fp32)

    def __post_init__(self) -> None:
        require(bool(self.domain.strip()), "domain", "must be a non-empty name")
        require(self.holdout >= 2, "holdout", "must be >= 2 (retrieval accuracy)")
        self.save_dtype = renamed_value(self.save_dtype, "save_dtype", OLD_PRECISIONS)
        require(self.save_dtype in ("fp32", "fp16"), "save_dtype", f"must be fp32 or fp16, got {self.save_dtype!r}")


def images_to_uint8(dataset, batch: int = 1024) -> torch.Tensor:
    """The `image` column of a captioned dataset as a uint8 tensor [N, 3, R, R]."""
    out = []
    for start in range(0, len(dataset), batch):
        rows = dataset[start : start + batch]["image"]
        out.append(torch.from_numpy(np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in rows])).permute(0, 3, 1, 2))
    if not out:
        return torch.empty(0, 3, 1, 1, dtype=torch.uint8)
    return torch.cat(out).contiguous()


def build_clip(mcfg: ClipModelConfig, tokenizer, seed: int):
    """A randomly initialised transformers CLIPModel (deterministic in `seed`) and its CLIPProcessor."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    text = dict(
        vocab_size=len(tokenizer), hidden_size=mcfg.text_width, intermediate_size=4 * mcfg.text_width,
        num_hidden_layers=mcfg.text_layers, num_attention_heads=mcfg.text_heads, max_position_embeddings=mcfg.max_length,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu", projection_dim=mcfg.projection_dim,
    )
    vision = dict(
        image_size=mcfg.image_size, patch_size=mcfg.patch_size, hidden_size=mcfg.vision_width,
        intermediate_size=4 * mcfg.vision_width, num_hidden_layers=mcfg.vision_layers,
        num_attention_heads=mcfg.vision_heads, hidden_act="gelu", projection_dim=mcfg.projection_dim,
    )
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=mcfg.projection_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    processor = CLIPProcessor(image_processor=make_image_processor(mcfg.image_size), tokenizer=tokenizer)
    return model, processor


def make_image_processor(image_size: int):
    """CLIP's image preprocessing at `image_size` (resize short side, centre crop, OpenAI mean/std)."""
    try:
        import torchvision  # noqa: F401

        from transformers import CLIPImageProcessor as cls
    except Exception:  # noqa: BLE001 - no (working) torchvision: the PIL backend, same arithmetic
        try:
            from transformers import CLIPImageProcessorPil as cls
        except ImportError:  # pragma: no cover - older transformers
            from transformers import CLIPImageProcessor as cls
    return cls(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})


def _shift(x: torch.Tensor, max_px: int, gen: torch.Generator) -> torch.Tensor:
    """Random translation of each image by up to `max_px` pixels, padding with white (1.0)."""
    if max_px <= 0:
        return x
    n, _, h, w = x.shape
    pad = F.pad(x, (max_px, max_px, max_px, max_px), value=1.0)
    dx = torch.randint(0, 2 * max_px + 1, (n,), generator=gen)
    dy = torch.randint(0, 2 * max_px + 1, (n,), generator=gen)
    return torch.stack([pad[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(n)])


def contrastive_loss(img: torch.Tensor, txt: torch.Tensor, logit_scale: torch.Tensor, caption_ids: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE; pairs with the same caption are all positives (soft targets)."""
    img = F.normalize(img.float(), dim=-1)
    txt = F.normalize(txt.float(), dim=-1)
    logits = logit_scale.float().exp().clamp(max=100.0) * img @ txt.T
    same = (caption_ids[:, None] == caption_ids[None, :]).float()
    target = same / same.sum(1, keepdim=True)
    loss_i = -(target * logits.log_softmax(1)).sum(1).mean()
    loss_t = -(target * logits.T.log_softmax(1)).sum(1).mean()
    return (loss_i + loss_t) / 2


def _lr_at(step: int, cfg: ClipTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def split_holdout(n: int, holdout: int, where: str = "holdout") -> tuple[np.ndarray, np.ndarray]:
    """(held-out indices, training indices): the first `holdout` items of the seeded order."""
    if holdout >= n - 1:
        raise PocketdiffError(f"{where}: {holdout} held-out items leave {n - holdout} of {n} for training (need >= 2)")
    return np.arange(holdout), np.arange(holdout, n)


def train_clip(cfg: Config, images: torch.Tensor, captions: list[str], tokenizer, device: torch.device, log=print):
    """Train a CLIPModel on uint8 `images` [N, 3, R, R] with `captions`; returns (model, processor, losses)."""
    model, processor = build_clip(cfg.model, tokenizer, cfg.seed)
    model.to(device).train()
    distinct = {t: i for i, t in enumerate(sorted(set(captions)))}
    caption_ids_all = torch.tensor([distinct[t] for t in captions], dtype=torch.long)
    enc = tokenizer(captions, padding="max_length", truncation=True, max_length=cfg.model.max_length, return_tensors="pt")
    ids_all, mask_all = enc.input_ids, enc.attention_mask
    mean, std = (torch.tensor(v, dtype=torch.float32, device=device) for v in (processor.image_processor.image_mean, processor.image_processor.image_std))

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or "embedding" in name or name == "logit_scale" else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.train.lr, betas=(0.9, 0.98), eps=1e-6)
    gen = torch.Generator("cpu").manual_seed(cfg.seed + 1)
    n = len(images)
    bs = min(cfg.train.batch_size, n)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    use_amp = amp is not None and device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if use_amp and amp == torch.float16 else None
    losses: list[tuple[int, float]] = []
    perm, pos = torch.randperm(n, generator=gen), 0
    t0 = time.time()
    for step in range(cfg.train.steps):
        if pos + bs > n:
            perm, pos = torch.randperm(n, generator=gen), 0
        idx = perm[pos : pos + bs]
        pos += bs
        x = images[idx].to(device).float() / 255.0
        if cfg.train.augment == "shift":
            x = _shift(x.cpu(), cfg.train.shift_px, gen).to(device)
        x = preprocess_images(x, cfg.model.image_size, mean, std)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg.train)
        with torch.autocast(device.type, dtype=amp, enabled=use_amp):
            vis = model.visual_projection(model.vision_model(pixel_values=x).pooler_output)
            mask = mask_all[idx]
            width = int(mask.sum(1).max())  # trim padding: pooling reads the first end token, which is kept
            txt = model.text_projection(model.text_model(input_ids=ids_all[idx][:, :width].to(device),
                                                         attention_mask=mask[:, :width].to(device)).pooler_output)
        loss = contrastive_loss(vis, txt, model.logit_scale, caption_ids_all[idx].to(device))
        if not torch.isfinite(loss):
            raise PocketdiffError(f"train-clip: loss became {loss.item()} at step {step} (lower train.lr)")
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100.0))
        if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
            losses.append((step, float(loss.item())))
            log(f"train-clip step {step}/{cfg.train.steps} loss {loss.item():.4f} ({time.time() - t0:.1f} s)")
    model.eval()
    return model, processor, losses


def save_clip(model, processor, out_dir: Path, meta: dict, save_dtype: str = "fp32") -> Path:
    """CLIPModel + CLIPProcessor (save_pretrained, safetensors), vocab.json/merges.txt, pocketdiff_clip.json."""
    from pocketdiff.tokenizer import export_vocab_merges

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    to_save = model
    if save_dtype == "fp16":
        import copy

        to_save = copy.deepcopy(model).to(torch.float16)
    to_save.save_pretrained(str(out_dir), safe_serialization=True)
    processor.save_pretrained(str(out_dir))
    try:
        export_vocab_merges(processor.tokenizer, out_dir)
    except PocketdiffError:  # pragma: no cover - the project tokenizer is always BPE
        pass
    (out_dir / CLIP_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir


def run(cfg: Config, out: Path, resume: Optional[str] = None) -> dict:
    from pocketdiff.tokenizer import build_clip_tokenizer

    if resume is not None:
        raise PocketdiffError("train-clip keeps no checkpoints (runs take minutes): run it again without --resume")
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    device = resolve_device(cfg.device)
    out = Path(out)

    # 1. data and split
    t0 = time.time()
    ds = load_captioned_dataset(cfg.data)
    captions = list(ds["text"])
    held, train_idx = split_holdout(len(captions), cfg.holdout)
    images = images_to_uint8(ds)
    train_caps = [captions[i] for i in train_idx]
    held_caps = [captions[i] for i in held]
    data_s = time.time() - t0

    # 2. tokenizer (training captions only) and model
    clip_dir = out / "clip"
    clip_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_clip_tokenizer(train_caps, out_dir=None, vocab_size=cfg.model.vocab_size, model_max_length=cfg.model.max_length)

    # 3. training
    t1 = time.time()
    model, processor, losses = train_clip(cfg, images[torch.as_tensor(train_idx)], train_caps, tokenizer, device)
    train_s = time.time() - t1

    # 4. held-out retrieval (and on training items, for the overfitting gap)
    retrieval = retrieval_accuracy(model, processor, images[torch.as_tensor(held)], held_caps)
    n_check = min(len(train_idx), len(held))
    retrieval_train = retrieval_accuracy(model, processor, images[torch.as_tensor(train_idx[:n_check])], train_caps[:n_check])

    # 5. outputs
    model.to("cpu")
    params = sum(p.numel() for p in model.parameters())
    meta = {
        "domain": cfg.domain,
        "label": f"{cfg.domain}-CLIP",
        "data": dataclasses.asdict(cfg.data),
        "holdout": cfg.holdout,
        "holdout_rule": "first `holdout` items of load_captioned_dataset(data) (seeded order) are held out",
        "train_items": len(train_idx),
        "retrieval_heldout": retrieval,
        "params": params,
        "train_steps": cfg.train.steps,
        "seed": cfg.seed,
    }
    save_clip(model, processor, clip_dir, meta, cfg.save_dtype)
    size_bytes = sum(p.stat().st_size for p in clip_dir.iterdir() if p.is_file())
    report = {
        "clip_dir": str(clip_dir),
        "domain": cfg.domain,
        "data": {"source": cfg.data.source, "items": len(captions), "train_items": len(train_idx), "heldout_items": len(held),
                 "distinct_captions": len(set(captions)), "resolution": cfg.data.resolution},
        "params": params,
        "folder_bytes": size_bytes,
        "device": str(device),
        "final_loss": losses[-1][1] if losses else None,
        "losses": losses,
        "retrieval_heldout": retrieval,
        "retrieval_train_subset": retrieval_train,
        "seconds": {"data": round(data_s, 2), "train": round(train_s, 2)},
    }
    plot_curves({"contrastive loss": losses}, out / "loss.png", "step", "loss", "train-clip loss")
    rows = [(name, f"{r['image_to_text_top1']:.3f}", f"{r['image_to_text_top5']:.3f}", f"{r['text_to_image_top1']:.3f}",
             f"{r['text_to_image_top5']:.3f}", r["num_images"], r["num_captions"], f"{r['chance_image_to_text_top1']:.4f}")
            for name, r in (("held-out", retrieval), ("training subset", retrieval_train))]
    sections = [
        ("Retrieval accuracy", table(["items", "img->txt top1", "img->txt top5", "txt->img top1", "txt->img top5", "images",
                                      "distinct captions", "chance top1"], rows)),
        ("Loss", img("loss.png")),
    ]
    write_page(out / "index.html", f"pocketdiff train-clip ({cfg.domain})", sections, report)
    write_json(out / "report.json", report)
    return report
