"""Image <-> text retrieval accuracy of a CLIP model on held-out captioned images.

Captions may repeat (the procedural shapes set has 720 distinct captions): candidates are
the *distinct* captions of the held-out items, and an image's retrieval counts as correct
when a caption equal to its own ranks within the top k. Text -> image: a caption is correct
when any image carrying it ranks within the top k. Chance levels are reported beside.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from pocketdiff.errors import PocketdiffError

from .features import _pooled, preprocess_images, processor_norm


@torch.no_grad()
def encode_images(model: Any, processor: Any, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """uint8 [N, 3, H, W] -> L2-normalised projected image embeddings [N, D] (float32, CPU)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    mean, std = (torch.tensor(v, dtype=torch.float32, device=device) for v in processor_norm(processor))
    size = int(model.config.vision_config.image_size)
    out = []
    for i in range(0, len(images), batch_size):
        x = preprocess_images(images[i : i + batch_size].to(device), size, mean, std).to(dtype)
        out.append(_pooled(model.get_image_features(pixel_values=x)).float())
    feats = torch.cat(out)
    return torch.nn.functional.normalize(feats, dim=-1).cpu()


@torch.no_grad()
def encode_texts(model: Any, tokenizer: Any, texts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
    """Captions -> L2-normalised projected text embeddings [N, D] (float32, CPU)."""
    device = next(model.parameters()).device
    max_len = int(model.config.text_config.max_position_embeddings)
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[i : i + batch_size]), padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
        f = model.get_text_features(input_ids=enc.input_ids.to(device), attention_mask=enc.attention_mask.to(device))
        out.append(_pooled(f).float())
    feats = torch.cat(out)
    return torch.nn.functional.normalize(feats, dim=-1).cpu()


def retrieval_from_embeddings(img: torch.Tensor, txt_unique: torch.Tensor, caption_index: np.ndarray, ks: Sequence[int] = (1, 5)) -> dict:
    """`img` [N, D], `txt_unique` [C, D] (distinct captions), `caption_index[n]` = caption of image n."""
    n, c = img.shape[0], txt_unique.shape[0]
    sim = img @ txt_unique.T  # [N, C]
    caption_index = torch.as_tensor(caption_index, dtype=torch.long)
    # image -> text: rank of the true caption among all distinct captions
    true = sim[torch.arange(n), caption_index]
    i2t_rank = (sim > true[:, None]).sum(1)  # 0 = first
    # text -> image: best rank of any image carrying that caption
    order = sim.T.argsort(dim=1, descending=True)  # [C, N] image indices by similarity
    owners = caption_index[order]  # [C, N] caption of each ranked image
    hit = owners == torch.arange(c)[:, None]
    t2i_rank = hit.float().argmax(1)
    out: dict = {"num_images": n, "num_captions": c}
    for k in ks:
        out[f"image_to_text_top{k}"] = float((i2t_rank < k).float().mean())
        out[f"text_to_image_top{k}"] = float((t2i_rank < k).float().mean())
        out[f"chance_image_to_text_top{k}"] = min(1.0, k / c)
    return out


def retrieval_accuracy(model: Any, processor: Any, images: torch.Tensor, captions: Sequence[str], ks: Sequence[int] = (1, 5), batch_size: int = 256) -> dict:
    """Image->text and text->image top-k accuracy over held-out (image, caption) pairs."""
    if len(images) != len(captions):
        raise PocketdiffError(f"retrieval: {len(images)} images but {len(captions)} captions")
    if len(images) < 2:
        raise PocketdiffError(f"retrieval: needs at least 2 held-out items, got {len(images)}")
    distinct = sorted(set(captions))
    index = {t: i for i, t in enumerate(distinct)}
    caption_index = np.array([index[t] for t in captions])
    was_training = model.training
    model.eval()
    try:
        img = encode_images(model, processor, images, batch_size)
        txt = encode_texts(model, getattr(processor, "tokenizer", processor), distinct, batch_size)
    finally:
        model.train(was_training)
    return retrieval_from_embeddings(img, txt, caption_index, ks)
