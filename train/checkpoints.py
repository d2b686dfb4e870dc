"""Training checkpoints: atomic folders `checkpoint-STEP`, rotation, `--resume latest`.

A checkpoint folder is written under a temporary name, fsynced, then renamed, so a run
killed mid-save never leaves a torn folder that looks complete. Contents are plain files:
model / EMA tensors as safetensors, optimizer and scheduler state through `torch.save`
(loaded back with `weights_only=True`), and `trainer_state.json`.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Optional

from pocketdiff.errors import PocketdiffError
from pocketdiff.outputs import commit_folder, read_json

_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in `folder`, oldest first (temporary folders are ignored)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def resolve_resume(folder: Path, resume: Optional[str]) -> Optional[Path]:
    """`None` -> start fresh; "latest" -> newest complete checkpoint or None; else a named one."""
    if resume is None:
        return None
    if resume == "latest":
        found = list_checkpoints(folder)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_absolute() and not path.exists():
        path = folder / resume
    if not (path / STATE_FILE).is_file():
        raise PocketdiffError(f"--resume {resume}: {path} is not a complete checkpoint (no {STATE_FILE})")
    return path


def begin_checkpoint(folder: Path, step: int) -> Path:
    """A fresh temporary folder to write checkpoint `step` into."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-checkpoint-{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit_checkpoint(tmp: Path, step: int, state: dict, total_limit: int) -> Path:
    """Write the state file, fsync, rename into place, then rotate old checkpoints."""
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=2), encoding="utf-8")
    final = commit_folder(tmp, tmp.parent / f"checkpoint-{step}")
    existing = list_checkpoints(final.parent)
    if total_limit > 0:
        for old in existing[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (hardlinked files counted once per path)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def read_state(checkpoint: Path) -> dict:
    state = read_json(checkpoint / STATE_FILE, "--resume")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise PocketdiffError(f"--resume: {checkpoint / STATE_FILE} has no integer 'step'")
    return state


def model_state(model, trainable_only: bool = False) -> dict:
    """What a checkpoint's model.safetensors holds: the whole state dict, or (`trainable_only`: a LoRA student over
    a frozen teacher) the trainable parameters alone, the frozen rest being rebuilt as it was before training."""
    if trainable_only:
        return {n: p for n, p in model.named_parameters() if p.requires_grad}
    return model.state_dict()


def load_model_state(model, state: dict, trainable_only: bool) -> None:
    """`state` into `model`; `trainable_only`: exactly its trainable parameters (the frozen ones are as built)."""
    if not trainable_only:
        model.load_state_dict(state)
        return
    load_exactly(model, state, set(model_state(model, True)))


def load_exactly(model, state: dict, names: set) -> None:
    """`state` into `model` when it holds exactly the parameters `names` (the rest of `model` stays as it is); else
    ValueError naming one parameter that is in only one of them (train_loop's resume names the file)."""
    if set(state) != names:
        odd = sorted(set(state) ^ names)[0]
        raise ValueError(f"holds other trained parameters than this model's ({odd!r} is in one only)")
    model.load_state_dict(state, strict=False)
