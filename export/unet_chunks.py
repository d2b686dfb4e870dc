"""The UNet as K graphs run one after another (`unet_chunks` in the export config).

LiteRT's GPU accelerator holds a host transient of several times a model's weights while it
compiles it (docs/MEASUREMENTS.md, "Bundle footprint"); K smaller graphs compiled one after
another keep only one chunk's transient alive at a time (Apple's ml-stable-diffusion splits its
UNet the same way for the Neural Engine). The cut points are block boundaries of a diffusers
UNet2DConditionModel: the stages are `down_blocks.i` (the first with `conv_in`), `mid_block` (when the UNet has
one: block-removed UNets such as BK-SDM-Small / Tiny, `mid_block_type: null`, go from the last down block straight
to the first up block), `up_blocks.i` (the last with `conv_norm_out` / `conv_out`), and the K contiguous runs of stages
are chosen so that the heaviest chunk's weights are as light as they can be. With `cut: layer` the
down and up blocks are cut further, into their layers (a resnet with its attention, or a resampler;
the mid block stays whole): SD-2.1's heaviest block, up_blocks.1 (260 M parameters), becomes three
layers of ~87 M and a resampler, so more chunks keep making each one lighter.

Between chunks the runner carries named tensors (runtime/chunks.py): `hidden` (the stream)
and `skip_J` (the J-th of the down path's skip connections, `skip_0` being conv_in's output),
besides the UNet's own `timestep` (the time-embedding row: the time embedding is computed outside
the graph) and `encoder_hidden_states`. The first chunk takes `sample`; the last one returns the
UNet's output, `out`. A chunk that ends with a down block returns that block's last skip connection
only as `hidden` (they are one tensor) and names it in its `aliases`.

An SDXL-style UNet (`addition_embed_type: text_time`) adds to the time-embedding row an embedding of the prompt's
pooled embedding and the size / crop ids (`add_time_proj` -> `add_embedding`), which every resnet reads. It depends on
the prompt, so no table holds it (runtime/BUNDLE.md): the first chunk takes `text_embeds` and `time_ids`, computes
`emb` = the row + the added embedding as UNet2DConditionModel.forward does, and returns it; later chunks take `emb` in
place of `timestep`, as they take the skip connections (one [B, 1280] tensor: no weights are repeated in later chunks).

A UNet with LoRA slots (export/lora_slots.py) is cut the same way: each chunk takes, after its other inputs, the factor
inputs (`lora_<module>_down`, `_up`: the whole UNet's names) of the slotted projections inside its stages, so a LoRA
file maps to the slots as it does for the whole graph; the runner feeds them from its table like the UNet's inputs.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError
from pocketdiff.lora_keys import slot_input_names
from pocketdiff.runtime.chunks import EMBEDDING, OUTPUT, SKIP_PREFIX, STREAM, skip_name, spoken_input

MAX_CHUNKS = 16
CUTS = ("block", "layer")  # where chunks may be cut: between blocks, or also between a block's layers
ADDED = "text_time"  # the added embedding the chunks carry (SDXL's): the first chunk computes it, later ones take `emb`
ADDED_INPUTS = ("text_embeds", "time_ids")  # its graph inputs (export/components.added_conditioning_inputs)


@dataclasses.dataclass
class Stage:
    """One block of the UNet and the skip connections it makes (down) or takes (up)."""

    name: str  # down_blocks.0 | mid_block | up_blocks.3
    kind: str  # down | mid | up
    block: nn.Module
    params: int
    makes: list[int]  # skip indices written (down; the first stage also writes skip 0, conv_in's output)
    takes: list[int]  # skip indices read, in the order the block takes them (up)
    cross: bool  # reads encoder_hidden_states
    part: str = "block"  # block | layer (`block` holds a resnet and its attention, if any) | sampler (a down/upsampler)


def check_chunkable(unet: nn.Module) -> None:
    """The UNet2DConditionModel layouts the chunks reproduce (the SD family, with or without a mid block, and SDXL's
    text_time added embedding, which the first chunk computes): one named line otherwise."""
    cfg = unet.config
    extras = [k for k in ("class_embedding", "encoder_hid_proj", "time_embed_act") if getattr(unet, k, None) is not None]
    if getattr(unet, "add_embedding", None) is not None and not has_added_embedding(unet):
        extras.append(f"add_embedding of addition_embed_type {getattr(cfg, 'addition_embed_type', None)!r} (the chunks "
                      f"carry {ADDED!r} only)")
    if extras or getattr(cfg, "center_input_sample", False):
        what = ", ".join(extras) or "center_input_sample"
        raise PocketdiffError(f"unet_chunks: this UNet has {what}, which the chunked graphs do not carry (use unet_chunks: 1)")


def has_added_embedding(unet: nn.Module) -> bool:
    """The UNet adds SDXL's text_time embedding (text_embeds, time_ids) to its time embedding."""
    return getattr(unet, "add_embedding", None) is not None and getattr(unet.config, "addition_embed_type", None) == ADDED


