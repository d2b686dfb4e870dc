"""A `pocketdiff calibrate` output folder made small enough to come back from a GPU call ($OUT: 64 MiB in all), and
made whole again here (sdxl_openmoji.sh: the W8 students travel to the 2-core box, whose export has litert-torch).

    python3 scripts/gpu/w8_carry.py slim W8_FOLDER DEST     # there: DEST is W8_FOLDER, smaller
    python3 scripts/gpu/w8_carry.py link DIR                  # there: equal files under DIR hard-linked (tar keeps one)
    python3 scripts/gpu/w8_carry.py restore DEST             # here: DEST/pipeline/unet as calibrate wrote it

`slim`: the folder without its RTN twin and pictures; in pipeline/unet every tensor that the int8 checkpoint
(unet_int8.safetensors: codes, scales and the UNet's other tensors) holds is written as zeros (they are codes x
scales, rebuilt by `restore`; zeros pack to almost nothing), and the other float tensors of pipeline/ (text encoders,
VAE, the UNet's tensors the checkpoint lacks) in float16. The checkpoint itself is kept as calibrated.
`restore`: pipeline/unet's weights rebuilt from the checkpoint (compress.quant.load_quantized_pipeline),
saved in float32; the float16 components load as float32 (pocketdiff.models.load_pipeline).
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

SKIP = ("rtn", "*.png", "index.html", "checkpoints")


def _checkpoint_keys(folder: Path) -> set[str]:
    from pocketdiff.compress.quant.calibrate_outputs import UNET_FILE
    from pocketdiff.compress.quant.int8_format import dequantized_state_dict, load_quantized

    state, recipe = load_quantized(folder / UNET_FILE)
    return set(dequantized_state_dict(state, recipe))


def slim(src: Path, dst: Path) -> Path:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    rebuilt = _checkpoint_keys(src)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*SKIP))
    for f in sorted((dst / "pipeline").rglob("*.safetensors")):
        in_unet = f.parent.name == "unet"
        with safe_open(f, "pt") as g:
            meta, tensors = g.metadata(), {k: g.get_tensor(k) for k in g.keys()}
        out = {}
        for k, v in tensors.items():
            if in_unet and k in rebuilt:
                out[k] = torch.zeros_like(v, dtype=torch.float16)
            else:
                out[k] = v.half() if v.is_floating_point() else v
        save_file(out, f, metadata=meta)
    return dst


def link(root: Path) -> int:
    """Hard-link the files under `root` that are byte-equal (the students' VAE and text encoders, all the teacher's):
    tar stores a link once. Returns the bytes saved."""
    import hashlib
    import os

    first: dict[tuple[int, str], Path] = {}
    saved = 0
    for f in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        key = (f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest())
        if key in first and not f.samefile(first[key]):
            f.unlink()
            os.link(first[key], f)
            saved += key[0]
        first.setdefault(key, f)
    return saved


def restore(folder: Path) -> Path:
    from pocketdiff.compress.quant.calibrate_outputs import load_quantized_pipeline

    pipe = load_quantized_pipeline(folder)
    pipe.unet.to(dtype=__import__("torch").float32).save_pretrained(folder / "pipeline" / "unet")
    return folder


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slim")
    s.add_argument("src", type=Path)
    s.add_argument("dst", type=Path)
    sub.add_parser("link").add_argument("root", type=Path)
    r = sub.add_parser("restore")
    r.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "slim":
        print(slim(args.src, args.dst))
    elif args.cmd == "link":
        print(f"{link(args.root)} bytes linked")
    else:
        print(restore(args.folder))


if __name__ == "__main__":
    main()
