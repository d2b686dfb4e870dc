"""Importance of the output channels of a convolution: pluggable callables.

An importance is any callable ``importance(conv, context) -> Tensor[conv.out_channels]``
(larger = more important; the lowest are removed). `conv` is the producing convolution
of a dependency group (a ResNet block's conv1), `context` an `ImportanceContext` giving
the whole group (``context.group.conv2`` consumes the channels, ``.norm2``,
``.time_emb_proj``), the UNet and a seeded generator.

Built in (names usable in ``prune.importance``):

- ``l1`` / ``l2``: magnitude of conv1's output filters (Li et al. 2017).
- ``taylor``: first-order Taylor estimate of the diffusion loss change, accumulated over
  timesteps as in Diff-Pruning (Fang et al. 2023): sum over every parameter the channel
  owns (conv1 filter and bias, time-embedding row(s), norm2 weight and bias, conv2's input
  slice) of ``|w * dL/dw|``, with ``dL/dw`` the gradient of the denoising loss summed over
  calibration batches at stratified timesteps. Needs gradients
  (``needs_gradients = True``): the prune verb runs `accumulate_diffusion_gradients` first.
- ``random``: uniform random scores from the context's generator (a control).

A custom importance is named ``"package.module:function"``.

Streams (``prune.scope: stream / all``, `stream`): a stream's channels are the output
channels of several producers (conv_in, ResNet conv2 / conv_shortcut, transformer proj_out,
sampler convs; a Conv2d or a Linear) and the input channels of several consumers. Its score
is the sum over members of the callable's scores, sliced to the stream's channels:
``importance(module, context)`` with ``context.channel_dim = 0`` for every producer, and, for
callables marked ``scores_inputs = True`` (l1, l2, taylor), ``channel_dim = 1`` for every
consumer conv / linear too (the skip-concatenation consumers of the up path included).
Taylor also adds ``|w * dL/dw|`` of the GroupNorm affines over the stream. A custom callable
gets a producer's Linear as well as Conv2d modules; ``context.group`` is then a
`stream.Stream`.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Iterable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from pocketdiff.conditioning import Conditioning, as_conditioning
from pocketdiff.errors import PocketdiffError

from .graph import InternalGroup


@dataclasses.dataclass
class ImportanceContext:
    name: str  # module path of the group's block (streams: the stream's name)
    group: InternalGroup  # or a stream.Stream
    unet: nn.Module
    generator: torch.Generator
    channel_dim: int = 0  # weight dimension the scores are over: 0 = output channels, 1 = input channels
    module_name: Optional[str] = None  # streams: the member module scored


Importance = Callable[[nn.Conv2d, ImportanceContext], torch.Tensor]


def _per_channel(w: torch.Tensor, context: Optional[ImportanceContext]) -> torch.Tensor:
    """`w` with the context's channel dimension first, flattened to [channels, rest]."""
    dim = context.channel_dim if context is not None else 0
    return w.detach().float().transpose(0, dim).flatten(1)


def l1_importance(conv: nn.Conv2d, context: Optional[ImportanceContext] = None) -> torch.Tensor:
    return _per_channel(conv.weight, context).abs().sum(dim=1)


def l2_importance(conv: nn.Conv2d, context: Optional[ImportanceContext] = None) -> torch.Tensor:
    return _per_channel(conv.weight, context).pow(2).sum(dim=1).sqrt()


def random_importance(conv: nn.Conv2d, context: ImportanceContext) -> torch.Tensor:
    return torch.rand(conv.weight.shape[context.channel_dim], generator=context.generator)


l1_importance.scores_inputs = True  # type: ignore[attr-defined]
l2_importance.scores_inputs = True  # type: ignore[attr-defined]


def _wg(p: Optional[torch.Tensor], name: str) -> Optional[torch.Tensor]:
    if p is None:
        return None
    if p.grad is None:
        raise PocketdiffError(f"taylor importance: no gradient on {name}; run accumulate_diffusion_gradients first")
    return (p.detach().float() * p.grad.detach().float()).abs()