def unet_stages(unet: nn.Module, cut: str = "block") -> list[Stage]:
    """The UNet's blocks (`cut: layer`: the down and up blocks' layers) in call order, with the skip
    connections each writes or reads."""
    check_chunkable(unet)
    if cut not in CUTS:
        raise PocketdiffError(f"unet_chunks: cut must be one of {', '.join(CUTS)}, got {cut!r}")
    stages: list[Stage] = []
    made = 1  # skip 0: conv_in's output
    for i, block in enumerate(unet.down_blocks):
        n = len(block.resnets) + (1 if getattr(block, "downsamplers", None) is not None else 0)
        stages.append(Stage(f"down_blocks.{i}", "down", block, _params(block), list(range(made, made + n)), [], _cross(block)))
        made += n
    if getattr(unet, "mid_block", None) is not None:
        stages.append(Stage("mid_block", "mid", unet.mid_block, _params(unet.mid_block), [], [], _cross(unet.mid_block)))
    left = list(range(made))
    for i, block in enumerate(unet.up_blocks):
        n = len(block.resnets)
        takes, left = left[-n:], left[:-n]
        stages.append(Stage(f"up_blocks.{i}", "up", block, _params(block), [], takes, _cross(block)))
    if cut == "layer":
        stages = [layer for s in stages for layer in (_layers(s) if s.kind != "mid" else [s])]
    stages[0].makes.insert(0, 0)
    stages[0].params += _params(unet.conv_in) + (_params(unet.add_embedding) if has_added_embedding(unet) else 0)  # the first chunk's
    stages[-1].params += sum(_params(m) for m in (unet.conv_norm_out, unet.conv_out) if m is not None)
    return stages


def _layers(s: Stage) -> list[Stage]:
    """A down or up block as its layers, in call order: each resnet with its attention (a down layer makes
    one skip connection; an up layer takes one, the block's last first), then its resampler."""
    b = s.block
    attns = list(getattr(b, "attentions", None) or [None] * len(b.resnets))
    layers = []
    for j, (resnet, attn) in enumerate(zip(b.resnets, attns)):
        mods = nn.ModuleList([resnet] + ([attn] if attn is not None else []))
        makes, takes = ([s.makes[j]], []) if s.kind == "down" else ([], [s.takes[-1 - j]])
        layers.append(Stage(f"{s.name}.layers.{j}", s.kind, mods, _params(mods), makes, takes, attn is not None and s.cross, "layer"))
    sampler = getattr(b, "downsamplers" if s.kind == "down" else "upsamplers", None)
    if sampler is not None:
        makes = [s.makes[-1]] if s.kind == "down" else []
        layers.append(Stage(f"{s.name}.sampler", s.kind, sampler, _params(sampler), makes, [], False, "sampler"))
    return layers


def _params(m: Optional[nn.Module]) -> int:
    return 0 if m is None else int(sum(p.numel() for p in m.parameters()))


def _cross(block: nn.Module) -> bool:
    return bool(getattr(block, "has_cross_attention", False))


