"""Block removal as a UNet2DConditionModel config change (BK-SDM's shapes), shared by `prune` (which
initialises the slim UNet from the teacher's kept blocks) and by built models (`model.blocks`: the shape of
a preset with random weights, e.g. an SD-2.1-size `tiny` student to export without a trained checkpoint).

Names. A *layer* is a resnet with its attention, if the block has one (`down_blocks.1.layers.0`; the
spellings `down_blocks.1.resnets.0` and `down_blocks.1.attentions.0` name the same layer); a *stage* is a
whole down or up block (`down_blocks.3`, `up_blocks.0`); `mid_block` is the mid block.

Presets (on any SD-family config; with SD's 2 layers per down stage):

- `base`: one layer per down stage (the first) and two per up stage (the first and the last):
  diffusers `layers_per_block: 1`;
- `small`: `base` without the mid block (`mid_block_type: null`);
- `tiny`: `small` without the lowest-resolution stage (the last down block and the first up block):
  SD's 4 stages become 3, `block_out_channels` (320, 640, 1280), every block with attention.

KOALA-style presets (for SDXL-shaped UNets, whose lowest stage's transformers are deep: SDXL's 10 blocks each):

- `koala_1b`: `base`, and the transformers of the lowest-resolution stage with attention keep their first 60% of
  transformer blocks (SDXL: 10 -> 6; the mid block, which diffusers builds at that stage's depth, too): SDXL's 2.57 B
  UNet -> 1.16 B;
- `koala_700m`: `small` with the first 50% kept (10 -> 5): 0.78 B.

A transformer-depth cut is named `down_blocks.I.transformer_blocks.K` (block K of every transformer of down stage I
and of its mirrored up stage); only a tail can go (the first blocks keep their names, so the teacher's weights map
by name), and at least one block stays.

Which teacher layers the slim UNet keeps is decided by shapes. In a down stage the first layer takes the
previous stage's channels, the others the stage's own: the first is kept. In an up stage the last layer takes
the skip connection of the previous (higher-resolution) stage's downsampler, so its input is narrower than the
others'; the first takes the stream from the stage below (`prev_output_channel`). Keeping the first and the
last keeps every kept layer's input shape; diffusers gives an up stage one layer more than its down stage,
so an explicit list must keep that (`layers_per_block` may become a per-stage list).

Stages can only go from the bottom (lowest resolution) up, a down stage together with its mirrored up stage:
the stages above them keep their shapes. The last kept down stage loses its downsampler (diffusers adds one
to every down block but the last).
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

from .errors import PocketdiffError

PRESETS = ("base", "small", "tiny")  # the SD family's (configs/sd21/prune_blocks_<preset>.yaml)
XL_PRESETS = {"koala_1b": ("base", 0.6), "koala_700m": ("small", 0.5)}  # (layers / mid preset, lowest stage's kept depth)
ALL_PRESETS = PRESETS + tuple(XL_PRESETS)
MID = "mid_block"
# config keys holding one entry per down block (in down order) / per up block (in up order)
_PER_DOWN = ("block_out_channels", "down_block_types", "layers_per_block", "attention_head_dim", "num_attention_heads",
             "cross_attention_dim", "only_cross_attention", "transformer_layers_per_block")
_PER_UP = ("up_block_types", "reverse_transformer_layers_per_block")
_NAME = re.compile(r"^(down_blocks|up_blocks)\.(\d+)(?:\.(layers|resnets|attentions)\.(\d+))?$")
_DEPTH = re.compile(r"^down_blocks\.(\d+)\.transformer_blocks\.(\d+)$")


def _layers_per_down(config: dict) -> list[int]:
    n = len(config["down_block_types"])
    lpb = config.get("layers_per_block", 2)
    return [int(x) for x in lpb] if isinstance(lpb, (list, tuple)) else [int(lpb)] * n


def _has_mid(config: dict) -> bool:
    return config.get("mid_block_type", "UNetMidBlock2DCrossAttn") is not None


def _depths(config: dict) -> list[int]:
    """Transformer blocks per attention of each down stage (0: a stage without attention)."""
    n = len(config["down_block_types"])
    d = config.get("transformer_layers_per_block", 1)
    d = [int(x) for x in d] if isinstance(d, (list, tuple)) else [int(d)] * n
    return [d[i] if "CrossAttn" in config["down_block_types"][i] else 0 for i in range(n)]


def _koala_cut(config: dict, keep: float) -> list[str]:
    """The transformer blocks past the first `keep` share in the lowest-resolution stage with attention."""
    depths = _depths(config)
    stages = [i for i, d in enumerate(depths) if d > 0]
    if not stages:
        return []
    i = stages[-1]
    kept = max(1, round(depths[i] * keep))
    return [f"down_blocks.{i}.transformer_blocks.{k}" for k in range(kept, depths[i])]


def preset_removals(config: dict, preset: str, key: str = "blocks.preset") -> list[str]:
    """The layers, mid block and stages a preset removes from a UNet of `config` (names as above)."""
    if preset in XL_PRESETS:
        base, keep = XL_PRESETS[preset]
        return preset_removals(config, base, key) + _koala_cut(config, keep)
    if preset not in PRESETS:
        raise PocketdiffError(f"{key}: must be one of {', '.join(ALL_PRESETS)} (or null), got {preset!r}")
    down = _layers_per_down(config)
    n = len(down)
    out = []
    for i, L in enumerate(down):
        out += [f"down_blocks.{i}.layers.{k}" for k in range(1, L)]
        out += [f"up_blocks.{n - 1 - i}.layers.{k}" for k in range(1, L)]  # up stage: L + 1 layers, keep first and last
    if preset in ("small", "tiny") and _has_mid(config):
        out.append(MID)
    if preset == "tiny":
        if n < 2:
            raise PocketdiffError(f"{key}: tiny removes the lowest-resolution stage, and this UNet has only one")
        out += [f"down_blocks.{n - 1}", "up_blocks.0"]
    return out


def _parse(remove: Sequence[str], config: dict, key: str) -> tuple[set, bool, dict]:
    """(removed stage indices (down numbering), mid removed, {('down'|'up', stage): removed layer indices})."""
    down = _layers_per_down(config)
    n = len(down)
    stages_down, stages_up, layers, mid = set(), set(), {}, False
    depth_cuts: dict[int, set] = {}
    for name in remove:
        d = _DEPTH.match(str(name))
        if d is not None:
            i, k = int(d.group(1)), int(d.group(2))
            depths = _depths(config) if i < n else []
            if i >= n or k >= depths[i]:
                raise PocketdiffError(f"{key}: {name}: down_blocks.{i} has {depths[i] if i < n else 0} transformer blocks per attention")
            depth_cuts.setdefault(i, set()).add(k)
            continue
        if name == MID:
            if not _has_mid(config):
                raise PocketdiffError(f"{key}: mid_block: this UNet has no mid block")
            mid = True
            continue
        m = _NAME.match(str(name))
        if m is None:
            raise PocketdiffError(f"{key}: {name!r} is not a block name (mid_block, down_blocks.I, up_blocks.J, "
                                  "down_blocks.I.layers.K, up_blocks.J.layers.K)")
        kind, i = ("down" if m.group(1) == "down_blocks" else "up"), int(m.group(2))
        if i >= n:
            raise PocketdiffError(f"{key}: {name}: this UNet has {n} {kind} blocks")
        if m.group(3) is None:
            (stages_down if kind == "down" else stages_up).add(i if kind == "down" else n - 1 - i)
            continue
        k = int(m.group(4))
        count = down[i] if kind == "down" else down[n - 1 - i] + 1
        if k >= count:
            raise PocketdiffError(f"{key}: {name}: {m.group(1)}.{i} has {count} layers")
        layers.setdefault((kind, i), set()).add(k)
    if stages_down != stages_up:
        odd = sorted(stages_down ^ stages_up)[0]
        raise PocketdiffError(f"{key}: down_blocks.{odd} and up_blocks.{n - 1 - odd} go together (a stage and its mirror)")
    if stages_down and stages_down != set(range(n - len(stages_down), n)):
        raise PocketdiffError(f"{key}: stages go from the lowest resolution up: remove down_blocks.{n - 1} (and up_blocks.0) first")
    if len(stages_down) >= n:
        raise PocketdiffError(f"{key}: removes every stage; the UNet needs at least one")
    return stages_down, mid, layers, _kept_depths(depth_cuts, _depths(config), key)


def _kept_depths(cuts: dict[int, set], depths: list[int], key: str) -> dict[int, int]:
    """{down stage: transformer blocks kept}: each cut a tail of the stage's blocks, at least one kept."""
    out = {}
    for i, ks in cuts.items():
        first = min(ks)
        if ks != set(range(first, depths[i])) or first == 0:
            raise PocketdiffError(f"{key}: down_blocks.{i}.transformer_blocks: only a tail can go, keeping at least the "
                                  f"first: remove {first or 1}..{depths[i] - 1}, got {sorted(ks)}")
        out[i] = first
    return out


