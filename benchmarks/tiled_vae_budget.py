"""Activations of a VAE decoder's tiled up path (export/tiled_vae.VaeUpPathTile) per tile size,
against the phone device profile: the largest tensor and the heaviest conv (input + output),
at fp16. Shapes only (meta tensors): no weights, no compute, seconds for SD-2.1 size.

    python benchmarks/tiled_vae_budget.py --arch sd21 --resolution 512 --tiles 64 32 16 8

The numbers behind `vae_tiling` in configs/sd21/export*.yaml (tile 32: 32 MB largest tensor,
up_blocks.2's upsampler conv at 256 x 256 x 256, vs 128 MB for the whole 64 x 64 latent).
"""
from __future__ import annotations

import argparse
import json

import torch
from diffusers import AutoencoderKL


def up_path_memory(vae, tile: int, activation_bytes: int = 2) -> dict:
    from pocketdiff.export.tiled_vae import VaeUpPathTile

    up = VaeUpPathTile(vae, tile).to("meta").eval()
    largest, heaviest = [0, ""], [0, ""]

    def hook(module, inputs, output, name):
        outs = [t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)]
        n_out = max(t.numel() for t in outs)
        if n_out > largest[0]:
            largest[:] = [n_out, f"{name} {list(outs[0].shape)}"]
        if isinstance(module, torch.nn.Conv2d):
            n = sum(t.numel() for t in inputs if isinstance(t, torch.Tensor)) + n_out
            if n > heaviest[0]:
                heaviest[:] = [n, f"{name} {list(inputs[0].shape)} -> {list(outs[0].shape)}"]

    hooks = [m.register_forward_hook(lambda m, i, o, n=n: hook(m, i, o, n))
             for n, m in up.named_modules() if not list(m.children())]
    F = vae.config.block_out_channels[-1]
    meta = {"device": "meta"}
    with torch.no_grad():
        up(torch.empty(1, F, tile, tile, **meta), torch.empty(tile, tile, **meta),
           torch.empty(up.num_norms, 2, up.groups, **meta), torch.empty(1, **meta))
    for h in hooks:
        h.remove()
    mb = activation_bytes / 2**20
    return {"tile": tile, "largest_tensor_mb": largest[0] * mb, "largest_tensor": largest[1],
            "heaviest_conv_mb": heaviest[0] * mb, "heaviest_conv": heaviest[1]}


def main() -> None:
    from pocketdiff.export.device_profile import PROFILES
    from pocketdiff.models import vae_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sd21")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--tiles", type=int, nargs="+", default=[64, 32, 16, 8])
    args = p.parse_args()
    with torch.device("meta"):
        vae = AutoencoderKL(**vae_config(args.arch, args.resolution))
    rows = [up_path_memory(vae, t) for t in args.tiles]
    print(json.dumps({"arch": args.arch, "resolution": args.resolution, "phone": PROFILES["phone"], "tiles": rows}, indent=1))


if __name__ == "__main__":
    main()