def balanced_bounds(weights: list[int], k: int, what: str = "blocks", model: str = "the UNet", key: str = "unet_chunks") -> list[tuple[int, int]]:
    """K contiguous [start, end) runs of `weights` whose heaviest run is as light as possible; of those,
    the least sum of squares (the most even spread), then the earliest cuts. Every run holds at least one
    stage. Exact, by dynamic programming over the suffixes (a layer cut of SD has ~27 stages)."""
    n = len(weights)
    if not 1 <= k <= n:
        raise PocketdiffError(f"{key}: {k} chunks, but {model} has {n} {what} to cut between (1 to {n})")
    pre = list(itertools.accumulate(weights, initial=0))

    def run(i: int, j: int) -> int:
        return pre[j] - pre[i]

    def ends(c: int, i: int) -> range:  # where a run starting at i may end, leaving c - 1 runs their stages
        return range(i + 1, n - c + 2)

    inf = float("inf")
    heaviest = [[inf] * (n + 1) for _ in range(k + 1)]  # [c][i]: weights[i:] in c runs, the lightest heaviest run
    heaviest[0][n] = 0
    for c in range(1, k + 1):
        for i in range(n - c, -1, -1):
            heaviest[c][i] = min(max(run(i, j), heaviest[c - 1][j]) for j in ends(c, i))
    limit = heaviest[k][0]
    squares = [[inf] * (n + 1) for _ in range(k + 1)]  # [c][i]: the least sum of squares with every run <= limit
    squares[0][n] = 0
    for c in range(1, k + 1):
        for i in range(n - c, -1, -1):
            squares[c][i] = min((run(i, j) ** 2 + squares[c - 1][j] for j in ends(c, i) if run(i, j) <= limit), default=inf)
    bounds, i = [], 0
    for c in range(k, 0, -1):
        j = next(j for j in ends(c, i) if run(i, j) <= limit and run(i, j) ** 2 + squares[c - 1][j] == squares[c][i])
        bounds.append((i, j))
        i = j
    return bounds


@dataclasses.dataclass
class ChunkPlan:
    """What chunk k holds and passes on."""

    index: int
    count: int
    stages: list[str]
    params: int
    inputs: list[str]  # tensor names, in the graph's argument order
    outputs: list[str]  # tensor names the chunk returns
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> the output it is (not returned twice)
    cut: str = "block"  # the stages' grain (CUTS)
    slots: list[str] = dataclasses.field(default_factory=list)  # the LoRA-slotted modules in its stages (their factors end `inputs`)


def plan_chunks(unet: nn.Module, k: int, cut: str = "block") -> list[ChunkPlan]:
    """The K chunks of the UNet, balanced by parameter count (int8: one byte each), with the tensors
    each reads and writes. With SDXL's added embedding (`has_added_embedding`) the first chunk also reads
    `text_embeds` and `time_ids` and returns `emb` (the time embedding plus the added one), which later chunks read
    in place of `timestep`."""
    stages = unet_stages(unet, cut)
    added = has_added_embedding(unet)
    mid = " and mid block" if any(s.kind == "mid" for s in stages) else ""
    bounds = balanced_bounds([s.params for s in stages], k, "blocks" if cut == "block" else f"stages (layers{mid})")
    plans = []
    for c, (a, b) in enumerate(bounds):
        own = stages[a:b]
        made_here = {j for s in own for j in s.makes}
        taken_later = {j for s in stages[b:] for j in s.takes}
        taken_here = [j for s in own for j in s.takes if j not in made_here]
        inputs = ["sample"] if c == 0 else [STREAM] + [skip_name(j) for j in sorted(set(taken_here))]
        inputs.append(EMBEDDING if added and c > 0 else "timestep")
        if any(s.cross for s in own):
            inputs.append("encoder_hidden_states")
        if added and c == 0:
            inputs += ADDED_INPUTS
        outputs = [OUTPUT] if c == k - 1 else [STREAM] + [skip_name(j) for j in sorted(made_here & taken_later)]
        if added and c == 0 and k > 1:
            outputs.append(EMBEDDING)
        aliases = {}
        if own[-1].kind == "down" and skip_name(own[-1].makes[-1]) in outputs:
            # a down block's last skip connection is its output, the stream: one tensor, which a converter
            # returns once (two signature names for one tensor), so the chunk returns it as `hidden` only
            aliases[skip_name(own[-1].makes[-1])] = STREAM
            outputs.remove(skip_name(own[-1].makes[-1]))
        slots = [m.slot_name for s in own for m in s.block.modules() if isinstance(getattr(m, "slot_name", None), str)]
        inputs += [n for m in slots for n in slot_input_names(m)]
        plans.append(ChunkPlan(c, k, [s.name for s in own], sum(s.params for s in own), inputs, outputs, aliases, cut, slots))
    placed = {m for p in plans for m in p.slots}
    lost = [m.slot_name for m in unet.modules() if isinstance(getattr(m, "slot_name", None), str) and m.slot_name not in placed]
    if lost:
        raise PocketdiffError(f"lora_slots: the slot of unet.{lost[0]} lies in none of the {k} chunks' stages "
                              f"({len(lost)} such), so no chunk would take its factors")
    return plans


