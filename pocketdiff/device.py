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


def cap_cuda_memory(cap_bytes: int, device) -> float:
    """Cap this process's CUDA caching allocator on `device` at `cap_bytes` (at most the whole
    card) and return the fraction set. A bare "cuda" means the current device: the allocator
    call itself wants an index."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, cap_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction
