"""The text encoder as K graphs run one after another (`text_encoder_chunks` in the export config).

The same lever as the UNet's chunks (export/unet_chunks.py): LiteRT's GPU accelerator holds a host transient
of several times a model's weights while it compiles it, so K lighter graphs compiled one after another (and,
pipelined, each released before the next) keep one chunk's transient alive at a time. A CLIP text encoder
(transformers' CLIPTextModel) is a stack of identical layers, so the cut points are layer boundaries, balanced
by parameter count: chunk 0 holds the embeddings and the first layers and takes `input_ids`; the last holds
the final layer norm and returns the text encoder's output, `out`; between them the stream, `hidden`
[1, L, D]. Each chunk rebuilds the causal mask the whole model builds (a constant of the fixed shape).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.chunks import OUTPUT, STREAM

from .unet_chunks import ChunkPlan, balanced_bounds

TEXT_ENCODER = "text_encoder"


class ClipParts(NamedTuple):
    config: object
    embeddings: nn.Module
    layers: nn.ModuleList
    final_layer_norm: nn.Module


def clip_parts(text_encoder: nn.Module) -> ClipParts:
    """A CLIP text encoder's parts (transformers 5's flat CLIPTextModel, or one holding `text_model`)."""
    inner = getattr(text_encoder, "text_model", text_encoder)
    layers = getattr(getattr(inner, "encoder", None), "layers", None)
    if not all(hasattr(inner, a) for a in ("embeddings", "final_layer_norm")) or not isinstance(layers, nn.ModuleList):
        raise PocketdiffError(f"text_encoder_chunks: {type(text_encoder).__name__} is not a CLIP text encoder (embeddings, "
                              "encoder.layers, final_layer_norm); use text_encoder_chunks: 1")
    return ClipParts(text_encoder.config, inner.embeddings, layers, inner.final_layer_norm)


def _params(*mods: nn.Module) -> int:
    return int(sum(p.numel() for m in mods for p in m.parameters()))


def plan_text_encoder_chunks(text_encoder: nn.Module, k: int) -> list[tuple[ChunkPlan, tuple[int, int]]]:
    """The K chunks of the text encoder, cut between layers and balanced by parameter count: each chunk's plan
    and its [start, end) run of layers."""
    parts = clip_parts(text_encoder)
    weights = [_params(layer) for layer in parts.layers]
    weights[0] += _params(parts.embeddings)
    weights[-1] += _params(parts.final_layer_norm)
    bounds = balanced_bounds(weights, k, "layers", "the text encoder", "text_encoder_chunks")
    plans = []
    for c, (a, b) in enumerate(bounds):
        stages = (["embeddings"] if c == 0 else []) + [f"encoder.layers.{i}" for i in range(a, b)] + (["final_layer_norm"] if c == k - 1 else [])
        plans.append((ChunkPlan(c, k, stages, sum(weights[a:b]), ["input_ids"] if c == 0 else [STREAM],
                                [OUTPUT] if c == k - 1 else [STREAM], {}, "layer"), (a, b)))
    return plans


class TextEncoderChunk(nn.Module):
    """Layers [a, b) of a CLIP text encoder (with the embeddings first, the final norm last): positional
    tensors in `plan.inputs` order -> a dict of `plan.outputs`, as CLIPTextModel's forward runs them."""

    def __init__(self, text_encoder: nn.Module, plan: ChunkPlan, bounds: tuple[int, int]):
        super().__init__()
        parts = clip_parts(text_encoder)
        self.plan, self.config = plan, parts.config
        self.embeddings = parts.embeddings if plan.index == 0 else None
        self.layers = nn.ModuleList(parts.layers[bounds[0]:bounds[1]])
        self.final_layer_norm = parts.final_layer_norm if plan.index == plan.count - 1 else None

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.masking_utils import create_causal_mask

        h = self.embeddings(input_ids=x.view(-1, x.shape[-1])) if self.embeddings is not None else x
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None)
        for layer in self.layers:
            h = layer(h, mask, is_causal=True)
            h = h[0] if isinstance(h, tuple) else h
        if self.final_layer_norm is not None:
            return {OUTPUT: self.final_layer_norm(h)}
        return {STREAM: h}


def split_text_encoder(text_encoder: nn.Module, k: int) -> list[TextEncoderChunk]:
    """The K chunk graphs of `text_encoder` (sharing its modules)."""
    return [TextEncoderChunk(text_encoder, plan, bounds) for plan, bounds in plan_text_encoder_chunks(text_encoder, k)]