class AddedEmbedding(nn.Module):
    """SDXL's added embedding as UNet2DConditionModel.get_aug_embed computes it (text_time): the size / crop ids
    through the sinusoidal `add_time_proj`, beside the pooled text embedding, through `add_embedding`."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.add_time_proj = unet.add_time_proj
        self.add_embedding = unet.add_embedding

    def forward(self, text_embeds: torch.Tensor, time_ids: torch.Tensor) -> torch.Tensor:
        time_embeds = self.add_time_proj(time_ids.flatten()).reshape(text_embeds.shape[0], -1)
        return self.add_embedding(torch.cat([text_embeds, time_embeds.to(text_embeds.dtype)], dim=-1))


class UNetChunk(nn.Module):
    """Stages [a, b) of a UNet2DConditionModel whose time embedding is fed in (export/components.UNetGraph
    with external_time_embedding): positional tensors in `plan.inputs` order -> a dict of `plan.outputs`."""

    def __init__(self, unet: nn.Module, plan: ChunkPlan):
        super().__init__()
        self.plan = plan
        stages = {s.name: s for s in unet_stages(unet, plan.cut)}
        self.stage_info = [stages[n] for n in plan.stages]
        self.blocks = nn.ModuleList([s.block for s in self.stage_info])
        first, last = plan.index == 0, plan.index == plan.count - 1
        self.conv_in = unet.conv_in if first else None
        self.added = AddedEmbedding(unet) if first and has_added_embedding(unet) else None
        self.conv_norm_out = unet.conv_norm_out if last else None
        self.conv_act = unet.conv_act if last else None
        self.conv_out = unet.conv_out if last else None
        # the slots' shared feed (export/lora_slots.LoraSlot reads its factors from it), filled from this chunk's inputs
        self.lora_feed = next((m.feed for m in self.blocks.modules() if isinstance(getattr(m, "slot_name", None), str)), None)

    def forward(self, *tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        t = dict(zip(self.plan.inputs, tensors))
        if self.plan.slots:
            self.lora_feed.update({m: (t[d], t[u]) for m in self.plan.slots for d, u in [slot_input_names(m)]})
            try:
                return self._forward(t)
            finally:
                self.lora_feed.clear()
        return self._forward(t)

    def _forward(self, t: dict) -> dict[str, torch.Tensor]:
        emb, ehs = self._embedding(t), t.get("encoder_hidden_states")
        skips = {j: v for j, v in ((_skip_index(n), v) for n, v in t.items()) if j is not None}
        if self.conv_in is not None:
            h = self.conv_in(t["sample"])
            skips[0] = h
        else:
            h = t[STREAM]
        for s, block in zip(self.stage_info, self.blocks):
            h = _run_stage(s, block, h, emb, ehs, skips)
        if self.conv_out is not None:
            if self.conv_norm_out is not None:
                h = self.conv_act(self.conv_norm_out(h))
            return {OUTPUT: self.conv_out(h)}
        out = {STREAM: h}
        for n in self.plan.outputs[1:]:
            out[n] = emb if n == EMBEDDING else skips[_skip_index(n)]
        for n, src in self.plan.aliases.items():
            if skips[_skip_index(n)] is not out[src]:
                raise PocketdiffError(f"unet_chunks: chunk {self.plan.index} takes {n} to be its output {src}, but the "
                                      f"block {self.plan.stages[-1]} made them apart")
        return out

    def _embedding(self, t: dict) -> torch.Tensor:
        """What the resnets read: the fed `emb` (a later chunk of a UNet with the added embedding), else the time-embedding
        row, plus the added embedding in the first chunk of such a UNet."""
        if EMBEDDING in t:
            return t[EMBEDDING]
        if self.added is None:
            return t["timestep"]
        return t["timestep"] + self.added(t["text_embeds"], t["time_ids"])


def _skip_index(name: str) -> Optional[int]:
    return int(name[len(SKIP_PREFIX):]) if name.startswith(SKIP_PREFIX) else None


def _run_stage(s: Stage, block: nn.Module, h, emb, ehs, skips: dict):
    """One block as UNet2DConditionModel.forward calls it (no masks, no extra kwargs), or one of its layers
    as the block's forward runs it."""
    if s.part != "block":
        return _run_layer(s, block, h, emb, ehs, skips)
    kw = {"encoder_hidden_states": ehs} if s.cross else {}
    if s.kind == "down":
        h, res = block(hidden_states=h, temb=emb, **kw)
        for j, r in zip(s.makes[-len(res):], res):
            skips[j] = r
        return h
    if s.kind == "mid":
        return block(h, emb, **kw)
    res = tuple(skips[j] for j in s.takes)
    return block(hidden_states=h, temb=emb, res_hidden_states_tuple=res, upsample_size=None, **kw)


