"""Memory- and disk-lean pieces of the training loop, each behind a `train:` option.

- `make_optimizer`: AdamW (fused on CUDA) or an 8-bit AdamW from a kept library
  (`train.optimizer=adamw8bit`, `train.optimizer_lib=torchao | bitsandbytes`): a quarter of
  AdamW's state memory and checkpoint size. A missing library is one line naming it.
- `apply_memory_cap`: `train.memory_cap_gib` caps this process's CUDA caching allocator
  (`torch.cuda.set_per_process_memory_fraction`), so a run on an 80 GB card shows what a 24 GB
  card would do: an allocation past the cap raises the same out-of-memory error.
- `GpuMemory`: peak allocated memory (GiB) for logs and reports.
- `check_free_space`: fail before a save that cannot fit, naming the bytes needed.
"""
from __future__ import annotations

import functools

import shutil
from pathlib import Path
from typing import Optional

import torch

from pocketdiff.device import cap_cuda_memory
from pocketdiff.errors import PocketdiffError

OPTIMIZERS = ("adamw", "adamw8bit")
OPTIMIZER_LIBS = ("torchao", "bitsandbytes")
EMA_DEVICES = ("auto", "cpu")  # auto: on the model's device


def make_optimizer(groups: list[dict], *, name: str, lib: str, lr: float, weight_decay: float, fused: bool):
    """The optimizer of `train.optimizer` over AdamW param groups."""
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=fused)
    if lib == "torchao":
        try:
            from torchao.optim import AdamW8bit
        except ImportError as e:
            raise PocketdiffError(f"train.optimizer=adamw8bit with train.optimizer_lib=torchao: torchao cannot be imported ({e}); "
                                  "pip install torchao, or set train.optimizer=adamw") from None
        return AdamW8bit(groups, lr=lr, weight_decay=weight_decay)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise PocketdiffError(f"train.optimizer=adamw8bit with train.optimizer_lib=bitsandbytes: bitsandbytes cannot be imported ({e}); "
                              "pip install bitsandbytes, or set train.optimizer_lib=torchao") from None
    return _queued_adamw8bit(bnb)(groups, lr=lr, weight_decay=weight_decay)


_BNB_STEP_PARTS = ("check_overrides", "to_gpu", "init_state", "update_step")  # the stock step's own parts


@functools.lru_cache(maxsize=None)
def _queued_adamw8bit(bnb):
    """bitsandbytes' AdamW8bit with a step that queues every parameter's update and returns.

    Its own step calls torch.cuda.synchronize() after each parameter, which only paged optimizer
    states need: at SD-2.1 size that is 687 host-device round trips per step, the GPU idle between
    them and the host unable to run ahead into the next step (a profile of the SD-2.1 trainer
    spent 59 ms of host time per step in the optimizer on one GPU, 97 ms per process on two).
    The updates are kernels on the current stream, so stream order alone keeps them correct;
    the same parameters, states and arithmetic as the stock step (tests/train/test_memory.py
    compares them on a GPU). Paged states, or a bitsandbytes whose optimizer lacks the parts
    used here, keep the stock step.
    """
    base = bnb.optim.AdamW8bit
    if not all(hasattr(base, a) for a in _BNB_STEP_PARTS):
        return base

    class QueuedAdamW8bit(base):
        @torch.no_grad()
        def step(self, closure=None):
            if getattr(self, "is_paged", True) or not hasattr(self, "initialized"):
                return super().step(closure)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if not self.initialized:
                self.check_overrides()
                self.to_gpu()
                self.initialized = True
            for gindex, group in enumerate(self.param_groups):
                for pindex, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    if not self.state[p]:
                        self.init_state(group, p, gindex, pindex)
                    self.update_step(group, p, gindex, pindex)
            return loss

    return QueuedAdamW8bit


def apply_memory_cap(cap_gib: Optional[float], device) -> Optional[float]:
    """Cap the CUDA caching allocator of this process at `cap_gib` (None: no cap). Returns the
    fraction set, None when no cap applies (CPU runs ignore the cap: there is no allocator to cap)."""
    device = torch.device(device)
    if not cap_gib or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if cap_gib * 2**30 > total:
        raise PocketdiffError(f"train.memory_cap_gib={cap_gib} is above this GPU's {total / 2**30:.1f} GiB")
    return cap_cuda_memory(int(cap_gib * 2**30), device)


class GpuMemory:
    """Peak allocated CUDA memory of a phase, in GiB (None on CPU)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> Optional[float]:
        return round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3) if self.cuda else None


def oom_message(desc: str, step: int, batch: int, cap_gib: Optional[float], ckpt_dir: Path) -> str:
    cap = f" under train.memory_cap_gib={cap_gib}" if cap_gib else ""
    return (f"[{desc}] out of GPU memory at step {step} with train.batch_size={batch}{cap}: lower train.batch_size "
            "(train.grad_accum keeps the effective batch), or set train.gradient_checkpointing=true, "
            f"train.optimizer=adamw8bit, train.ema_device=cpu; last good checkpoint kept in {ckpt_dir}")


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_free_space(path: Path, need: int, what: str, kept: Optional[Path] = None) -> None:
    """Raise before writing `need` bytes under `path` when the disk cannot hold them (with 5 % slack)."""
    free = free_bytes(path)
    if free < need * 1.05:
        keep = f"; last good checkpoint kept in {kept}" if kept is not None else ""
        raise PocketdiffError(f"not enough free disk for {what} in {path}: needs {need} bytes ({need / 2**30:.2f} GiB), "
                              f"{free} bytes ({free / 2**30:.2f} GiB) free{keep}")


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors in an iterable (nested dicts / lists of tensors allowed)."""
    total = 0
    stack = [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if hasattr(item, "__tensor_flatten__") and type(item) is not torch.Tensor:  # e.g. torchao's 8-bit state
                names, _ = item.__tensor_flatten__()
                stack.extend(getattr(item, n) for n in names)
            else:
                total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total
