"""Independent-mode reconstruction over several devices: blocks assigned to one worker process per
device (longest processing time first); each worker rebuilds the UNet from its config and state and
reconstructs its blocks on its own; the results come back in block order."""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Optional, Sequence

import torch

from pocketdiff.device import cap_cuda_memory
from pocketdiff.errors import PocketdiffError

from .block_recon import BlockResult, LayerResult, ReconConfig, layer_inits, rest_block_result
from .block_walk import Walk, float_weights, format_block, log_line, run_independent
from .blocks import Block, CalibSet, build_blocks, order_blocks


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

        walk = Walk(torch.device(device), opts, cap, needs or {}, len(mine), log, bar=False)  # no bars from several processes
        results = run_independent(unet, calib, mine, per_sample, weights, my_specs, rtn_res, init_scales, opts, device, seed,
                                   fisher, walk)
        walk.close()
        torch.save({"results": [dataclasses.asdict(r) for r in results]}, out_path)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        Path(out_path + ".err").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}", encoding="utf-8")
        raise SystemExit(1)


def run_parallel(unet, calib, blocks, specs, opts, devices, skip, seed, fisher, log, cap=None, needs=None) -> list[BlockResult]:
    import torch.multiprocessing as mp

    per_sample = order_blocks(unet, blocks, calib, next(unet.parameters()).device)
    real = [b for b in blocks if b.kind != "rest"]
    parts = split_blocks(real, per_sample, len(devices))
    log_line(f"independent mode on {len(devices)} devices: " + ", ".join(f"{d}: {len(p)} blocks" for d, p in zip(devices, parts)), log)
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
        log_line(format_block(i + 1, len(results), r), log)
    return results
