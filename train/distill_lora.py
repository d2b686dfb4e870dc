"""`student.lora_rank`: the consistency student trained as a LoRA over its teacher (LCM-LoRA), through peft.

The student is a float32 copy of the teacher UNet, frozen, with peft LoRA layers on `student.lora_targets`
(B zero-initialised, so it starts as the teacher); only the LoRA factors train, so the optimizer, the EMA
and the checkpoints (`train_loop(trainable_only=True)`) hold them alone. After the round:

- DIR/round-0/pytorch_lora_weights.safetensors: the (EMA) factors in diffusers' format (`unet.<module>.lora_A /
  lora_B.weight`, its `lora_adapter_metadata`), in `student.lora_dtype`; stock diffusers reads it with
  `load_lora_weights` / `fuse_lora`, pocketdiff with `model.lora` (pocketdiff/lora.py);
- DIR/round-0/unet: the teacher with that file fused by pocketdiff.lora, so the round folder stays a stock
  pipeline that evaluate, calibrate and export read as any student (what the LoRA gives, after its rounding).

A LoRA adds no layer, so the student cannot take w as an input (`guidance.conditioned: false`: it folds
`guidance.scale`, as LCM-LoRA; sample at guidance_scale 1), and it keeps its teacher's prediction type (it
starts as the teacher and runs in the teacher's pipeline).
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

from pocketdiff.errors import PocketdiffError, require
from pocketdiff.names import PRECISIONS

from .distill_targets import DTYPES

LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' default weight_name: load_lora_weights(folder) finds it
# LCM-LoRA's targets (diffusers' train_lcm_distill_lora_sd_wds.py): every attention projection, the transformer blocks'
# proj_in / proj_out and feed-forward, the ResNets' convs, shortcuts and time projections, the down / up samplers' convs
LCM_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
               "conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj")
# q, k, v and out of every attention: MediaPipe's choice, and what a bundle's `lora_slots` can swap
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
TARGET_PRESETS = {"lcm": LCM_TARGETS, "attention": ATTENTION_TARGETS}


@dataclasses.dataclass
class StudentConfig:
    """The `student:` section: null lora_rank trains the whole UNet; a rank trains a LoRA over the teacher."""

    lora_rank: Optional[int] = None
    lora_alpha: Optional[float] = None  # null: the rank (the factors' product at scale 1)
    lora_targets: Any = "lcm"  # lcm | attention | a list of module names (or their dotted tails) of the UNet
    lora_dtype: str = "fp16"  # the saved file's (LCM-LoRA's published files are fp16); training is float32

    def __post_init__(self) -> None:
        r = self.lora_rank
        require(r is None or (isinstance(r, int) and not isinstance(r, bool) and r >= 1), "student.lora_rank",
                f"must be a positive integer or null (train the whole UNet), got {r!r}")
        a = self.lora_alpha
        require(a is None or (isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) and a > 0),
                "student.lora_alpha", f"must be a finite number > 0 or null (= lora_rank), got {a!r}")
        t = self.lora_targets
        if isinstance(t, str):
            require(t in TARGET_PRESETS, "student.lora_targets", f"must be one of {tuple(TARGET_PRESETS)} or a list of module names, got {t!r}")
        else:
            require(isinstance(t, (list, tuple)) and len(t) > 0 and all(isinstance(x, str) and x.strip(".") for x in t),
                    "student.lora_targets", f"must be one of {tuple(TARGET_PRESETS)} or a non-empty list of module names, got {t!r}")
            self.lora_targets = list(t)
        require(self.lora_dtype in PRECISIONS, "student.lora_dtype", f"must be one of {PRECISIONS}, got {self.lora_dtype!r}")
        require(r is not None or (a is None and t == "lcm" and self.lora_dtype == "fp16"), "student.lora_rank",
                "is null, so the whole UNet trains: the other student.lora_* keys need a rank")

    @property
    def enabled(self) -> bool:
        return self.lora_rank is not None

    @property
    def alpha(self) -> float:
        return float(self.lora_alpha if self.lora_alpha is not None else self.lora_rank)

    @property
    def targets(self) -> tuple[str, ...]:
        return TARGET_PRESETS[self.lora_targets] if isinstance(self.lora_targets, str) else tuple(self.lora_targets)

    def record(self) -> dict:
        """What the plan record (resume check) and the report keep of it."""
        return {"lora_rank": self.lora_rank, "lora_alpha": self.alpha, "lora_targets": self.lora_targets, "lora_dtype": self.lora_dtype}


def check_lora_config(cfg) -> None:
    """The recipe's keys that a LoRA student cannot serve (Config.__post_init__), each refused naming its key."""
    if not cfg.student.enabled:
        return
    require(cfg.method == "consistency", "method",
            f"{cfg.method} cannot train a LoRA student (student.lora_rank): its rounds would each need their own LoRA; "
            "use method: consistency (LCM-LoRA)")
    require(not cfg.guidance.conditioned, "guidance.conditioned",
            "must be false with student.lora_rank: the w embedding (time_cond_proj_dim) is a new layer, which a LoRA "
            "cannot carry; the LoRA student folds guidance.scale, as LCM-LoRA (sample it at guidance_scale 1)")


