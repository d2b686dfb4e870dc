"""Held-out comparison of quantized UNets with the float one (float32, TF32 off).

Per UNet: cosine similarity of the outputs (per sample, then mean / min) and normalised
MSE. Per block and UNet:
- `mse`: block-output MSE inside the fully quantized UNet vs the float UNet (the error that
  has accumulated up to and including the block, as the model runs);
- `mse_local`: the quantized block alone, fed the float block's inputs (its own error).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .blocks import Block, CalibSet, build_blocks, first_tensor, unet_forward
from .block_recon import precision


@torch.no_grad()
def compare_unets(fp_unet: nn.Module, variants: dict[str, nn.Module], blocks: Sequence[Block], calib: CalibSet, device,
                  batch: int = 8) -> dict:
    device = torch.device(device)
    units = [u for b in blocks if b.kind != "rest" for u in b.units]
    unit_block = {u.name: b.name for b in blocks if b.kind != "rest" for u in b.units}
    variant_units = {}
    for name, v in variants.items():
        vb = build_blocks(v, [])
        variant_units[name] = {u.name: u for b in vb for u in b.units}
    acc = {name: {b.name: {"sq": 0.0, "sq_local": 0.0} for b in blocks if b.kind != "rest"} for name in variants}
    power = {b.name: 0.0 for b in blocks if b.kind != "rest"}
    count = {b.name: 0 for b in blocks if b.kind != "rest"}
    cos: dict[str, list] = {name: [] for name in variants}
    nmse = {name: [0.0, 0.0] for name in variants}
    n = len(calib)
    with precision(False):
        for start in range(0, n, batch):
            end = min(n, start + batch)
            b_in = calib.batch_kwargs(start, end, device, torch.float32)
            fp_out: dict[str, torch.Tensor] = {}
            pending: dict[str, tuple] = {}
            handles = []

            def pre(u):
                def hook(module, args, kwargs):
                    pending[u.name] = (args, kwargs)
                return hook

            def post(u):
                def hook(module, args, output):
                    t = first_tensor(output).float()
                    fp_out[u.name] = t
                    bname = unit_block[u.name]
                    power[bname] += float((t.double() ** 2).sum())
                    count[bname] += t.numel()
                    a, k = pending.pop(u.name)
                    for vname in variants:
                        o = first_tensor(variant_units[vname][u.name].module(*a, **k)).float()
                        acc[vname][bname]["sq_local"] += float(((o - t).double() ** 2).sum())
                return hook

            for u in units:
                handles.append(fp_unet.get_submodule(u.entry).register_forward_pre_hook(pre(u), with_kwargs=True))
                handles.append(fp_unet.get_submodule(u.exit).register_forward_hook(post(u)))
            try:
                ref = unet_forward(fp_unet, b_in).float()
            finally:
                for h in handles:
                    h.remove()
            for vname, v in variants.items():
                handles = []

                def vpost(u, vname=vname):
                    def hook(module, args, output):
                        t = first_tensor(output).float()
                        acc[vname][unit_block[u.name]]["sq"] += float(((t - fp_out[u.name]).double() ** 2).sum())
                    return hook

                for u in units:
                    handles.append(v.get_submodule(u.exit).register_forward_hook(vpost(u)))
                try:
                    out = unet_forward(v, b_in).float()
                finally:
                    for h in handles:
                        h.remove()
                cos[vname].append(torch.nn.functional.cosine_similarity(out.flatten(1).double(), ref.flatten(1).double(), dim=1))
                nmse[vname][0] += float(((out - ref).double() ** 2).sum())
                nmse[vname][1] += float((ref.double() ** 2).sum())
    result = {"unets": {}, "blocks": {}}
    for vname in variants:
        c = torch.cat(cos[vname])
        result["unets"][vname] = {"cosine_mean": float(c.mean()), "cosine_min": float(c.min()),
                                  "nmse": nmse[vname][0] / max(nmse[vname][1], 1e-30)}
    for bname in power:
        cnt = max(count[bname], 1)
        entry = {"power": power[bname] / cnt}
        for vname in variants:
            entry[vname] = {"mse": acc[vname][bname]["sq"] / cnt, "mse_local": acc[vname][bname]["sq_local"] / cnt}
        result["blocks"][bname] = entry
    result["samples"] = n
    return result