def _run_layer(s: Stage, mods: nn.ModuleList, h, emb, ehs, skips: dict):
    """A down or up block's layer, as CrossAttnDownBlock2D / CrossAttnUpBlock2D (and the plain blocks) run it."""
    if s.part == "sampler":
        h = mods[0](h) if s.kind == "down" else mods[0](h, None)
    else:
        if s.kind == "up":
            h = torch.cat([h, skips[s.takes[0]]], dim=1)
        h = mods[0](h, emb)
        if len(mods) > 1:
            h = mods[1](h, encoder_hidden_states=ehs, return_dict=False)[0]
    if s.kind == "down":
        skips[s.makes[-1]] = h
    return h


def split_unet(unet: nn.Module, k: int, cut: str = "block") -> list[UNetChunk]:
    """The K chunk graphs of `unet` (sharing its modules)."""
    return [UNetChunk(unet, p) for p in plan_chunks(unet, k, cut)]


@torch.no_grad()
def run_chunks(chunks: list[UNetChunk], inputs: dict[str, torch.Tensor]) -> tuple[list[dict], list[dict], torch.Tensor]:
    """The chunks in sequence from the whole UNet's inputs: (each chunk's inputs, each chunk's outputs, the
    UNet's output)."""
    tensors = dict(inputs)
    feeds, outs = [], []
    for c in chunks:
        missing = [n for n in c.plan.inputs if n not in tensors]
        if missing:
            raise PocketdiffError(f"unet_chunks: chunk {c.plan.index} needs {', '.join(map(spoken_input, missing))}, which no "
                                  "earlier chunk makes (nor the UNet's inputs)")
        feed = {n: tensors[n] for n in c.plan.inputs}
        out = c(*feed.values())
        feeds.append(feed)
        outs.append(out)
        tensors.update(out)
        tensors.update({n: out[src] for n, src in c.plan.aliases.items()})
    return feeds, outs, outs[-1][OUTPUT]


def precheck_chunks(model_cfg, int8_checkpoint: Optional[str], resolution: Optional[int], k: int, cut: str) -> None:
    """`unet_chunks: k` with `cut` against the UNet's shape alone (its config on the meta device, no weights), so the
    export config refuses what the chunked graphs cannot make before any conversion. The UNet's config comes from
    `model.pretrained`'s (or the int8 checkpoint's pipeline's) unet/config.json, or from the built arch
    (`model.unet_blocks` applied); a hub id is checked once loaded."""
    import json
    from pathlib import Path

    from diffusers import UNet2DConditionModel

    from pocketdiff.models import built_unet_config, vae_config
    from pocketdiff.shipped import resolve_shipped

    source = model_cfg.pretrained
    if source is None and int8_checkpoint and (Path(int8_checkpoint) / "pipeline").is_dir():
        source = str(Path(int8_checkpoint) / "pipeline")
    if source is not None:
        path = Path(resolve_shipped(str(source))).expanduser() / "unet" / "config.json"
        try:
            conf = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # a hub id, or no readable config: export_chunked checks the loaded UNet
    elif model_cfg.vae:
        return
    else:
        factor = 2 ** (len(vae_config(model_cfg.arch)["block_out_channels"]) - 1)
        conf = built_unet_config(model_cfg, resolution, vae_factor=factor)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config({n: v for n, v in conf.items() if not n.startswith("_")})
    plan_chunks(unet, k, cut)
