"""What the training loop reads of each step: the phase clock of the first steps, the mean loss
and gradient norm brought to the host (with what of them is non-finite), and the step profiler."""
from __future__ import annotations

import math
import time
from pathlib import Path
from time import perf_counter
from typing import Optional

import torch


# steps of each invocation outside the steady rate: the first (compilation, autotuning, optimizer
# state) and the second (first EMA update, allocator growth), as benchmarks/distill_step.py's
# `--warmup 2` leaves them out of its rate
RATE_WARMUP_STEPS = 2


class PhaseClock:
    """Seconds per phase of one step; `sync`: the CUDA device synchronised at every mark."""

    def __init__(self, t0: float, sync: bool = True):
        self.last, self.sync, self.seconds = t0, sync, {}

    def mark(self, name: str) -> None:
        if self.sync:
            torch.cuda.synchronize()
        now = perf_counter()
        self.seconds[name] = round(now - self.last, 3)
        self.last = now


def _loss_and_norm(mean_loss: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> torch.Tensor:
    norm = grad_norm.detach().float().reshape(()) if grad_norm is not None else torch.zeros((), device=mean_loss.device)
    return torch.stack([mean_loss.detach().float().reshape(()), norm])


def _classify(loss: float, norm: float) -> Optional[str]:
    return "loss" if not math.isfinite(loss) else "gradients" if not math.isfinite(norm) else None


def step_profiler(steps: int, skip: int, out: Path, cuda: bool):
    """A started torch.profiler that records `steps` steps after `skip` (one more as its own warm-up);
    call `.step()` after every step and `.stop()` at the end. Writes OUT.json.gz (a gzipped chrome
    trace: an SD-size step is tens of MB of JSON) and OUT.txt (operators by device time, or host
    time without a GPU)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    def write(prof) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out.parent / f"{out.name}.json.gz"))
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        (out.parent / f"{out.name}.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, schedule=schedule(wait=max(skip - 1, 0), warmup=1, active=steps, repeat=1),
                   on_trace_ready=write)
    prof.start()
    return prof


def read_step(mean_loss: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> tuple[float, Optional[str]]:
    """The step's mean loss and what of it is non-finite ("loss", "gradients" or None): one host sync for both."""
    loss, norm = _loss_and_norm(mean_loss, grad_norm).tolist()
    return loss, _classify(loss, norm)


def host_copy_later(values: torch.Tensor) -> tuple[torch.Tensor, Optional["torch.cuda.Event"]]:
    """(host tensor, event): a CUDA tensor's copy into pinned host memory queued behind the kernels that
    make it, and the event that marks it landed (read it with `read_host_copy`); a host tensor as it is."""
    if not values.is_cuda:
        return values.cpu(), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def read_host_copy(host: torch.Tensor, event: Optional["torch.cuda.Event"]) -> torch.Tensor:
    """The host copy once it has landed (waits for the device only as far as its event)."""
    if event is not None:
        event.synchronize()
    return host


class StepReads:
    """Each step's mean loss and gradient norm, brought to the host without stalling the device.

    `push` queues a copy of the two numbers into pinned host memory behind the step's kernels;
    `settle(keep)` reads every pushed step but the newest `keep`, waiting for the device only as
    far as those steps. With `keep=1` the host queues step s+1 while the device still runs step s,
    so the device never idles while the host prepares a step (tokenizing, drawing noise, the
    optimizer's per-parameter launches). The loop settles everything before anything records a
    step (a log row, a checkpoint, the time check, the end), so a non-finite step is still never
    saved or logged.
    """

    def __init__(self):
        self._queue = []  # (step, host tensor [2], event or None)

    def push(self, step: int, mean_loss: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> None:
        self._queue.append((step, *host_copy_later(_loss_and_norm(mean_loss, grad_norm))))

    def settle(self, keep: int = 0) -> list[tuple[int, float, Optional[str]]]:
        """(step, loss, what is non-finite or None) of every pushed step but the newest `keep`, oldest first."""
        out = []
        while len(self._queue) > keep:
            step, host, event = self._queue.pop(0)
            loss, norm = read_host_copy(host, event).tolist()
            out.append((step, loss, _classify(loss, norm)))
        return out


class SharedDeadline:
    """Whether any process has passed `max_time_s` (0: never), agreed by every process without
    stalling the device.

    `poll()` queues this step's vote (a sum over the processes of "past the limit") behind the
    step's kernels and returns the verdict of the previous poll: every process stops at the same
    step, one step after the first of them passed the limit, and the host only waits for a step the
    device has (nearly) finished. Reading the vote at once made every step of a timed run a full
    host-device synchronisation. Without CUDA the vote is read at once (there is nothing to wait for).
    """

    def __init__(self, acc, max_time_s: float, started: float):
        self.acc, self.max_time_s, self.started = acc, max_time_s, started
        self._pending = None  # (pinned host scalar, event) of the last poll

    def poll(self) -> bool:
        if self.max_time_s <= 0:
            return False
        late = torch.full((), float(time.time() - self.started > self.max_time_s), device=self.acc.device)
        votes = host_copy_later(self.acc.reduce(late, reduction="sum"))
        if votes[1] is None:
            return bool(votes[0].item() > 0)
        pending, self._pending = self._pending, votes
        return pending is not None and bool(read_host_copy(*pending).item() > 0)