def taylor_importance(conv: nn.Conv2d, context: ImportanceContext) -> torch.Tensor:
    g = context.group
    if not isinstance(g, InternalGroup):  # a stream member: everything along the channel dimension
        where = context.module_name or context.name
        score = _per_channel(_wg(conv.weight, f"{where}.weight"), context).sum(1)
        if context.channel_dim == 0 and getattr(conv, "bias", None) is not None:
            score = score + _wg(conv.bias, f"{where}.bias")
        return score
    if conv is not g.conv1:
        raise PocketdiffError("taylor importance scores a ResNet block's conv1 (the group's producer)")
    n = conv.out_channels
    score = _wg(conv.weight, f"{context.name}.conv1.weight").flatten(1).sum(1)
    b = _wg(conv.bias, f"{context.name}.conv1.bias")
    if b is not None:
        score = score + b
    score = score + _wg(g.conv2.weight, f"{context.name}.conv2.weight").transpose(0, 1).flatten(1).sum(1)
    if g.norm2.affine:
        score = score + _wg(g.norm2.weight, f"{context.name}.norm2.weight") + _wg(g.norm2.bias, f"{context.name}.norm2.bias")
    proj = g.time_emb_proj
    if proj is not None:
        rows = _wg(proj.weight, f"{context.name}.time_emb_proj.weight").sum(1)
        rb = _wg(proj.bias, f"{context.name}.time_emb_proj.bias")
        if rb is not None:
            rows = rows + rb
        score = score + (rows[:n] + rows[n:] if g.scale_shift else rows)
    return score


taylor_importance.needs_gradients = True  # type: ignore[attr-defined]
taylor_importance.scores_inputs = True  # type: ignore[attr-defined]
taylor_importance.scores_norms = True  # type: ignore[attr-defined]

IMPORTANCE: dict[str, Importance] = {
    "l1": l1_importance,
    "l2": l2_importance,
    "taylor": taylor_importance,
    "random": random_importance,
}


def resolve_importance(spec) -> Importance:
    """A registered name, a ``"module:function"`` path, or a callable."""
    if callable(spec):
        return spec
    spec = str(spec)
    if spec in IMPORTANCE:
        return IMPORTANCE[spec]
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise PocketdiffError(f"prune.importance: cannot import {spec!r}: {e}") from None
        if not callable(fn):
            raise PocketdiffError(f"prune.importance: {spec!r} is not callable")
        return fn
    raise PocketdiffError(f"prune.importance must be one of {sorted(IMPORTANCE)} or 'module:function', got {spec!r}")


def needs_gradients(fn: Importance) -> bool:
    return bool(getattr(fn, "needs_gradients", False))


def score_group(fn: Importance, group: InternalGroup, unet: nn.Module, generator: torch.Generator) -> torch.Tensor:
    """Run `fn` on a group's conv1 and check what it returns: float64 CPU [channels], finite."""
    ctx = ImportanceContext(group.name, group, unet, generator)
    with torch.no_grad():
        s = fn(group.conv1, ctx)
    s = torch.as_tensor(s)
    if s.device.type == "meta":
        raise PocketdiffError(f"importance returned a meta tensor for {group.name} (weights are not loaded)")
    s = s.detach().to("cpu", torch.float64).reshape(-1)
    if s.numel() != group.channels:
        raise PocketdiffError(f"importance returned {s.numel()} scores for {group.name}, which has {group.channels} channels")
    if not bool(torch.isfinite(s).all()):
        raise PocketdiffError(f"importance returned non-finite scores for {group.name}")
    return s


def score_stream(fn: Importance, stream, unet: nn.Module, generator: torch.Generator) -> torch.Tensor:
    """A stream's channel scores: the sum of `fn` over its producers (and consumers /
    GroupNorm affines, as the callable declares), each sliced to the stream; float64 CPU."""
    mods = dict(unet.named_modules())
    C = stream.channels
    total = torch.zeros(C, dtype=torch.float64)
    for m in stream.members:
        mod = mods[m.module]
        if m.role == "norm":
            if getattr(fn, "scores_norms", False) and mod.affine:
                total += (_wg(mod.weight, f"{m.module}.weight") + _wg(mod.bias, f"{m.module}.bias"))[m.offset:m.offset + C].double().cpu()
            continue
        if m.role == "in" and not getattr(fn, "scores_inputs", False):
            continue
        dim = 0 if m.role == "out" else 1
        ctx = ImportanceContext(stream.name, stream, unet, generator, channel_dim=dim, module_name=m.module)
        with torch.no_grad():
            s = torch.as_tensor(fn(mod, ctx))
        if s.device.type == "meta":
            raise PocketdiffError(f"importance returned a meta tensor for {m.module} (weights are not loaded)")
        s = s.detach().to("cpu", torch.float64).reshape(-1)
        if s.numel() != mod.weight.shape[dim]:
            raise PocketdiffError(f"importance returned {s.numel()} scores for {m.module} ({stream.name}), "
                                  f"which has {mod.weight.shape[dim]} channels along dimension {dim}")
        total += s[m.offset:m.offset + C]
    if not bool(torch.isfinite(total).all()):
        raise PocketdiffError(f"importance returned non-finite scores for {stream.name}")
    return total


