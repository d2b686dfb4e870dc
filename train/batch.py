"""What one training step draws: which dataset items form a micro-batch, its random numbers
(the same whatever the number of processes), and its tensors on the training device."""
from __future__ import annotations

import torch

from pocketdiff.errors import PocketdiffError


def step_generator(seed: int, step: int, device="cpu") -> torch.Generator:
    """The generator for every random draw of optimizer step `step`, on the training device.

    A CUDA generator draws where the numbers are used: drawing on the host and copying from
    pageable memory made the host wait for the device at each draw (a stream sync), with the
    host's draw of the whole global batch in between (at four processes, each on one CPU thread
    under `accelerate launch`, ~10 ms per draw at SD-2.1 size) while the device idled. The streams
    of one device type are the same on any number of processes; a CPU and a CUDA run differ."""
    device = torch.device(device)
    return torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed((seed * 1_000_003 + step) % (2**63))


class BatchRandom:
    """Random draws for one micro-batch, identical whatever the number of processes.

    Each draw is made for the whole global micro-batch from the step's generator (on its device)
    and this process keeps its rows `[rank::world]` (the same rows as its data), so one GPU and
    several GPUs see the same noise for the same sample.
    """

    def __init__(self, generator: torch.Generator, global_batch: int, rank: int = 0, world: int = 1, device="cpu"):
        self.generator, self.n, self.rank, self.world, self.device = generator, global_batch, rank, world, device
        self.draw_on = generator.device

    def _local(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.rank :: self.world].to(self.device).contiguous()

    def randn(self, *shape: int) -> torch.Tensor:
        return self._local(torch.randn(self.n, *shape, generator=self.generator, device=self.draw_on))

    def rand(self, *shape: int) -> torch.Tensor:
        return self._local(torch.rand(self.n, *shape, generator=self.generator, device=self.draw_on))

    def randint(self, low: int, high: int) -> torch.Tensor:
        return self._local(torch.randint(low, high, (self.n,), generator=self.generator, device=self.draw_on))


class BatchPlan:
    """Which dataset indices form micro-batch `m` (global), deterministic by seed."""

    def __init__(self, num_items: int, batch_size: int, seed: int):
        if num_items < batch_size:
            raise PocketdiffError(f"dataset has {num_items} items, fewer than train.batch_size={batch_size}")
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.per_epoch = num_items // batch_size
        self._epoch, self._perm = -1, None

    def indices(self, micro_batch: int) -> list[int]:
        epoch, pos = divmod(micro_batch, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_items, generator=g)
        return self._perm[pos * self.batch_size : (pos + 1) * self.batch_size].tolist()


def batch_to_device(batch, device):
    """A collated batch's tensors on `device`. On a GPU they go through pinned host memory
    without the host waiting: a copy from pageable memory would synchronise the stream, and the
    device would idle while the host prepared the rest of the step. Anything else is left as is."""
    if not isinstance(batch, dict) or torch.device(device).type != "cuda":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
