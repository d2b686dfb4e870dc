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
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from pocketdiff.device import cap_cuda_memory
from pocketdiff.errors import PocketdiffError

from .block_recon import (DTYPES, BlockResult, LayerResult, ReconConfig, capture_settings, layer_inits, precision,
                          reconstruct_block, rest_block_result)
from .blocks import (Block, CalibSet, Captured, Request, build_blocks, capture, first_tensor, group_by_budget, human_bytes,
                     order_blocks, unet_forward)
from .cache_store import HostCache, release
from .quantizer import LayerSpec, dequant


def cache_budget(opts: ReconConfig, device) -> float:
    if opts.cache_budget_gb is not None:
        return opts.cache_budget_gb * 2 ** 30
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return 0.4 * free
    return 4 * 2 ** 30


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


class _Walk:
    """What every block's reconstruction shares: device, options, memory cap, progress bar (one
    over the blocks, with the current block's loss), peak-memory meter and log."""

    def __init__(self, device: torch.device, opts: ReconConfig, cap: Optional[int], needs: dict, total: int,
                 log: Optional[Callable[[str], None]], bar: bool = True):
        from tqdm.auto import tqdm

        self.device, self.opts, self.cap, self.needs, self.total, self.log = device, opts, cap, needs, total, log
        self.cuda = device.type == "cuda"
        self.peak = torch.cuda.max_memory_allocated(device) if self.cuda else 0
        self.peak_reserved = torch.cuda.max_memory_reserved(device) if self.cuda else 0
        self.done = 0
        self.bar = tqdm(total=total, desc="calibrate", unit="block", disable=log is None or not bar, file=sys.stderr, dynamic_ncols=True)

    def emit(self, msg: str) -> None:
        if self.log is not None:
            with self.bar.external_write_mode(file=sys.stderr):
                self.log(msg)

    def _fold(self) -> None:
        if self.cuda:
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
            self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved(self.device))

    def _oom(self, what: str, e: BaseException) -> PocketdiffError:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        cap = f"memory_cap_gib={self.cap / 2 ** 30:g}" if self.cap else "the device's memory"
        return PocketdiffError(f"{what} ran out of device memory under {cap} ({first}); raise memory_cap_gib or lower "
                               f"recon.batch_size / recon.forward_batch")

    def capture(self, unet, calib, reqs, store, store_dtype, autocast, folder, what: str):
        try:
            return capture(unet, calib, reqs, device=self.device, batch_size=self.opts.forward_batch, store_device=store,
                           store_dtype=store_dtype, autocast=autocast, disk_folder=folder)
        except torch.cuda.OutOfMemoryError as e:
            raise self._oom(f"the capture pass for {what}", e) from None

    def _fits(self, block: Block, data: int) -> bool:
        """Whether a block's cached data may live on the device while it is reconstructed: half of
        what is left under the cap (or of the cache budget) after its own need is kept for activations."""
        if not self.cuda:
            return False
        if self.cap:
            room = self.cap - torch.cuda.memory_allocated(self.device) - self.needs.get(block.name, 0)
        else:
            room = cache_budget(self.opts, self.device)
        return data <= 0.5 * room

    def block(self, b: Block, caps, targets, *, weights, specs, rtn_res, init_scales, fp_caps=None, fisher=None, seed=0,
              move_module: bool = False) -> BlockResult:
        """Reconstruct one block: its modules on the device (`move_module`: moved there and back), its
        cached data on the device when it fits (else minibatches are gathered from the host cache)."""
        t0 = time.time()
        self._fold()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        opts = self.opts

        def progress(it: int, loss: float) -> None:
            self.bar.set_postfix_str(f"{b.name} it {it + 1}/{opts.iters} loss {loss:.3e}", refresh=False)
            self.bar.update(0)

        host = (list(caps), list(targets), None if fp_caps is None else list(fp_caps))
        data = (sum(c.nbytes(output=False) for c in caps) + sum(t.numel() * t.element_size() for t in targets)
                + sum(c.nbytes(output=False) for c in fp_caps or []))
        on_device = all(t.device == self.device for t in targets) or self._fits(b, data)
        if move_module:
            for u in b.units:
                u.module.to(self.device)
        try:
            while True:
                c = t = f = None
                try:
                    if on_device:
                        c, t = [x.to(self.device, output=False) for x in host[0]], [x.to(self.device) for x in host[1]]
                        f = None if host[2] is None else [x.to(self.device, output=False) for x in host[2]]
                    else:
                        c, t, f = host
                    res = reconstruct_block(b, c, t, weights, specs, rtn_res, init_scales, opts, self.device, fp_caps=f,
                                            fisher=fisher, seed=seed, progress=progress)
                    break
                except torch.cuda.OutOfMemoryError as e:
                    if not (on_device and any(x.device != self.device for x in host[1])):
                        raise self._oom(f"block {b.name} (needs at least {self.needs.get(b.name, 0):,} bytes)", e) from None
                c = t = f = None  # the device copies of its data go; minibatches come from the host cache
                _empty_cache(self.device)
                self.emit(f"{b.name}: its cached data does not fit next to the optimisation; gathering minibatches "
                          f"from host memory instead")
                on_device = False
        finally:
            if move_module:
                for u in b.units:
                    u.module.to("cpu")
        del c, t, f
        res.stats["cache_on_device"] = bool(on_device)
        res.stats["time_s"] = round(time.time() - t0, 3)  # with the moves of its module and data
        if self.cuda:
            res.stats["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2 ** 30, 3)
            self._fold()
            _empty_cache(self.device)
        self.done += 1
        self.emit(_fmt(self.done, self.total, res))
        self.bar.update(1)
        return res

    def close(self) -> None:
        self._fold()
        self.bar.close()


# ----------------------------------------------------------------------- drivers


def _log(msg: str, log: Optional[Callable[[str], None]]) -> None:
    if log is not None:
        log(msg)


def _fmt(block_idx: int, total: int, res: BlockResult) -> str:
    s = res.stats
    if "mse_rtn_calib" not in s:
        return f"[{block_idx}/{total}] {res.name} ({res.kind}): {s.get('layers', 0)} layers, rtn_mse (no reconstruction)"
    peak = f", peak {s['peak_gpu_gib']:.2f} GiB" if "peak_gpu_gib" in s else ""
    return (f"[{block_idx}/{total}] {res.name} ({res.kind}, {s['layers']} layers): mse rtn {s['mse_rtn_calib']:.3e} "
            f"init {s['mse_init_calib']:.3e} -> {s['mse_recon_calib']:.3e} ({s['chosen']}) {s['time_s']:.1f}s{peak}")


def float_weights(unet: nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    return {g: unet.get_submodule(g).weight.detach().float().cpu().clone() for g in names}


class LiveWeights(Mapping):
    """The float weights of `unet`'s layers `names`, read from the module wherever it is now: no host
    copy of the UNet's weights (a stream moves the UNet between the device and the host, so references
    taken once would keep a second host copy alive). Read only: the UNet is not modified."""

    def __init__(self, unet: nn.Module, names: Sequence[str]):
        self.unet, self.names = unet, list(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.unet.get_submodule(name).weight.detach().float()

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


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
    walk = _Walk(device, opts, memory_cap_bytes, needs, sum(1 for b in blocks if b.kind != "rest"), None if parallel else log)
    try:
        if parallel:
            results = _run_parallel(unet, calib, blocks, specs, opts, devices, skip, seed, fisher, log, memory_cap_bytes, needs)
        elif sequential:
            results = _run_sequential(unet, calib, blocks, per_sample, weights, specs, rtn_res, init_scales, opts, device, seed,
                                      fisher, walk, host_cache)
        else:
            results = _run_independent(unet, calib, blocks, per_sample, weights, specs, rtn_res, init_scales, opts, device,
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


def _fisher_for(block: Block, fisher):
    if fisher is None:
        return None
    return [fisher.get(u.name) for u in block.units]


def _stores(opts: ReconConfig, per_sample, n, device, host: HostCache, input_copies: int = 1):
    """(cache budget, cache device, disk folder): the host (in memory, or in files under `host.folder`)
    when streaming or computing there, else the device when the largest block's data fits in the
    budget, else the host memory."""
    if opts.stream or torch.device(device).type != "cuda":
        if host.folder is not None:
            Path(host.folder).mkdir(parents=True, exist_ok=True)
        return host.budget(), torch.device("cpu"), host.folder
    budget = cache_budget(opts, device)
    largest = max((n * (v["in"] * input_copies + v["out"]) for v in per_sample.values()), default=0)
    return budget, (torch.device(device) if largest <= budget else torch.device("cpu")), None


def _span(group: Sequence[Block]) -> str:
    return group[0].name if len(group) == 1 else f"blocks {group[0].name} .. {group[-1].name}"


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
    budget, store, folder = _stores(opts, per_sample, n, device, host, 2 if opts.qdrop > 0 else 1)
    keys = ("in", "out") if opts.qdrop > 0 else ("out",)
    groups = group_by_budget([b for b in ordered if b.kind != "rest"], per_sample, n, budget / 2, keys)
    results = []
    for group in groups:
        reqs = [Request(u, inputs=opts.qdrop > 0, output=True) for b in group for u in b.units]
        if opts.stream:
            unet.to(device)
        with precision(tf32):
            fcaps = walk.capture(unet, calib, reqs, store, store_dtype, cap_ac, folder, f"the float targets of {_span(group)}")
        if opts.stream:
            unet.to("cpu")
            _empty_cache(device)
        k = 0
        for b in group:
            nu = len(b.units)
            mine = fcaps[k:k + nu]
            k += nu
            with precision(tf32):
                qcaps = walk.capture(q_unet, calib, [Request(u, inputs=True) for u in b.units], store, store_dtype, cap_ac, folder,
                                     f"the inputs of {b.name}")
            res = walk.block(b, qcaps, [c.output for c in mine], weights=weights, specs=specs, rtn_res=rtn_res,
                             init_scales=init_scales, fp_caps=mine if opts.qdrop > 0 else None, fisher=_fisher_for(b, fisher),
                             seed=seed + b.order)
            write_weights(q_unet, res.layers, specs)
            results.append(res)
            _free(qcaps + mine)
            fcaps[k - nu:k] = [None] * nu  # this block's cache goes now, not with its group
            del qcaps, mine
        del fcaps
        _empty_cache(device)
    for b in ordered:
        if b.kind == "rest":
            results.append(rest_block_result(b, weights, specs, rtn_res, init_scales))
    del q_unet
    return results


def _run_independent(unet, calib, blocks, per_sample, weights, specs, rtn_res, init_scales, opts, device, seed, fisher, walk,
                     host: Optional[HostCache] = None):
    store_dtype = DTYPES[opts.cache_dtype]
    tf32, cap_ac = capture_settings(opts, device)
    n = len(calib)
    budget, store, folder = _stores(opts, per_sample, n, device, host or HostCache())
    results = []
    real = [b for b in blocks if b.kind != "rest"]
    for group in group_by_budget(real, per_sample, n, budget, ("in", "out")):
        reqs = [Request(u, inputs=True, output=True) for b in group for u in b.units]
        if opts.stream:
            unet.to(device)
        with precision(tf32):
            caps = walk.capture(unet, calib, reqs, store, store_dtype, cap_ac, folder, _span(group))
        if opts.stream:  # only the block being reconstructed comes back to the device
            unet.to("cpu")
            _empty_cache(device)
        k = 0
        for b in group:
            nu = len(b.units)
            mine = caps[k:k + nu]
            k += nu
            res = walk.block(b, mine, [c.output for c in mine], weights=weights, specs=specs, rtn_res=rtn_res,
                             init_scales=init_scales, fisher=_fisher_for(b, fisher), seed=seed + b.order,
                             move_module=opts.stream)
            results.append(res)
            _free(mine)
            caps[k - nu:k] = [None] * nu  # this block's cache goes now, not with its group
            del mine
        del caps
        _empty_cache(device)
    for b in blocks:
        if b.kind == "rest":
            results.append(rest_block_result(b, weights, specs, rtn_res, init_scales))
    return results


def _free(caps: Sequence[Captured]) -> None:
    """Close the disk files of these captures (memory goes with the last reference)."""
    for c in caps:
        release([*c.leaves, c.output])


def _empty_cache(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------- several devices


def _block_cost(block: Block, per_sample: dict) -> float:
    """FLOP proxy: quantized parameters x output positions."""
    params = sum(p.numel() for u in block.units for p in u.module.parameters())
    out_elems = per_sample[block.name]["out"] / 4
    channels = 1
    for u in block.units:
        for p in u.module.parameters():
            channels = max(channels, p.shape[0])
            break
    return params * max(1.0, out_elems / max(channels, 1))


def split_blocks(blocks: Sequence[Block], per_sample: dict, k: int) -> list[list[str]]:
    """Longest-processing-time assignment of blocks to k workers."""
    loads = [0.0] * k
    parts: list[list[str]] = [[] for _ in range(k)]
    for b in sorted(blocks, key=lambda b: -_block_cost(b, per_sample)):
        i = min(range(k), key=lambda j: loads[j])
        parts[i].append(b.name)
        loads[i] += _block_cost(b, per_sample)
    return parts


def _worker(rank: int, device: str, unet_cls: str, unet_config: dict, state: dict, calib_tensors: dict, meta: dict,
            block_names: list, specs: dict, opts: ReconConfig, skip: list, seed: int, fisher, out_path: str,
            threads: int = 0, cap: Optional[int] = None, needs: Optional[dict] = None) -> None:
    try:
        import importlib

        if threads > 0:
            torch.set_num_threads(threads)  # the parent's CPU thread setting

        mod_name, cls_name = unet_cls.rsplit(".", 1)
        cls = getattr(importlib.import_module(mod_name), cls_name)
        unet = cls.from_config(unet_config)
        unet.load_state_dict(state)
        if cap is not None and torch.device(device).type == "cuda":  # each worker holds to the cap on its own device
            cap_cuda_memory(cap, device)
        unet.to(device).eval().requires_grad_(False)
        calib = CalibSet(meta=meta, **calib_tensors)
        blocks = build_blocks(unet, skip)
        per_sample = order_blocks(unet, blocks, calib, device)
        mine = [b for b in blocks if b.name in set(block_names)]
        names = [g for b in mine for g in b.layers]
        weights = float_weights(unet, names)
        my_specs = {g: specs[g] for g in names}
        rtn_res, init_scales = layer_inits(weights, my_specs, opts, device)

        def log(msg):
            print(f"[{device}] {msg}", file=sys.stderr, flush=True)

        walk = _Walk(torch.device(device), opts, cap, needs or {}, len(mine), log, bar=False)  # no bars from several processes
        results = _run_independent(unet, calib, mine, per_sample, weights, my_specs, rtn_res, init_scales, opts, device, seed,
                                   fisher, walk)
        walk.close()
        torch.save({"results": [dataclasses.asdict(r) for r in results]}, out_path)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        Path(out_path + ".err").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}", encoding="utf-8")
        raise SystemExit(1)


def _run_parallel(unet, calib, blocks, specs, opts, devices, skip, seed, fisher, log, cap=None, needs=None) -> list[BlockResult]:
    import torch.multiprocessing as mp

    per_sample = order_blocks(unet, blocks, calib, next(unet.parameters()).device)
    real = [b for b in blocks if b.kind != "rest"]
    parts = split_blocks(real, per_sample, len(devices))
    _log(f"independent mode on {len(devices)} devices: " + ", ".join(f"{d}: {len(p)} blocks" for d, p in zip(devices, parts)), log)
    ctx = mp.get_context("spawn")
    state = {k: v.detach().cpu() for k, v in unet.state_dict().items()}
    calib_tensors = {k: v.cpu() for k, v in calib.tensors().items()}
    cls = f"{type(unet).__module__}.{type(unet).__qualname__}"
    config = dict(unet.config)
    procs = []
    tmp = tempfile.mkdtemp(prefix="pocketdiff-calib-")
    try:
        for rank, (dev, part) in enumerate(zip(devices, parts)):
            if not part:
                continue
            out_path = os.path.join(tmp, f"worker{rank}.pt")
            my_fisher = None if fisher is None else {k: v.cpu() for k, v in fisher.items()}
            p = ctx.Process(target=_worker, args=(rank, dev, cls, config, state, calib_tensors, dict(calib.meta), part, specs,
                                                  opts, list(skip), seed, my_fisher, out_path, torch.get_num_threads(), cap,
                                                  needs))
            p.start()
            procs.append((p, out_path, dev))
        results: list[BlockResult] = []
        errors = []
        for p, out_path, dev in procs:
            p.join()
            if p.exitcode != 0 or not os.path.isfile(out_path):
                err = Path(out_path + ".err")
                msg = err.read_text(encoding="utf-8").splitlines()[0] if err.is_file() else f"exit code {p.exitcode}"
                errors.append(f"{dev}: {msg}")
                continue
            data = torch.load(out_path, weights_only=True)
            for r in data["results"]:
                layers = {g: LayerResult(**lr) for g, lr in r["layers"].items()}
                results.append(BlockResult(r["name"], r["kind"], layers, r["stats"]))
        if errors:
            raise PocketdiffError("calibration worker failed: " + "; ".join(errors))
    finally:
        for p, _, _ in procs:
            if p.is_alive():
                p.terminate()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    order = {b.name: i for i, b in enumerate(blocks)}
    results.sort(key=lambda r: order.get(r.name, 10 ** 9))
    rest = [b for b in blocks if b.kind == "rest"]
    if rest:
        names = [g for b in rest for g in b.layers]
        weights = float_weights(unet, names)
        rtn_res, init_scales = layer_inits(weights, {g: specs[g] for g in names}, opts, "cpu")
        for b in rest:
            results.append(rest_block_result(b, weights, specs, rtn_res, init_scales))
    for i, r in enumerate(results):
        _log(_fmt(i + 1, len(results), r), log)
    return results
