"""Device names in configs (`device: auto | cpu | cuda | cuda:N`) to torch devices."""
from __future__ import annotations

import torch

from .errors import PocketdiffError


def resolve_device(name: str, key: str = "device") -> torch.device:
    """"auto" picks CUDA when present; an unknown name or CUDA without a GPU fails naming `key`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise PocketdiffError(f"{key}: {name!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PocketdiffError(f"{key}: {name} requested but CUDA is not available")
    return dev
