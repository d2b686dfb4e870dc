"""Block removal (BK-SDM): the `blocks:` section of the prune recipe, the slim UNet initialised from the
teacher's kept blocks, the block map, and the feature pairs recovery distils.

The slim config comes from `pocketdiff.unet_blocks` (presets base / small / tiny or an explicit list; which
teacher layers are kept, and why, is documented there). The slim UNet is a stock `UNet2DConditionModel`
(stock diffusers loads its folder); every tensor is copied from the teacher module it maps to, and a shape
that differs is refused naming the block (`check_shapes`, also run on the meta device while the config is
validated, so bad input is refused before any work).

Block map: {slim module prefix: teacher module prefix}, e.g. ``up_blocks.0.resnets.1 -> up_blocks.1.resnets.2``;
everything outside the down / mid / up blocks (conv_in, time embedding, conv_out) maps to itself.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError, require
from pocketdiff.unet_blocks import ALL_PRESETS, MID, removals, slim_unet_config

_BLOCKS = ("down_blocks.", "up_blocks.", MID)


@dataclasses.dataclass
class BlocksSettings:
    """The `blocks:` section: which blocks `prune` removes (before any channel pruning of the same run)."""

    preset: Optional[str] = None  # base | small | tiny | koala_1b | koala_700m | null (pocketdiff/unet_blocks.py)
    remove: list[str] = dataclasses.field(default_factory=list)  # more blocks: mid_block, down_blocks.I.layers.K, ...

    def __post_init__(self) -> None:
        require(self.preset is None or self.preset in ALL_PRESETS, "blocks.preset",
                f"must be one of {', '.join(ALL_PRESETS)} or null, got {self.preset!r}")
        require(isinstance(self.remove, list) and all(isinstance(r, str) for r in self.remove), "blocks.remove",
                f"must be a list of block names, got {self.remove!r}")

    @property
    def active(self) -> bool:
        return bool(self.preset or self.remove)

    def recipe(self) -> dict:
        """What a resumed run must repeat."""
        return {"preset": self.preset, "remove": list(self.remove)}


def slim_plan(config: dict, b: BlocksSettings) -> tuple[dict, dict[str, str], list[str]]:
    """(slim config, block map {slim prefix: teacher prefix}, the removed block names)."""
    names = removals(dict(config), b.preset, b.remove, "blocks")
    key = "blocks.preset" if b.preset and not b.remove else "blocks.remove"
    slim, lmap = slim_unet_config(dict(config), names, key)
    return slim, _module_map(lmap), names


def _module_map(lmap: dict[str, str]) -> dict[str, str]:
    out = {}
    for s, t in lmap.items():
        if s == MID:
            out[s] = t
        elif s.endswith(".sampler"):
            kind = "downsamplers" if s.startswith("down") else "upsamplers"
            out[s[: -len("sampler")] + kind] = t[: -len("sampler")] + kind
        else:
            sb, _, a = s.rpartition(".layers.")
            tb, _, k = t.rpartition(".layers.")
            out[f"{sb}.resnets.{a}"] = f"{tb}.resnets.{k}"
            out[f"{sb}.attentions.{a}"] = f"{tb}.attentions.{k}"
    return out


def teacher_key(key: str, mmap: dict[str, str]) -> Optional[str]:
    """The teacher's name of a slim UNet's tensor or module (None: a block part without a source)."""
    if not key.startswith(_BLOCKS):
        return key
    for s, t in mmap.items():
        if key == s or key.startswith(s + "."):
            return t + key[len(s):]
    return None


def check_shapes(slim: dict[str, tuple], teacher: dict[str, tuple], mmap: dict[str, str], key: str = "blocks") -> None:
    """Every slim tensor must exist in the teacher module it maps to, with the same shape."""
    for name, shape in slim.items():
        src = teacher_key(name, mmap)
        if src is None or src not in teacher:
            raise PocketdiffError(f"{key}: the slim UNet's {name} has no source in the teacher (from {src})")
        if tuple(teacher[src]) != tuple(shape):
            raise PocketdiffError(f"{key}: the slim UNet's {name.rsplit('.', 1)[0]} would come from the teacher's "
                                  f"{src.rsplit('.', 1)[0]}, whose {src.rsplit('.', 1)[1]} is {tuple(teacher[src])}, not "
                                  f"{tuple(shape)} (that block layout changes the channels there)")


def _shapes(module: nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def meta_unet(config: dict):
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return UNet2DConditionModel.from_config({k: v for k, v in dict(config).items() if not k.startswith("_")})


def precheck_blocks(config: dict, b: BlocksSettings, teacher_shapes: Optional[dict] = None):
    """The slim UNet on the meta device (shapes only), after every check `remove_blocks` makes."""
    slim, mmap, _ = slim_plan(config, b)
    unet = meta_unet(slim)
    check_shapes(_shapes(unet), teacher_shapes if teacher_shapes is not None else _shapes(meta_unet(config)), mmap)
    return unet


def remove_blocks(teacher: nn.Module, b: BlocksSettings):
    """The slim stock UNet2DConditionModel (weights copied from the teacher's kept blocks) and its block plan."""
    from diffusers import UNet2DConditionModel

    if (getattr(teacher, "pruning_spec", None) or {}).get("modules"):
        raise PocketdiffError("blocks: model.pretrained is channel-pruned; remove blocks from the unpruned model "
                              "(one prune run removes blocks and then channels)")
    slim, mmap, names = slim_plan(dict(teacher.config), b)
    t_state = teacher.state_dict()
    student = UNet2DConditionModel.from_config(slim)
    check_shapes(_shapes(student), {k: tuple(v.shape) for k, v in t_state.items()}, mmap)
    state = {k: t_state[teacher_key(k, mmap)].detach().clone() for k in student.state_dict()}
    student.load_state_dict(state, strict=True)
    dtype = next(teacher.parameters()).dtype
    student = (student if dtype == torch.float32 else student.to(dtype)).eval()
    plan = {"recipe": b.recipe(), "removed": names, "block_map": _readable_map(student, mmap),
            "feature_pairs": feature_pairs(student, teacher, mmap),
            "config_changes": {k: v for k, v in slim.items() if dict(teacher.config).get(k) != v}}
    return student, plan


def _readable_map(student: nn.Module, mmap: dict[str, str]) -> dict[str, str]:
    """Each slim block's parts (resnets, attentions, samplers, mid block) and where they came from, in order."""
    return {n: mmap[n] for n, _ in student.named_modules() if n in mmap}


def feature_pairs(student: nn.Module, teacher: nn.Module, mmap: dict[str, str]) -> dict[str, str]:
    """{slim block: teacher module} whose outputs feature KD matches: the stage outputs of kept stages. A down
    stage that lost its downsampler (the new lowest resolution) is matched with the teacher stage's last layer
    (its output before that downsampler)."""
    pairs = {}
    for kind in ("down_blocks", "up_blocks"):
        for s, block in enumerate(getattr(student, kind)):
            src = teacher_key(f"{kind}.{s}.resnets.0", mmap).rsplit(".resnets.", 1)[0]
            t_block = dict(teacher.named_modules())[src]
            sampler = "downsamplers" if kind == "down_blocks" else "upsamplers"
            if (getattr(block, sampler, None) is None) == (getattr(t_block, sampler, None) is None):
                pairs[f"{kind}.{s}"] = src
            else:
                last = len(t_block.resnets) - 1
                has_attn = getattr(t_block, "attentions", None) is not None
                pairs[f"{kind}.{s}"] = f"{src}.{'attentions' if has_attn else 'resnets'}.{last}"
    if getattr(student, "mid_block", None) is not None and getattr(teacher, "mid_block", None) is not None:
        pairs[MID] = MID
    return pairs


def stage_summary(unet: nn.Module) -> dict:
    """Layers per down / up stage and the mid block, for the report."""
    return {"down": [len(b.resnets) for b in unet.down_blocks], "up": [len(b.resnets) for b in unet.up_blocks],
            "mid_block": getattr(unet, "mid_block", None) is not None,
            "block_out_channels": list(unet.config.block_out_channels)}


# --------------------------------------------------------------------------------------
# A folder's config against its weights (shapes from the safetensors header: nothing is read)
# --------------------------------------------------------------------------------------

def safetensors_shapes(path: Path) -> dict[str, tuple]:
    """Tensor shapes from a .safetensors header."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PocketdiffError(f"{path}: unreadable safetensors header ({type(e).__name__}: {e})") from None
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def check_unet_folder(folder: Path, config: dict) -> None:
    """A stock UNet folder (no pruning.json): its config.json must describe its weights, tensor for tensor."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return  # other weight formats: the loader's own checks
    got: dict[str, tuple] = {}
    for f in files:
        got.update(safetensors_shapes(f))
    want = _shapes(meta_unet(config))
    missing = sorted(set(want) - set(got))
    wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    extra = sorted(set(got) - set(want))
    if missing or wrong or extra:
        what = (f"{wrong[0]} is {got[wrong[0]]} in the weights, {want[wrong[0]]} by the config" if wrong else
                f"the config has {missing[0]}, the weights do not" if missing else f"the weights have {extra[0]}, the config does not")
        raise PocketdiffError(f"{folder / 'config.json'}: does not match its weights ({what}; "
                              f"{len(missing)} missing, {len(extra)} unexpected, {len(wrong)} of another shape)")


# --------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------

def teacher_to_slim(block_map: dict[str, str]):
    """name in the teacher -> its name in the slim UNet, or None (removed with its block)."""
    inverse = {t: s for s, t in block_map.items()}

    def rename(name: str) -> Optional[str]:
        if not name.startswith(_BLOCKS):
            return name
        for t, s in inverse.items():
            if name == t or name.startswith(t + "."):
                return s + name[len(t):]
        return None
    return rename


def blocks_report(b: BlocksSettings, plan: dict, teacher: nn.Module, student: nn.Module, prof_teacher: dict,
                  prof_final: dict, report: dict):
    """report["blocks"]: the removed blocks, the block map, stages, params and MACs of the teacher, the slim UNet
    (block removal alone) and the final one. Returns (teacher name -> final name, the slim UNet's layer profile)."""
    from pocketdiff.models import count_params

    from . import targets as pt

    slim = precheck_blocks(dict(teacher.config), b)  # meta device: shapes only
    prof_slim = pt.layer_profile(slim)

    def macs(prof: dict) -> int:
        return int(sum(st.macs for st in prof.values()))

    report["blocks"] = {
        **plan["recipe"], "removed": plan["removed"], "config_changes": plan["config_changes"],
        "block_map": plan["block_map"], "feature_pairs": plan["feature_pairs"],
        "stages": {"before": stage_summary(teacher), "after": stage_summary(student)},
        "params": {"before": count_params(teacher), "after_block_removal": count_params(slim), "after": count_params(student)},
        "macs": {"before": macs(prof_teacher), "after_block_removal": macs(prof_slim), "after": macs(prof_final),
                 "note": "conv + linear multiply-accumulates per sample (attention score / value matmuls excluded)"},
    }
    return teacher_to_slim(plan["block_map"]), prof_slim
