"""Models shipped inside the package, named in configs as `pocketdiff:NAME`.

`pocketdiff:shapes-teacher` is the embedded default teacher, `pocketdiff:clip-shapes` the
small domain CLIP; both live in `pocketdiff/assets/NAME`. Any other string is returned
unchanged (a folder or a hub id), so loaders call `resolve_shipped` first.
"""
from __future__ import annotations

from pathlib import Path

from .errors import PocketdiffError

PREFIX = "pocketdiff:"
ASSETS = Path(__file__).resolve().parent / "assets"


def resolve_shipped(source: str) -> str:
    text = str(source)
    if not text.startswith(PREFIX):
        return text
    name = text[len(PREFIX):]
    path = ASSETS / name
    if not name or "/" in name or not path.is_dir():
        available = sorted(p.name for p in ASSETS.iterdir() if p.is_dir()) if ASSETS.is_dir() else []
        raise PocketdiffError(f"{text}: pocketdiff/assets/{name} is missing (shipped: {', '.join(available)})")
    return str(path)
