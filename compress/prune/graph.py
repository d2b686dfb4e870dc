"""Dependency groups of a diffusers UNet2DConditionModel: the ResNet-internal channel sets.

The package's other parts: `targets` (which convs), `stream` (residual-stream tracing),
`allocation` (how many and which channels each group keeps), `slicing` (the surgery).

What can be removed, and what must move with it
------------------------------------------------
The unit of structured pruning here is the *internal* channel set of a `ResnetBlock2D`:

    x -> norm1 -> SiLU -> conv1 --(+ time_emb_proj(temb))--> norm2 -> SiLU -> conv2 -> (+ shortcut) -> out
                          ^^^^^ out channels        ^^^^ rows     ^^^^^ GroupNorm   ^^^^^ in channels

Removing conv1's output channel ``c`` removes row ``c`` of ``time_emb_proj`` (rows ``c``
and ``n + c`` with ``time_embedding_norm="scale_shift"``), channel ``c`` of ``norm2``
(weight, bias and group membership) and input channel ``c`` of ``conv2``. The block's
external interface (its input and output channel counts) is unchanged, so residual
additions, the shortcut conv, the next block and the up-block skip concatenations need
no change at all. These groups hold most of the large convolutions (every ResNet conv1 /
conv2, e.g. the 3x3 up-block conv1 over 1920 input channels of SD).

Block-output channels (coupled with the residual stream, the shortcut, the next blocks and
the skip concatenation) are not pruned here: with ``prune.scope: internal`` (the default)
those convs are reported as "not prunable"; ``prune.scope: stream / all`` prunes them
through `stream`, which traces the streams (sliced by `slicing`, every producer and consumer).

GroupNorm semantics
-------------------
``norm2`` normalises contiguous groups of channels. Removing arbitrary channels would move
channels between groups and change every group's statistics. Two modes keep it well defined:

- ``whole_groups`` (default, exact): a GroupNorm group is the pruning unit. The group
  count shrinks (``num_groups = kept groups``) and every surviving channel is normalised
  over exactly the same channels as before. If removed channels contribute nothing
  downstream, the pruned block computes the same function (tested).
- ``per_group``: ``num_groups`` is kept and the same number of channels is removed from
  every group (the least important ones inside each group), so each group keeps its
  members minus the removed ones, in order. Group statistics are then computed over fewer
  channels: an approximation that the recovery fine-tune absorbs.

Channel counts after pruning are always multiples of ``round_to`` and, in ``per_group``
mode, of the group count; in ``whole_groups`` mode of the group size.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

GROUPNORM_MODES = ("whole_groups", "per_group")


# --------------------------------------------------------------------------------------
# Dependency groups
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class InternalGroup:
    """The internal channels of one ResnetBlock2D (conv1 out = norm2 = conv2 in = time_emb_proj rows)."""

    name: str  # module path of the ResnetBlock2D, e.g. "up_blocks.1.resnets.0"
    block: nn.Module

    @property
    def conv1(self) -> nn.Conv2d:
        return self.block.conv1

    @property
    def conv2(self) -> nn.Conv2d:
        return self.block.conv2

    @property
    def norm2(self) -> nn.GroupNorm:
        return self.block.norm2

    @property
    def time_emb_proj(self) -> Optional[nn.Linear]:
        return getattr(self.block, "time_emb_proj", None)

    @property
    def scale_shift(self) -> bool:
        return getattr(self.block, "time_embedding_norm", "default") == "scale_shift"

    @property
    def channels(self) -> int:
        return self.conv1.out_channels

    @property
    def num_groups(self) -> int:
        return self.norm2.num_groups

    @property
    def group_size(self) -> int:
        return self.channels // self.num_groups

    @property
    def conv_names(self) -> tuple[str, str]:
        return (f"{self.name}.conv1", f"{self.name}.conv2")

    def params_per_channel(self) -> int:
        """Parameters removed with one internal channel (conv1 filter + bias, conv2 input slice,
        time-embedding row(s), norm2 weight + bias)."""
        c1, c2 = self.conv1, self.conv2
        n = c1.in_channels * c1.kernel_size[0] * c1.kernel_size[1] + (1 if c1.bias is not None else 0)
        n += c2.out_channels * c2.kernel_size[0] * c2.kernel_size[1]
        proj = self.time_emb_proj
        if proj is not None:
            n += (2 if self.scale_shift else 1) * (proj.in_features + (1 if proj.bias is not None else 0))
        n += 2 if self.norm2.affine else 0
        return n


def _why_not_internal(block: nn.Module) -> Optional[str]:
    conv1, conv2, norm2 = getattr(block, "conv1", None), getattr(block, "conv2", None), getattr(block, "norm2", None)
    if not isinstance(conv1, nn.Conv2d) or not isinstance(conv2, nn.Conv2d):
        return "conv1/conv2 are not Conv2d"
    if not isinstance(norm2, nn.GroupNorm):
        return "norm2 is not a GroupNorm"
    if conv1.groups != 1 or conv2.groups != 1:
        return "grouped convolution"
    n = conv1.out_channels
    if norm2.num_channels != n or conv2.in_channels != n:
        return "conv1 / norm2 / conv2 channel counts disagree"
    if n % norm2.num_groups:
        return "norm2 channels not divisible by its groups"
    if getattr(block, "time_embedding_norm", "default") not in ("default", "scale_shift"):
        return f"time_embedding_norm={block.time_embedding_norm!r}"
    proj = getattr(block, "time_emb_proj", None)
    if proj is not None:
        want = 2 * n if getattr(block, "time_embedding_norm", "default") == "scale_shift" else n
        if not isinstance(proj, nn.Linear) or proj.out_features != want:
            return "time_emb_proj shape does not match conv1"
    return None


def find_internal_groups(unet: nn.Module) -> list[InternalGroup]:
    """Every ResnetBlock2D of `unet` whose internal channels can be pruned, in module order."""
    from diffusers.models.resnet import ResnetBlock2D

    groups = []
    for name, module in unet.named_modules():
        if isinstance(module, ResnetBlock2D) and _why_not_internal(module) is None:
            groups.append(InternalGroup(name, module))
    return groups


# --------------------------------------------------------------------------------------
# A shape-only twin (for the conv profile in `targets` and the stream trace in `stream`)
# --------------------------------------------------------------------------------------

def _meta_twin(unet: nn.Module) -> nn.Module:
    """A copy of `unet` on the meta device (same module shapes, no data)."""
    import copy

    if all(p.device.type == "meta" for p in unet.parameters()):
        return unet
    # deepcopy with every parameter / buffer pre-mapped to an empty meta tensor: no data is copied
    memo = {id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
            for p in unet.parameters()}
    for b in unet.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(unet, memo)
