"""Exponential moving average of a model's trainable parameters (a float32 shadow).

On the parameters' device (`device=None`) an update is one fused lerp. In host memory
(`device="cpu"`: no GPU memory) an update costs a device-to-host copy of every parameter
and a lerp over all of them on the CPU: at SD-2.1 size (865M parameters) that took 3-4 s
per update on an H100 machine when done in line. So the host update is asynchronous: the
parameters are copied into reused host buffers (one pinned block, reserved before training
when they live on a GPU) on a side stream that starts once the step that produced them is done,
so the copy engine works while the next step computes; a background thread waits for that copy
and does the lerp. The next optimizer step must not change the parameters before the copy has
read them: the training loop calls `fence()` before it (a wait on the device, not on the host).
Anything that reads `shadow` waits for the whole update first.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Optional

import torch


class EMA:
    """`every=k` updates every k-th step with decay^k (a host shadow's copy cost / k)."""

    def __init__(self, module: torch.nn.Module, decay: float, device: Optional[str] = None, every: int = 1):
        self.decay, self.device, self.every = decay, device, every
        self._shadow = {n: p.detach().to(device or p.device, torch.float32, copy=True)
                        for n, p in module.named_parameters() if p.requires_grad}
        self._staging: dict[str, torch.Tensor] = {}  # host copies of the parameters, reused
        self._pending: Optional[threading.Thread] = None
        self._copied = None  # (event, device): the side stream's copies of the last host update have landed
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._error: Optional[BaseException] = None
        self.setup_s = 0.0  # seconds spent pinning the staging memory (once, here, not inside a step)
        if device is not None and torch.device(device).type == "cpu":
            self._reserve_staging(module)

    def _reserve_staging(self, module: torch.nn.Module) -> None:
        """One pinned host block for every parameter on a GPU, carved into per-parameter views.

        Pinning is paid per byte and per call (an H100 machine took 22 s for 865M parameters
        pinned tensor by tensor inside the first EMA step); one call, before training starts,
        keeps that cost out of the steps and shows it as `setup_s`.
        """
        cuda = [(n, p) for n, p in module.named_parameters() if n in self._shadow and p.is_cuda]
        if not cuda:
            return
        t0 = time.perf_counter()
        flat = torch.empty(sum(p.numel() for _, p in cuda), dtype=torch.float32, pin_memory=True)
        offset = 0
        for n, p in cuda:
            self._staging[n] = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        self.setup_s = time.perf_counter() - t0

    @property
    def shadow(self) -> dict[str, torch.Tensor]:
        self.wait()
        return self._shadow

    @shadow.setter
    def shadow(self, value: dict[str, torch.Tensor]) -> None:
        self.wait()
        self._shadow = value

    def wait(self) -> None:
        """Block until a host update in flight has finished (raising what it raised)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def fence(self) -> None:
        """Make the current CUDA stream wait until the last host update's copies have read the
        parameters: call it before anything changes them in place (the optimizer step)."""
        copied, self._copied = self._copied, None
        if copied is not None:
            event, device = copied
            torch.cuda.current_stream(device).wait_event(event)

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    @torch.no_grad()
    def update(self, module: torch.nn.Module, step: Optional[int] = None) -> None:
        if step is not None and step % self.every:
            return
        weight = 1.0 - self.decay ** (self.every if step is not None else 1)
        if self.device is None:  # on the parameters' device: one fused kernel per group of tensors
            shadows, params = [], []
            for n, p in module.named_parameters():
                if n in self._shadow:
                    if self._shadow[n].device != p.device:  # built or loaded before the model moved
                        self._shadow[n] = self._shadow[n].to(p.device)
                    shadows.append(self._shadow[n])
                    params.append(p.detach().to(torch.float32))
            if shadows:
                torch._foreach_lerp_(shadows, params, weight)
            return
        self.wait()  # the staging buffers are free again
        named = [(n, p) for n, p in module.named_parameters() if n in self._shadow]
        if not named:
            return
        host = torch.device(self.device)
        cuda = next((p.device for _, p in named if p.is_cuda), None)
        event = None
        if cuda is not None:  # the copies start once the current stream has produced the parameters
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(cuda))
            stream = self._side_stream(cuda)
            stream.wait_event(ready)
        shadows, copies = [], []
        with torch.cuda.stream(stream) if cuda is not None else contextlib.nullcontext():
            for n, p in named:
                if self._shadow[n].device != host:  # loaded onto another device
                    self._shadow[n] = self._shadow[n].to(host)
                buf = self._staging.get(n)
                if buf is None or buf.shape != p.shape:
                    buf = self._staging[n] = torch.empty(p.shape, dtype=torch.float32, device=host, pin_memory=p.is_cuda)
                buf.copy_(p.detach(), non_blocking=p.is_cuda)
                shadows.append(self._shadow[n])
                copies.append(buf)
            if cuda is not None:
                event = torch.cuda.Event()
                event.record(stream)
        self._copied = (event, cuda) if cuda is not None else None
        self._pending = threading.Thread(target=self._host_lerp, args=(shadows, copies, weight, event),
                                         name="ema-host-update", daemon=True)
        self._pending.start()

    def _host_lerp(self, shadows, copies, weight: float, event) -> None:
        try:
            if event is not None:
                event.synchronize()  # the copies have landed
            torch._foreach_lerp_(shadows, copies, weight)
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
            self._error = e

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module) -> None:
        shadow = self.shadow
        for n, p in module.named_parameters():
            if n in shadow:
                p.copy_(shadow[n].to(p.dtype))
