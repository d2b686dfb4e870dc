"""Stock diffusers pipeline folders that share their unchanged components on disk.

A distillation round changes only the UNet (and the scheduler's settings); its text encoder,
tokenizer and VAE are the teacher's. `write_pipeline_folder` writes the changed components with
`save_pretrained` and hardlinks the files of the unchanged ones from a folder that already holds
them (the teacher's folder, the previous round's), copying instead when a link is impossible
(another filesystem, a filesystem without hardlinks). Each folder stays standalone: deleting
the source keeps the linked files alive; a loader sees ordinary files.

Linked files share their data with the source: rewrite them by replacing (save to a new name,
rename), never in place.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import save_pipeline

SHAREABLE = ("text_encoder", "tokenizer", "vae", "text_encoder_2", "tokenizer_2")  # what a distillation round never changes
_TOKENIZERS = ("tokenizer", "tokenizer_2")


def link_or_copy(src: Path, dst: Path) -> str:
    """Hardlink `src` to `dst` when possible, else copy; returns "link" or "copy"."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
        return "link"
    except OSError:  # EXDEV (another filesystem), EPERM / ENOTSUP (no hardlinks there)
        shutil.copy2(src, dst)
        return "copy"


def shareable_component(folder: Optional[Path], name: str) -> Optional[Path]:
    """`folder/name` when it holds a component we can reuse as is: a diffusers / transformers
    subfolder with its config, and safetensors weights (never pickles) unless it has no weights."""
    if folder is None:
        return None
    sub = Path(folder) / name
    if not sub.is_dir() or not (Path(folder) / "model_index.json").is_file():
        return None
    if name in _TOKENIZERS:
        return sub if any(sub.iterdir()) else None
    if not (sub / "config.json").is_file():
        return None
    files = [f.name for f in sub.iterdir() if f.is_file()]
    if any(f.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl")) for f in files):
        return None
    return sub if any(f.endswith(".safetensors") for f in files) else None


def write_pipeline_folder(pipe, out: Path, share_from: Optional[dict[str, Optional[Path]]] = None) -> dict:
    """Save `pipe` (a StableDiffusionPipeline or StableDiffusionXLPipeline) as a stock folder `out`; components named in
    `share_from` (name -> folder holding it) are linked or copied from that folder instead of
    written. Returns {"linked": [...], "copied": [...], "written": [...]} (component names)."""
    share_from = share_from or {}
    sources = {name: shareable_component(folder, name) for name, folder in share_from.items()}
    sources = {name: src for name, src in sources.items() if src is not None}
    if not sources:
        save_pipeline(pipe, out)
        return {"linked": [], "copied": [], "written": sorted(k for k, v in pipe.components.items() if v is not None)}
    out.mkdir(parents=True, exist_ok=True)
    done: dict[str, list[str]] = {"linked": [], "copied": [], "written": []}
    for name, component in pipe.components.items():
        if component is None:
            continue
        if name in sources:
            kinds = {link_or_copy(f, out / name / f.relative_to(sources[name]))
                     for f in sorted(sources[name].rglob("*")) if f.is_file()}
            done["copied" if "copy" in kinds else "linked"].append(name)
        elif hasattr(component, "save_pretrained"):
            kwargs = {"safe_serialization": True} if name in ("unet", "vae", "text_encoder", "text_encoder_2") else {}
            component.save_pretrained(str(out / name), **kwargs)
            done["written"].append(name)
        else:
            raise PocketdiffError(f"pipeline component {name} ({type(component).__name__}) cannot be saved")
    pipe.save_config(str(out))  # model_index.json, as DiffusionPipeline.save_pretrained writes it
    for name in (n for n in _TOKENIZERS if n in done["written"]):
        from pocketdiff.tokenizer import export_vocab_merges

        tok_dir = out / name
        if not (tok_dir / "vocab.json").is_file():
            try:
                export_vocab_merges(getattr(pipe, name), tok_dir)
            except PocketdiffError:  # a non-BPE tokenizer: tokenizer.json alone is fine
                pass
    return done


def pipeline_bytes_to_write(pipe, shared: set[str]) -> int:
    """Bytes `write_pipeline_folder` will write for the components not shared (float32 weights as held)."""
    total = 0
    for name, component in pipe.components.items():
        if component is None or name in shared or not hasattr(component, "parameters"):
            continue
        total += sum(t.numel() * t.element_size() for t in component.state_dict().values())
    return total + (4 << 20)  # configs, tokenizer files
