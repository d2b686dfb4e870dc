"""Output folders, reports and atomic writes shared by every verb."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .errors import PocketdiffError


def prepare_output_dir(path: str | Path, overwrite: bool = False, resume: bool = False) -> Path:
    """Create `path`; refuse to touch a non-empty folder unless asked to.

    `resume` reuses the folder as it is (checkpoints inside it are read); `overwrite`
    empties it first. Without either, an existing non-empty folder is an error, so nothing
    a user had is lost.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise PocketdiffError(f"output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if resume:
            return out
        if not overwrite:
            raise PocketdiffError(f"output folder {out} is not empty (pass --overwrite to replace it, or --resume latest)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _jsonable(value.item())
    return value


def read_json(path: str | Path, where: str = "") -> Any:
    """Parse a JSON file; a broken file is a one-line PocketdiffError naming it (and `where`)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PocketdiffError(f"{where + ': ' if where else ''}{path} is not valid JSON ({first})") from None


def read_safetensors(path: str | Path, where: str = "") -> dict:
    """Load a safetensors file; a damaged one is a one-line PocketdiffError naming it (and `where`)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for corrupt files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PocketdiffError(f"{where + ': ' if where else ''}{path}: not a readable safetensors file ({first})") from None


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path in `path`'s folder to write; on success it is fsynced and renamed
    onto `path`, so a kill leaves the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; outputs are ordinary files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n")


def fsync_tree(folder: str | Path) -> None:
    """fsync every file and folder under `folder` (before an atomic rename of the folder)."""
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit_folder(tmp: str | Path, final: str | Path) -> Path:
    """Make a fully written temporary folder `final`: fsync its files, rename it into place
    (replacing an older `final`), fsync the parent. A kill at any point leaves either the old
    folder or the new one, never a torn one under the final name."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final
