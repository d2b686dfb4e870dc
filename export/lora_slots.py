"""LoRA slots (export `lora_slots: {rank, targets}`): the UNet's attention projections take LoRA factors as graph inputs,
so a runner swaps LoRAs by feeding other factors, with no re-export and no recompiling (runtime/lora_slots.py).

Each targeted projection (`targets`: `attn` = the q, k, v and out projections of self- and cross-attention, MediaPipe's
choice; `attn1` / `attn2` one of them) becomes `proj(x) + (x @ down) @ up`, with `down` [in, rank] and `up` [rank, out]
(the LoRA's up factor scaled by scale * alpha / rank) two inputs of the graph named by the module
(pocketdiff/lora_keys.py `slot_input_names`). The projection itself stays what it was, so the rewrites (a 1x1 conv,
int8 codes) apply to it unchanged: its `pd_source` is the name it has without the slot. The branch is computed on the
tokens flattened to [N, in]: two matmuls with activations as their second operand, which LiteRT converts to
BATCH_MATMUL (the GPU delegate runs them; tests/export/test_lora_slots.py). No LoRA is zero factors.

The golden inputs carry small seeded factors, so the export's delegate parity checks the branch too. A chunked UNet
(`unet_chunks` > 1) is cut after the slots are added: each chunk takes the factor inputs of the slots in its stages, by
the same names (export/unet_chunks.py plan_chunks), and the manifest's `lora_slots` block is the whole UNet's.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError, require
from pocketdiff.lora_keys import SLOT_ATTENTIONS, SLOT_PROJECTIONS, slot_input_names

from .components import UNetGraph

MAX_RANK = 128


@dataclasses.dataclass
class LoraSlotsConfig:
    rank: int = 4  # the largest LoRA rank a runner can feed (a smaller one is zero-padded)
    targets: list[str] = dataclasses.field(default_factory=lambda: ["attn"])  # attn | attn1 | attn2

    def __post_init__(self) -> None:
        require(isinstance(self.rank, int) and not isinstance(self.rank, bool) and 1 <= self.rank <= MAX_RANK, "lora_slots.rank",
                f"must be an int from 1 to {MAX_RANK}, got {self.rank!r}")
        require(isinstance(self.targets, list) and self.targets and all(t in SLOT_ATTENTIONS for t in self.targets), "lora_slots.targets",
                f"must list some of {', '.join(SLOT_ATTENTIONS)}, got {self.targets!r}")
        require(len(set(self.targets)) == len(self.targets), "lora_slots.targets", f"must not repeat, got {self.targets!r}")


def slot_modules(unet: nn.Module, cfg: LoraSlotsConfig) -> list[str]:
    """The UNet's module names the slots take, in module order: every Linear `<...>.<attn>.<projection>`."""
    attns = {a for t in cfg.targets for a in SLOT_ATTENTIONS[t]}
    names = [n for n, m in unet.named_modules()
             if isinstance(m, nn.Linear) and any(n.endswith(f".{a}.{p}") for a in attns for p in SLOT_PROJECTIONS)]
    if not names:
        raise PocketdiffError(f"lora_slots.targets: {cfg.targets} match no attention projection of this UNet")
    return names


class LoraSlot(nn.Module):
    """proj(x) + (x @ down) @ up, the factors read from the graph's feed (the UNet graph's inputs) by module name."""

    def __init__(self, base: nn.Module, name: str, feed: dict):
        super().__init__()
        self.base, self.slot_name, self.feed = base, name, feed

    @property
    def weight(self) -> torch.Tensor:  # diffusers peeks at .weight.dtype
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down, up = self.feed[self.slot_name]
        lead = x.shape[:-1]
        branch = (x.reshape(-1, x.shape[-1]) @ down) @ up
        return self.base(x) + branch.reshape(*lead, up.shape[-1])


class SlottedUNetGraph(UNetGraph):
    """A UNetGraph whose inputs end with every slot's (down, up) factors, in `lora_modules` order."""

    def forward(self, sample, timestep, encoder_hidden_states, *rest):
        n = len(self.extra_inputs)
        extra, factors = rest[:n], rest[n:]
        if len(factors) != 2 * len(self.lora_modules):
            raise PocketdiffError(f"lora slots: the graph takes {2 * len(self.lora_modules)} factor inputs, got {len(factors)}")
        self.lora_feed.update({m: (factors[2 * i], factors[2 * i + 1]) for i, m in enumerate(self.lora_modules)})
        try:
            return super().forward(sample, timestep, encoder_hidden_states, *extra)
        finally:
            self.lora_feed.clear()


def golden_factors(names: list[str], shapes: dict, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Small seeded factors for the golden inputs (the parity check then covers the branch): down ~ N(0, 1/in),
    up ~ N(0, 0.05^2), so the branch changes each projection's output by a few percent."""
    g = torch.Generator().manual_seed(seed + 65)
    out = {}
    for name in names:
        n_in, n_out = shapes[name]
        d, u = slot_input_names(name)
        out[d] = torch.randn(n_in, rank, generator=g) / float(n_in) ** 0.5
        out[u] = 0.05 * torch.randn(rank, n_out, generator=g)
    return out


def add_lora_slots(graph: UNetGraph, inputs: dict, cfg: LoraSlotsConfig, seed: int = 0
                   ) -> tuple[SlottedUNetGraph, dict[str, torch.Tensor], dict]:
    """`graph` with its targeted projections slotted (in place: its class becomes SlottedUNetGraph), its inputs with
    the golden factors after the others, and the manifest's `lora_slots` block {rank, targets, inputs}."""
    unet = graph.unet
    names = slot_modules(unet, cfg)
    feed: dict = {}
    shapes = {}
    for name in names:
        parent, _, child = name.rpartition(".")
        linear = unet.get_submodule(name)
        linear.pd_source = (f"unet.{name}", None, None)  # the name the rewrites and int8 know it by, without the slot
        shapes[name] = (int(linear.in_features), int(linear.out_features))
        setattr(unet.get_submodule(parent), child, LoraSlot(linear, name, feed))
    graph.__class__ = SlottedUNetGraph
    graph.lora_feed, graph.lora_modules = feed, names
    block = {"rank": cfg.rank, "targets": names, "inputs": {n: list(slot_input_names(n)) for n in names}}
    return graph, {**inputs, **golden_factors(names, shapes, cfg.rank, seed)}, block


def check_slot_settings(slots: Optional[LoraSlotsConfig], components: list) -> None:
    """The export settings slots cannot go with: no UNet exported. (A chunked UNet takes them: each chunk its slots'.)"""
    if slots is None:
        return
    require("unet" in components, "lora_slots", "slots the UNet, which components does not list")
