"""The SDXL family's text-encoder outputs as export graphs (export/components.py `TextEncoderGraph`).

`run_clip` runs a CLIP text encoder's layers as transformers' CLIPTextModel does (the chunks' recipe,
export/text_encoder_chunks.py) and returns the penultimate layer's output, ``hidden_states[-2]``, what
StableDiffusionXLPipeline.encode_prompt feeds the UNet; with `final`, also the last layer's output after the final
layer norm (the state the pooled embedding is read from).

`EndTokenPool` reads that state at the end token, as CLIPTextModel's pooler does, with ops the GPU delegate runs (no
ARGMAX, no integer compare): a marker per token by a table lookup of its id (the same GATHER as the token embedding),
the first marked position kept by a matmul with a strictly upper-triangular matrix of ones (marks before each
position) and a ReLU, then a matmul of the one-hot row with the states. transformers picks the position two ways:

- `eos_token_id` other than 2: the first position holding `eos_token_id` (the marker table: 1 at that id);
- `eos_token_id` 2 (configs from before transformers' fix, SDXL base's among them): the argmax of the ids, the
  position of the largest id. The marker is then 1 at the vocabulary's last id (CLIP's end token, 49407 of 49408,
  which its tokenizer appends to every prompt), and the first such position is the argmax whenever the sequence
  holds it. (The ids themselves cannot be compared on the device: at fp16 49406 and 49407 are one number.)
"""
from __future__ import annotations

import torch
from torch import nn

from .text_encoder_chunks import clip_parts


def run_clip(text_encoder: nn.Module, input_ids: torch.Tensor, final: bool = False):
    """(penultimate layer's output [B, L, D], the final-normed last layer's output or None)."""
    from transformers.masking_utils import create_causal_mask

    parts = clip_parts(text_encoder)
    h = parts.embeddings(input_ids=input_ids.view(-1, input_ids.shape[-1]))
    mask = create_causal_mask(config=parts.config, inputs_embeds=h, attention_mask=None, past_key_values=None)

    def layer(module, x):
        out = module(x, mask, is_causal=True)
        return out[0] if isinstance(out, tuple) else out

    for module in parts.layers[:-1]:
        h = layer(module, h)
    if not final:
        return h, None
    return h, parts.final_layer_norm(layer(parts.layers[-1], h))


class EndTokenPool(nn.Module):
    """[B, L] int ids, [B, L, D] states -> [B, D]: the states at the end token (see the module's docstring)."""

    def __init__(self, config):
        super().__init__()
        vocab, eos = int(config.vocab_size), int(config.eos_token_id)
        marked = vocab - 1 if eos == 2 else eos  # the legacy argmax: CLIP's end token is the vocabulary's last id
        marker = torch.zeros(vocab, 1)
        marker[marked, 0] = 1.0
        self.register_buffer("marker", marker, persistent=False)
        n = int(config.max_position_embeddings)  # before[i, j] = 1 where i < j: marks before position j
        self.register_buffer("before", torch.triu(torch.ones(n, n), diagonal=1), persistent=False)

    def forward(self, input_ids: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        L = input_ids.shape[-1]
        marks = nn.functional.embedding(input_ids.view(-1, L), self.marker)[..., 0]  # [B, L]
        earlier = torch.matmul(marks, self.before[:L, :L])  # [B, L]: how many marks precede each position
        first = marks * torch.relu(1.0 - earlier)  # 1 at the first marked position only
        return torch.matmul(first.unsqueeze(1), states)[:, 0]