def slim_unet_config(config: dict, remove: Sequence[str], key: str = "blocks.remove") -> tuple[dict, dict[str, str]]:
    """The UNet2DConditionModel config without the `remove`d blocks, and the layer map
    {slim layer / sampler name: the teacher's} (e.g. ``up_blocks.0.layers.1 -> up_blocks.1.layers.2``)."""
    config = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    down = _layers_per_down(config)
    n = len(down)
    gone, mid, layers, kept_depth = _parse(remove, config, key)
    if kept_depth:  # before the per-stage lists are sliced: the depths of the original stages
        _cut_depths(config, kept_depth, n)
    kept = [i for i in range(n) if i not in gone]
    lmap: dict[str, str] = {}
    new_down = []
    for s, i in enumerate(kept):  # down stage i becomes s
        keep_d = [k for k in range(down[i]) if k not in layers.get(("down", i), set())]
        j = n - 1 - i
        keep_u = [k for k in range(down[i] + 1) if k not in layers.get(("up", j), set())]
        if not keep_d:
            raise PocketdiffError(f"{key}: leaves down_blocks.{i} empty (keep at least one of its {down[i]} layers)")
        if len(keep_u) != len(keep_d) + 1:
            raise PocketdiffError(f"{key}: up_blocks.{j} would keep {len(keep_u)} layers and down_blocks.{i} {len(keep_d)}: "
                                  f"diffusers builds an up stage with one layer more than its down stage")
        new_down.append(len(keep_d))
        lmap.update({f"down_blocks.{s}.layers.{a}": f"down_blocks.{i}.layers.{k}" for a, k in enumerate(keep_d)})
        t = len(kept) - 1 - s  # its up stage in the slim UNet
        lmap.update({f"up_blocks.{t}.layers.{a}": f"up_blocks.{j}.layers.{k}" for a, k in enumerate(keep_u)})
        if s < len(kept) - 1:  # diffusers: a downsampler in every down block but the last, an upsampler in every up block but the last
            lmap[f"down_blocks.{s}.sampler"] = f"down_blocks.{i}.sampler"
        if t < len(kept) - 1:
            lmap[f"up_blocks.{t}.sampler"] = f"up_blocks.{j}.sampler"
    for k in _PER_DOWN:
        v = config.get(k)
        if isinstance(v, (list, tuple)) and len(v) == n:
            config[k] = [v[i] for i in kept]
    for k in _PER_UP:
        v = config.get(k)
        if isinstance(v, (list, tuple)) and len(v) == n:
            config[k] = [v[n - 1 - i] for i in reversed(kept)]
    config["layers_per_block"] = new_down[0] if len(set(new_down)) == 1 else new_down
    if mid:
        config["mid_block_type"] = None
    elif _has_mid(config):  # (after a stage removal it works at the lowest kept stage's width: shapes are checked at init)
        lmap[MID] = MID
    return config, lmap