def group_parameters(groups: Iterable[InternalGroup], streams: Iterable = (), unet: Optional[nn.Module] = None) -> list[nn.Parameter]:
    """The parameters whose gradients the importance of `groups` (and `streams` of `unet`) reads."""
    params, seen = [], set()

    def add(m):
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)

    for g in groups:
        for m in (g.conv1, g.conv2, g.norm2, g.time_emb_proj):
            if m is not None:
                add(m)
    streams = list(streams)
    if streams:
        mods = dict(unet.named_modules())
        for s in streams:
            for m in s.members:
                add(mods[m.module])
    return params


def accumulate_diffusion_gradients(
    unet: nn.Module,
    scheduler,
    batches: Iterable[tuple[torch.Tensor, Union[Conditioning, torch.Tensor]]],
    num_samples: int,
    params: list[nn.Parameter],
    generator: torch.Generator,
    t_range: tuple[float, float] = (0.0, 1.0),
    timestep_cond_fn: Optional[Callable[[int], torch.Tensor]] = None,
) -> dict:
    """Sum of denoising-loss gradients into ``p.grad`` for `params` (others frozen).

    `batches` yields (clean latents [B,C,H,W], their `Conditioning` or prompt embeddings [B,L,D]) on the UNet's device;
    the `num_samples` samples over all batches get timesteps stratified over
    ``t_range`` (fractions of the training timesteps), in a shuffled order, one per sample,
    with noise from `generator` (CPU). `timestep_cond_fn(B)` gives the ``timestep_cond`` of a
    guidance-conditioned UNet. Returns {"samples", "mean_loss", "timesteps"}.
    """
    from pocketdiff.train.losses import diffusion_target

    T = int(scheduler.config.num_train_timesteps)
    lo, hi = int(round(t_range[0] * T)), max(int(round(t_range[1] * T)), int(round(t_range[0] * T)) + 1)
    n = max(int(num_samples), 1)
    strata = lo + (torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=generator, dtype=torch.float64)) * (hi - lo) / n
    ts = strata.floor().clamp(lo, hi - 1).long()[torch.randperm(n, generator=generator)]
    saved = {id(p): p.requires_grad for p in unet.parameters()}
    want = {id(p) for p in params}
    for p in unet.parameters():
        p.requires_grad_(id(p) in want)
        if id(p) in want:
            p.grad = None
    was_training = unet.training
    unet.eval()
    done, losses = 0, []
    try:
        for latents, emb in batches:
            if done >= n:
                break
            B = min(latents.shape[0], n - done)
            latents, emb = latents[:B], as_conditioning(emb)[:B]
            noise = torch.randn(latents.shape, generator=generator).to(latents.device, latents.dtype)
            t = ts[done : done + B].to(latents.device)
            noisy = scheduler.add_noise(latents, noise, t)
            kwargs = {}
            if timestep_cond_fn is not None:
                kwargs["timestep_cond"] = timestep_cond_fn(B).to(device=latents.device, dtype=emb.dtype)
            pred = unet(noisy, t, **emb.unet_kwargs(), **kwargs).sample
            loss = F.mse_loss(pred.float(), diffusion_target(scheduler, latents, noise, t).float(), reduction="sum") / latents[0].numel()
            loss.backward()
            losses.append(loss.item() / B)
            done += B
    finally:
        for p in unet.parameters():
            p.requires_grad_(saved[id(p)])
        unet.train(was_training)
    if done == 0:
        raise PocketdiffError("taylor importance: the calibration data gave no batch")
    return {"samples": done, "mean_loss": sum(losses) / len(losses), "timesteps": [lo, hi]}
