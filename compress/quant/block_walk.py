"""What every block's reconstruction shares (the walk over the blocks): the cache budget and where the
block caches live, the progress bar and peak meter (`Walk`), the float weights read from the module,
and the independent mode on one device. `reconstruct` drives it; `reconstruct_devices` runs it in one
worker process per device."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError

from .block_recon import (DTYPES, BlockResult, ReconConfig, capture_settings, precision, reconstruct_block,
                          rest_block_result)
from .blocks import Block, Captured, Request, capture, group_by_budget
from .cache_store import HostCache, release


def cache_budget(opts: ReconConfig, device) -> float:
    if opts.cache_budget_gb is not None:
        return opts.cache_budget_gb * 2 ** 30
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return 0.4 * free
    return 4 * 2 ** 30


class Walk:
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
                empty_device_cache(self.device)
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
            empty_device_cache(self.device)
        self.done += 1
        self.emit(format_block(self.done, self.total, res))
        self.bar.update(1)
        return res

    def close(self) -> None:
        self._fold()
        self.bar.close()


def log_line(msg: str, log: Optional[Callable[[str], None]]) -> None:
    if log is not None:
        log(msg)


def format_block(block_idx: int, total: int, res: BlockResult) -> str:
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


def fisher_for(block: Block, fisher):
    if fisher is None:
        return None
    return [fisher.get(u.name) for u in block.units]


def cache_stores(opts: ReconConfig, per_sample, n, device, host: HostCache, input_copies: int = 1):
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


def span(group: Sequence[Block]) -> str:
    return group[0].name if len(group) == 1 else f"blocks {group[0].name} .. {group[-1].name}"


def run_independent(unet, calib, blocks, per_sample, weights, specs, rtn_res, init_scales, opts, device, seed, fisher, walk,
                     host: Optional[HostCache] = None):
    store_dtype = DTYPES[opts.cache_dtype]
    tf32, cap_ac = capture_settings(opts, device)
    n = len(calib)
    budget, store, folder = cache_stores(opts, per_sample, n, device, host or HostCache())
    results = []
    real = [b for b in blocks if b.kind != "rest"]
    for group in group_by_budget(real, per_sample, n, budget, ("in", "out")):
        reqs = [Request(u, inputs=True, output=True) for b in group for u in b.units]
        caps = capture_group(walk, unet, calib, reqs, (store, store_dtype, cap_ac, folder), span(group), opts, device, tf32)
        for b, mine in per_block(group, caps):
            res = walk.block(b, mine, [c.output for c in mine], weights=weights, specs=specs, rtn_res=rtn_res,
                             init_scales=init_scales, fisher=fisher_for(b, fisher), seed=seed + b.order,
                             move_module=opts.stream)
            results.append(res)
            free_captures(mine)
            del mine
        del caps
        empty_device_cache(device)
    for b in blocks:
        if b.kind == "rest":
            results.append(rest_block_result(b, weights, specs, rtn_res, init_scales))
    return results


def capture_group(walk, unet, calib, reqs, stores: tuple, what: str, opts: ReconConfig, device, tf32) -> list:
    """One group's captures (`stores`: store, store dtype, capture autocast, folder). Streamed, the UNet is on
    the device only while it is captured: the block being reconstructed alone comes back after."""
    if opts.stream:
        unet.to(device)
    with precision(tf32):
        caps = walk.capture(unet, calib, reqs, *stores, what)
    if opts.stream:
        unet.to("cpu")
        empty_device_cache(device)
    return caps


def per_block(group: Sequence[Block], caps: list):
    """(block, its captures) for each block of a group, in order; once the caller is done with a block, its
    slots in `caps` are cleared, so its cache goes then, not with its group."""
    k = 0
    for b in group:
        nu = len(b.units)
        yield b, caps[k:k + nu]
        caps[k:k + nu] = [None] * nu
        k += nu


def free_captures(caps: Sequence[Captured]) -> None:
    """Close the disk files of these captures (memory goes with the last reference)."""
    for c in caps:
        release([*c.leaves, c.output])


def empty_device_cache(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