def _cut_depths(config: dict, kept: dict[int, int], n: int) -> None:
    """`transformer_layers_per_block` (and an explicit `reverse_transformer_layers_per_block`, the up stages') with
    down stage i's transformers (and its mirrored up stage's) at `kept[i]` blocks."""
    d = config.get("transformer_layers_per_block", 1)
    d = [int(x) for x in d] if isinstance(d, (list, tuple)) else [int(d)] * n
    config["transformer_layers_per_block"] = [kept.get(i, v) for i, v in enumerate(d)]
    rev = config.get("reverse_transformer_layers_per_block")
    if isinstance(rev, (list, tuple)) and len(rev) == n:
        config["reverse_transformer_layers_per_block"] = [kept.get(n - 1 - j, v) for j, v in enumerate(rev)]


def removals(config: dict, preset: Optional[str], remove: Sequence[str] = (), key: str = "blocks") -> list[str]:
    """A preset's removals and an explicit list together (each name once, the preset's first)."""
    names = preset_removals(config, preset, f"{key}.preset") if preset else []
    return names + [r for r in remove if r not in names]


def apply_preset(config: dict, preset: Optional[str], remove: Sequence[str] = (), key: str = "blocks") -> dict:
    """`config` with the preset's (and `remove`'s) blocks gone; `config` itself when there is nothing to remove."""
    names = (preset_removals(config, preset, key) if preset else []) + [r for r in remove]
    return slim_unet_config(config, names, key)[0] if names else dict(config)
