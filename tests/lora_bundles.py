"""The shipped tiny teacher's LoRA-slot bundles (issue 65 item 3) and their references, shared by
tests/export/test_lora_slots.py (whole UNet) and tests/export/test_lora_slots_chunks.py (chunked UNet) through the
session fixture `lora_bundles` (tests/export/conftest.py): each bundle is exported once for the session, the first time a
test reads it, so a worker running both files exports the whole slotted and fused bundles once. All at fp32 weights, the
text encoder and decoder conversions shared (tests/conftest.py `shared_conversions`). Importable as `lora_bundles`:
tests/conftest.py puts this folder on sys.path."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

TEACHER = "pocketdiff:shapes-teacher"
BASE = {"seed": 0, "model": {"pretrained": TEACHER}, "weights": "fp32", "guidance": "cfg", "guidance_scale": 3.0, "steps": 4,
        "golden_prompt": "a large red circle at the center", "fp16_scan": {"enabled": False}}
SLOTS = {"rank": 4, "targets": ["attn"]}
PROMPT = "a red circle"
OFF = {"verify": {"delegate": False}}  # reference bundles: they only draw reference images
FUSED = "fused"  # the bundle whose model takes the session's LoRA file in its weights (`model.lora`)

# name -> export fields over BASE. The slotted bundles are checked on the GPU delegate (fp16 and fp32) unless OFF.
LAYOUTS = {
    "slots": {"lora_slots": SLOTS},  # the whole UNet, every attention projection slotted (rank 4)
    "plain": OFF,  # the whole UNet, no slots
    FUSED: OFF,  # the whole UNet, the LoRA fused
    "chunks": {"lora_slots": SLOTS, "unet_chunks": 2},  # 2 chunks, block cut, slotted
    "layered": {"lora_slots": SLOTS, "unet_chunks": 3, "unet_chunk_cut": "layer", **OFF},  # 3 chunks, layer cut, slotted
    "plain_chunks": {"unet_chunks": 2, **OFF},  # 2 chunks, block cut, no slots
}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR of two images in [0, 1] (peak 1)."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def attention_linears(unet) -> dict:
    return {n: m for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear) and (".attn1." in n or ".attn2." in n)}


def peft_lora(path: Path, rank: int = 4, seed: int = 1, modules=None) -> Path:
    """A diffusers / PEFT LoRA on every attention projection of the tiny teacher (alpha 8 in its metadata: x2)."""
    from safetensors.torch import save_file

    from pocketdiff.models import ModelConfig, load_or_build

    unet = load_or_build(ModelConfig(pretrained=TEACHER)).unet
    g = torch.Generator().manual_seed(seed)
    state = {}
    for n, m in attention_linears(unet).items():
        if modules is None or n in modules:
            state[f"unet.{n}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) / m.in_features ** 0.5
            state[f"unet.{n}.lora_B.weight"] = 0.2 * torch.randn(m.out_features, rank, generator=g)
    save_file(state, str(path), metadata={"lora_adapter_metadata": json.dumps({"unet.lora_alpha": 2 * rank, "unet.r": rank})})
    return path


def export(root: Path, shared_conversions, **fields) -> Path:
    """`pocketdiff export` of BASE + fields into root/bundle (its config root/export.yaml)."""
    import yaml

    from pocketdiff.cli import main as cli_main

    cfg = {**BASE, **fields}
    (root / "export.yaml").write_text(yaml.safe_dump(cfg))
    with shared_conversions.of("text_encoder", "vae_decoder"):
        assert cli_main(["export", "--config", str(root / "export.yaml"), "--output", str(root / "bundle")]) == 0
    return root / "bundle"


class LoraBundles(dict):
    """{LAYOUTS name: its bundle}, each exported the first time it is read; `.lora`: the session's LoRA file
    (`peft_lora`, seed 1), the one the fused bundle takes in its weights. Tests read the bundles or copy them; none writes
    into one."""

    def __init__(self, root: Path, shared_conversions):
        super().__init__()
        self.root, self.shared_conversions = root, shared_conversions
        self.lora = peft_lora(root / "style.safetensors")

    def __missing__(self, name: str) -> Path:
        if name not in LAYOUTS:
            raise KeyError(f"no LoRA bundle layout {name!r} (tests/lora_bundles.py LAYOUTS: {sorted(LAYOUTS)})")
        fields = dict(LAYOUTS[name])
        if name == FUSED:
            fields["model"] = {"pretrained": TEACHER, "lora": [{"path": str(self.lora), "scale": 1.0}]}
        (self.root / name).mkdir(exist_ok=True)
        self[name] = export(self.root / name, self.shared_conversions, **fields)
        return self[name]
