"""Exponential moving average of a model's trainable parameters (a float32 shadow).

On the parameters' device (`device=None`) an update is one fused lerp. In host memory
(`device="cpu"`: the shadow costs no GPU memory) the shadow of parameters that live on a GPU is
one pinned host block, and an update streams it through the GPU in chunks on a side stream:
copy a chunk of the shadow in, lerp it towards the parameters there, copy it back. No host
thread touches the numbers, so the update neither competes with the training loop for the CPU
(at SD-2.1 size, 865M parameters, a host lerp took 3-4 s in line, and as a background thread it
slowed the following steps; under `accelerate launch`, which sets OMP_NUM_THREADS=1, a single
thread could not finish it between updates) nor needs more than one chunk of GPU memory
(`chunk_mb`, 64 MB by default). The side stream starts once the step that produced the
parameters is done; the next optimizer step must not change them before the lerp has read
them: the training loop calls `fence()` before it (a wait on the device, not on the host).
Anything that reads `shadow` waits for the whole update first.
"""
from __future__ import annotations

import time
from typing import Optional

import torch


def plan_chunks(sizes: list[int], chunk: int) -> list[tuple[int, int, list[int]]]:
    """Consecutive tensors of `sizes` (elements, laid end to end) grouped into (start, end, indices)
    spans of at most `chunk` elements; a tensor larger than `chunk` is a span of its own."""
    spans, start, offset, members = [], 0, 0, []
    for i, size in enumerate(sizes):
        if members and offset + size - start > chunk:
            spans.append((start, offset, members))
            start, members = offset, []
        members.append(i)
        offset += size
    if members:
        spans.append((start, offset, members))
    return spans


class EMA:
    """`every=k` updates every k-th step with decay^k (a host shadow's transfer cost / k)."""

    def __init__(self, module: torch.nn.Module, decay: float, device: Optional[str] = None, every: int = 1,
                 chunk_mb: float = 64.0):
        self.decay, self.device, self.every = decay, device, every
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._flat: Optional[torch.Tensor] = None  # the pinned host block behind the shadows of GPU parameters
        self._chunks: list[tuple[int, int, list[str]]] = []  # (start, end, names) of the flat block, in order
        self._scratch: Optional[torch.Tensor] = None  # one chunk on the GPU, allocated at the first update
        self._done: Optional[torch.cuda.Event] = None  # the last update's copies back to the host have landed
        self._copied = None  # (event, device): the last update's lerps have read the parameters
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.setup_s = 0.0  # seconds spent pinning the host block (once, here, not inside a step)
        host = device is not None and torch.device(device).type == "cpu"
        cuda = [(n, p) for n, p in named if p.is_cuda] if host else []
        self._shadow: dict[str, torch.Tensor] = {}
        if cuda:
            self._pin(cuda, max(1, int(chunk_mb * 2**20 / 4)))
        for n, p in named:
            if n not in self._shadow:
                self._shadow[n] = p.detach().to(device or p.device, torch.float32, copy=True)

    def _pin(self, cuda: list, chunk: int) -> None:
        """One pinned host block for every GPU parameter's shadow, carved into views, and its chunks.

        Pinning is paid per byte and per call (an H100 machine took 22 s for 865M parameters
        pinned tensor by tensor); one call, before training starts, keeps that cost out of the
        steps and shows it as `setup_s`.
        """
        t0 = time.perf_counter()
        self._flat = torch.empty(sum(p.numel() for _, p in cuda), dtype=torch.float32, pin_memory=True)
        offset = 0
        for n, p in cuda:
            view = self._flat[offset:offset + p.numel()].view(p.shape)
            view.copy_(p.detach())
            self._shadow[n] = view
            offset += p.numel()
        self._chunks = [(start, end, [cuda[i][0] for i in members])
                        for start, end, members in plan_chunks([p.numel() for _, p in cuda], chunk)]
        self.setup_s = time.perf_counter() - t0

    @property
    def shadow(self) -> dict[str, torch.Tensor]:
        self.wait()
        return self._shadow

    @shadow.setter
    def shadow(self, value: dict[str, torch.Tensor]) -> None:
        self.wait()
        for n, v in value.items():  # into the pinned block where there is one, so the chunks stay valid
            if self._flat is not None and n in self._shadow and self._shadow[n].shape == v.shape:
                self._shadow[n].copy_(v)
            else:
                self._shadow[n] = v.float()

    def wait(self) -> None:
        """Block until the update in flight has written the shadow back to the host."""
        done, self._done = self._done, None
        if done is not None:
            done.synchronize()

    def fence(self) -> None:
        """Make the current CUDA stream wait until the last update has read the parameters: call it
        before anything changes them in place (the optimizer step)."""
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
        params = {n: p for n, p in module.named_parameters() if n in self._shadow}
        self.wait()  # the previous update has landed (the chunks reuse one scratch buffer)
        streamed = self._flat is not None and all(params[n].is_cuda for _, _, names in self._chunks for n in names if n in params)
        shadows, values = [], []
        for n, p in params.items():
            s = self._shadow[n]
            if streamed and p.is_cuda and s.is_pinned():
                continue  # streamed below
            if s.device != p.device and self.device is None:  # built or loaded before the model moved
                s = self._shadow[n] = s.to(p.device)
            shadows.append(s)
            values.append(p.detach().to(s.device, torch.float32))
        if shadows:  # on the parameters' device, or host shadows of host parameters: one fused lerp in line
            torch._foreach_lerp_(shadows, values, weight)
        if streamed:
            self._stream_update(params, weight)

    def _stream_update(self, params: dict, weight: float) -> None:
        """Lerp the pinned shadow towards the GPU parameters chunk by chunk on a side stream."""
        cuda = next(p.device for n, p in params.items() if p.is_cuda)
        if self._scratch is None:
            size = max(end - start for start, end, _ in self._chunks)
            self._scratch = torch.empty(size, dtype=torch.float32, device=cuda)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(cuda))
        stream = self._side_stream(cuda)
        stream.wait_event(ready)  # the parameters of this step are final
        with torch.cuda.stream(stream):
            for start, end, names in self._chunks:
                part = self._scratch[: end - start]
                part.copy_(self._flat[start:end], non_blocking=True)
                views, offset = [], 0
                for n in names:
                    numel = self._shadow[n].numel()
                    views.append(part[offset:offset + numel].view(self._shadow[n].shape))
                    offset += numel
                torch._foreach_lerp_(views, [params[n].detach().float() for n in names], weight)
                self._flat[start:end].copy_(part, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._copied = (done, cuda)
        self._done = done

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module) -> None:
        shadow = self.shadow
        for n, p in module.named_parameters():
            if n in shadow:
                p.copy_(shadow[n].to(p.dtype))
