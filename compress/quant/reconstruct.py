"""Block reconstruction over a UNet's blocks: the walk (which inputs and targets each block gets, in
which order, on which devices). One block's optimiser is `block_recon`.

Modes:
- sequential: block k's inputs come from the UNet whose blocks 0..k-1 are already
  quantized (hard), targets from the float UNet; QDrop mixes those inputs element-wise with
  the float ones (probability `qdrop` of taking the float value).
- independent: float inputs and targets; blocks are independent, so with several devices
  they are spread over one worker process per device.

Memory. Captured block inputs and targets are cached per group of consecutive blocks that
fits the cache budget. Without `stream` the cache is on the device when the largest block's
data fits, and the UNet stays there. With `stream` (or on the CPU) the cache is on the host
(`cache_store.HostCache`: pageable memory with a group budget from the host cap, or files on
disk; each block's part freed when its reconstruction ends), the float UNet is on the device only for the capture passes (sequential mode keeps its quantized
copy there, to capture each block's inputs), and each block comes to the device with its
cached data (when that takes at most half of what is left under the cap; else minibatches
are gathered from the host, and an out-of-memory on the device copy falls back to that) only
while it is reconstructed. `memory_cap_bytes` is checked per block before anything runs
(`block_need_bytes`, a lower bound) and names the block that cannot fit; the report gets each
block's seconds and peak device memory. One progress bar runs over the blocks, with the
current block's loss.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError

from .block_recon import (DTYPES, BlockResult, LayerResult, ReconConfig, capture_settings, layer_inits, precision,
                          rest_block_result)
from .blocks import (Block, CalibSet, Request, build_blocks, first_tensor, group_by_budget, human_bytes, order_blocks,
                     unet_forward)
from .block_walk import (LiveWeights, Walk, cache_stores, capture_group, empty_device_cache, fisher_for, float_weights,
                         free_captures, per_block, run_independent, span)
from .cache_store import HostCache
from .quantizer import LayerSpec, dequant
from .reconstruct_devices import run_parallel

__all__ = ["reconstruct_unet", "write_weights", "float_weights", "block_need_bytes", "module_bytes", "check_memory_cap",
           "fisher_weights"]


# ----------------------------------------------------------------------- Fisher weights


def fisher_weights(unet: nn.Module, blocks: Sequence[Block], calib: CalibSet, device, batch: int, seed: int = 0,
                   store_device="cpu") -> dict[str, torch.Tensor]:
    """Per unit: [N, C] diagonal Gauss-Newton weights of its output (squared gradient of r . UNet
    output, r ~ N(0, I), averaged over positions), normalised to mean 1."""
    units = [u for b in blocks if b.kind != "rest" for u in b.units]
    n = len(calib)
    store: dict[str, list] = {u.name: [] for u in units}
    gen = torch.Generator("cpu").manual_seed(seed)
    for start in range(0, n, batch):
        end = min(n, start + batch)
        outs: dict[str, torch.Tensor] = {}
        handles = []

        def make(name):
            def hook(module, args, output):
                t = first_tensor(output)
                if not t.requires_grad:
                    t.requires_grad_(True)
                outs[name] = t
                return output
            return hook

        for u in units:
            handles.append(unet.get_submodule(u.exit).register_forward_hook(make(u.name)))
        try:
            with torch.enable_grad():
                b = calib.batch_kwargs(start, end, device, torch.float32)
                out = unet_forward(unet, b)
                r = torch.randn(out.shape, generator=gen).to(device)
                names = [k for k in outs if outs[k].requires_grad]
                grads = torch.autograd.grad((out * r).sum(), [outs[k] for k in names], allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for k, g in zip(names, grads):
            if g is None:
                g = torch.zeros_like(outs[k])
            g2 = g.detach().float() ** 2
            if g2.dim() > 2:
                g2 = g2.flatten(2).mean(dim=2)
            store[k].append(g2.to(store_device))
    result = {}
    for k, parts in store.items():
        w = torch.cat(parts)
        result[k] = w / w.mean().clamp_min(1e-30)
    return result


# ----------------------------------------------------------------------- memory


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def block_need_bytes(block: Block, per_sample: dict, opts: ReconConfig) -> int:
    """A lower bound on the device memory that reconstructing `block` takes, its cached data
    aside: its modules, 11 float32 copies of every quantized weight (the float, RTN and initial
    weights; AdaRound's base, rounding variables, their gradient and Adam's two moments; the soft
    weight and its gradient; the hard-rounded weight) and one minibatch of inputs, targets,
    outputs and output gradients."""
    if block.kind == "rest":
        return 0
    modules = sum(module_bytes(u.module) for u in block.units)
    quantized = sum(u.module.get_submodule(local).weight.numel() for u in block.units for local in u.layers)
    ps = per_sample[block.name]
    return modules + 44 * quantized + opts.batch_size * (ps["in"] + 3 * ps["out"])


def check_memory_cap(blocks: Sequence[Block], per_sample: dict, opts: ReconConfig, cap: int, resident: int,
                     unet_bytes: int) -> dict[str, int]:
    """Per block, the bytes it needs at least (plus `resident`, what stays on the device meanwhile);
    a PocketdiffError naming the first block, or the capture passes, that `cap` cannot hold."""
    what = f"memory_cap_gib={cap / 2 ** 30:g} ({cap:,} bytes)"
    if unet_bytes > cap:
        raise PocketdiffError(f"{what} cannot hold the UNet for the capture passes: its weights take {unet_bytes:,} bytes "
                              f"({human_bytes(unet_bytes)}); raise memory_cap_gib")
    needs = {}
    for b in blocks:
        need = block_need_bytes(b, per_sample, opts) + resident
        needs[b.name] = need
        if need > cap:
            raise PocketdiffError(f"{what} cannot hold block {b.name}: reconstructing it needs at least {need:,} bytes "
                                  f"({human_bytes(need)}: its weights, rounding variables and Adam state, a minibatch of "
                                  f"{opts.batch_size}{', and the UNet kept on the device' if resident else ''}); "
                                  f"raise memory_cap_gib or lower recon.batch_size")
    return needs


# ----------------------------------------------------------------------- drivers


@torch.no_grad()
def write_weights(unet: nn.Module, layers: dict[str, LayerResult], specs: dict[str, LayerSpec]) -> None:
    """Copy dequantized (codes * scales) weights into `unet` in place."""
    for g, lr in layers.items():
        p = unet.get_submodule(g).weight
        p.copy_(dequant(lr.codes, lr.scale, specs[g]).to(device=p.device, dtype=p.dtype))


def reconstruct_unet(
    unet: nn.Module,
    calib: CalibSet,
    specs: dict[str, LayerSpec],
    opts: ReconConfig,
    *,
    device,
    skip: Sequence[str] = (),
    seed: int = 0,
    log: Optional[Callable[[str], None]] = print,
    devices: Optional[Sequence[str]] = None,
    memory_cap_bytes: Optional[int] = None,
    host_cache: Optional[HostCache] = None,
) -> tuple[list[BlockResult], dict]:
    """Quantize every block of `unet` (float). Returns the block results in execution order
    (layer codes + scales + stats) and run info. `unet`'s weights are not modified; it ends on
    the device it started on (`opts.stream` moves it to the host between capture passes).

    `memory_cap_bytes`: every block's need (`block_need_bytes`) is checked against it before any
    reconstruction, and running out of device memory raises a PocketdiffError naming the block
    (the cap itself is the caller's: torch.cuda.set_per_process_memory_fraction). `host_cache`: the
    host caches' group budget and disk folder (`cache_store.HostCache`; default: in memory, 40 % of
    the available memory per group)."""
    device = torch.device(device)
    t0 = time.time()
    home = next(unet.parameters()).device
    unet.to(device)
    blocks = build_blocks(unet, skip)
    per_sample = order_blocks(unet, blocks, calib, device)
    names = [g for b in blocks for g in b.layers]
    missing = set(specs) ^ set(names)
    if missing:
        raise PocketdiffError(f"layer specs and blocks disagree on {sorted(missing)[:5]}")
    devices = list(devices or [])
    parallel = opts.mode == "independent" and len(devices) > 1 and opts.method == "adaround"
    sequential = opts.mode == "sequential" and opts.method == "adaround"
    unet_bytes = module_bytes(unet)
    needs: dict = {}
    if memory_cap_bytes is not None:
        resident = unet_bytes * ((1 if sequential else 0) if opts.stream else (2 if sequential else 1))
        needs = check_memory_cap([b for b in blocks if b.kind != "rest"], per_sample, opts, int(memory_cap_bytes), resident,
                                 unet_bytes * (2 if sequential else 1))
    weights = LiveWeights(unet, names)
    rtn_res, init_scales = layer_inits(weights, specs, opts, device)
    host_cache = host_cache or HostCache()
    info: dict = {"blocks": len(blocks), "samples": len(calib), "mode": opts.mode, "method": opts.method, "stream": opts.stream}
    fisher = None
    if opts.loss == "fisher" and opts.method == "adaround":
        tf = time.time()
        with precision(False):
            fisher = fisher_weights(unet, blocks, calib, device, max(1, opts.forward_batch // 4), seed=seed)
        info["fisher_s"] = round(time.time() - tf, 3)
    walk = Walk(device, opts, memory_cap_bytes, needs, sum(1 for b in blocks if b.kind != "rest"), None if parallel else log)
    try:
        if parallel:
            results = run_parallel(unet, calib, blocks, specs, opts, devices, skip, seed, fisher, log, memory_cap_bytes, needs)
        elif sequential:
            results = _run_sequential(unet, calib, blocks, per_sample, weights, specs, rtn_res, init_scales, opts, device, seed,
                                      fisher, walk, host_cache)
        else:
            results = run_independent(unet, calib, blocks, per_sample, weights, specs, rtn_res, init_scales, opts, device,
                                       seed, fisher, walk, host_cache)
    finally:
        walk.close()
        host_cache.cleanup()
        unet.to(home)
    info["reconstruct_s"] = round(time.time() - t0, 3)
    info["rtn"] = {g: rtn_res[g] for g in names}
    if walk.cuda:
        info["peak_gpu_bytes"], info["peak_gpu_reserved_bytes"] = walk.peak, walk.peak_reserved
    return results, info


def _run_sequential(unet, calib, blocks, per_sample, weights, specs, rtn_res, init_scales, opts, device, seed, fisher, walk, host):
    q_unet = copy.deepcopy(unet)  # stays on the device: block k's inputs come from its quantized prefix
    q_blocks = {b.name: b for b in build_blocks(q_unet, [])}
    # units of q_unet share paths with `blocks`; keep the ordered list but q_unet's modules
    ordered = []
    for b in blocks:
        qb = q_blocks.get(b.name)
        if qb is None or b.kind == "rest":
            ordered.append(b)
            continue
        units = {u.name: u for u in qb.units}
        ordered.append(Block(b.name, b.kind, [dataclasses.replace(units[u.name], layers=u.layers) for u in b.units], b.order))
    store_dtype = DTYPES[opts.cache_dtype]
    tf32, cap_ac = capture_settings(opts, device)
    n = len(calib)
    budget, store, folder = cache_stores(opts, per_sample, n, device, host, 2 if opts.qdrop > 0 else 1)
    keys = ("in", "out") if opts.qdrop > 0 else ("out",)
    groups = group_by_budget([b for b in ordered if b.kind != "rest"], per_sample, n, budget / 2, keys)
    results = []
    for group in groups:
        reqs = [Request(u, inputs=opts.qdrop > 0, output=True) for b in group for u in b.units]
        fcaps = capture_group(walk, unet, calib, reqs, (store, store_dtype, cap_ac, folder), f"the float targets of {span(group)}",
                              opts, device, tf32)
        for b, mine in per_block(group, fcaps):
            with precision(tf32):
                qcaps = walk.capture(q_unet, calib, [Request(u, inputs=True) for u in b.units], store, store_dtype, cap_ac, folder,
                                     f"the inputs of {b.name}")
            res = walk.block(b, qcaps, [c.output for c in mine], weights=weights, specs=specs, rtn_res=rtn_res,
                             init_scales=init_scales, fp_caps=mine if opts.qdrop > 0 else None, fisher=fisher_for(b, fisher),
                             seed=seed + b.order)
            write_weights(q_unet, res.layers, specs)
            results.append(res)
            free_captures(qcaps + mine)
            del qcaps, mine
        del fcaps
        empty_device_cache(device)
    for b in ordered:
        if b.kind == "rest":
            results.append(rest_block_result(b, weights, specs, rtn_res, init_scales))
    del q_unet
    return results