def check_lora_teacher(cfg, unet, teacher_prediction: str) -> None:
    """At run time, before anything is written, once the teacher is known: the targets name some of its layers, and
    the student keeps its teacher's prediction type."""
    if not cfg.student.enabled:
        return
    resolve_targets(unet, cfg.student)
    ptype = cfg.student_prediction_type
    if ptype not in ("teacher", teacher_prediction):
        raise PocketdiffError(f"student_prediction_type: {ptype} differs from the teacher's {teacher_prediction}; a LoRA student "
                              "starts as its teacher and runs in its pipeline: set student_prediction_type: teacher")


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def resolve_targets(unet, student: StudentConfig) -> list[str]:
    """The UNet's Linear / Conv2d modules the targets name (peft's rule: the name or its dotted tail). A listed
    target that names none is refused (a typo would silently train less); a preset takes what the UNet has."""
    layers = [n for n, m in unet.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    found = [n for n in layers if any(_matches(n, t) for t in student.targets)]
    if not isinstance(student.lora_targets, str):
        for t in student.targets:
            if not any(_matches(n, t) for n in layers):
                raise PocketdiffError(f"student.lora_targets: {t!r} names no linear or conv layer of the teacher UNet")
    if not found:
        raise PocketdiffError(f"student.lora_targets: {student.lora_targets!r} names no linear or conv layer of the teacher UNet")
    return found


def add_lora(unet, student: StudentConfig):
    """`unet` (a float32 copy of the teacher) frozen, with peft LoRA layers on the targets; returns it."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise PocketdiffError("student.lora_rank needs peft (pip install peft)") from None
    resolve_targets(unet, student)  # refused before any change
    unet.requires_grad_(False)
    # the short names (peft matches a module by its name's dotted tail), as the file's metadata keeps them
    unet.add_adapter(LoraConfig(r=student.lora_rank, lora_alpha=student.alpha, target_modules=list(student.targets),
                                init_lora_weights=True))
    return unet


def is_lora_unet(unet) -> bool:
    """Whether `unet` carries peft LoRA layers (a LoRA student)."""
    return any(".lora_A." in n for n, _ in unet.named_parameters())


def _adapter_metadata(unet) -> dict:
    cfg = unet.peft_config["default"].to_dict()
    cfg["target_modules"] = sorted(cfg["target_modules"])  # a set: JSON wants a list, and one order
    return cfg


def save_lora(unet, student: StudentConfig, folder: Path) -> Path:
    """The LoRA factors of `unet` (its current weights: the EMA's after use_ema_weights) as folder/LORA_FILE in
    student.lora_dtype: diffusers' layout (`unet.`-prefixed PEFT keys, the adapter config under
    `lora_adapter_metadata`, as `save_lora_weights` writes them). That is the header's one metadata entry (no
    "format": "pt", which no LoRA loader reads): safetensors writes its metadata map in a random order, so with two
    entries the same factors made different bytes (a resumed run's file hashed differently from the uninterrupted one's)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    dtype = DTYPES[student.lora_dtype]
    state = {f"unet.{k}": v.detach().to("cpu", dtype).contiguous() for k, v in get_peft_model_state_dict(unet).items()}
    meta = {f"unet.{k}": v for k, v in _adapter_metadata(unet).items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / LORA_FILE), metadata={"lora_adapter_metadata": json.dumps(meta, indent=2, sort_keys=True)})
    return folder / LORA_FILE


def fused_unet(teacher_unet, path: Path):
    """A float32 copy of the teacher with the LoRA file fused by pocketdiff.lora (what `model.lora` gives)."""
    from diffusers import UNet2DConditionModel

    from pocketdiff.lora import LoraSpec, fuse_loras

    unet = UNet2DConditionModel.from_config(teacher_unet.config)
    unet.load_state_dict(teacher_unet.state_dict())
    unet.float()
    fuse_loras(SimpleNamespace(unet=unet), [LoraSpec(path=str(path))], key="student.lora")
    return unet


def lora_entry(path: Path, student: StudentConfig, unet_params: int) -> dict:
    """The report's entry of a saved LoRA: its file, sha256, rank, alpha, targets, layers, parameters and bytes."""
    from safetensors import safe_open

    from pocketdiff.outputs import sha256_file

    with safe_open(str(path), "pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]
    params = sum(math.prod(s) for s in shapes)
    return {"file": str(path), "sha256": sha256_file(path), "rank": student.lora_rank, "alpha": student.alpha,
            "targets": list(student.targets), "layers": len(shapes) // 2, "params": params,
            "params_fraction_of_unet": params / max(unet_params, 1), "bytes": path.stat().st_size, "dtype": student.lora_dtype,
            "format": "diffusers (unet.<module>.lora_A / lora_B, lora_adapter_metadata)"}


def write_lora_outputs(student_unet, teacher_unet, student: StudentConfig, staging: Path, final_folder: Path):
    """(the fused UNet for the round folder, the LoRA's report entry, the staged file): the LoRA saved into `staging`
    (moved into the round folder with it), fused into a copy of the teacher."""
    if staging.exists():
        shutil.rmtree(staging)
    path = save_lora(student_unet, student, staging)
    fused = fused_unet(teacher_unet, path)
    entry = lora_entry(path, student, sum(p.numel() for p in teacher_unet.parameters()))
    entry["file"] = str(final_folder / LORA_FILE)
    return fused, entry, path
