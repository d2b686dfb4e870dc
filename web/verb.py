"""`pocketdiff web BUNDLE`: write BUNDLE/web/ (the page), optionally check it in headless Chromium.

    pocketdiff web runs/bundle                      # page + reference (run-bundle's image, seed 0)
    pocketdiff web runs/bundle --check --screenshot shot.png
    pocketdiff web runs/bundle --check --init-image in.png --mask mask.png --strength 0.75   # the page from a picture
    pocketdiff web runs/bundle --check --lora style.safetensors --lora-scale 0.8             # a slotted bundle's LoRA
    pocketdiff serve runs/bundle --port 8000        # then open http://localhost:8000/

--check serves the bundle on a free local port, opens `index.html?check=1` in headless
Chromium (WebGPU on SwiftShader where there is no GPU), waits for the page's POSTed JSON,
writes it to BUNDLE/web/check.json and fails (exit 2) when any check failed.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pocketdiff.errors import ParityError, PocketdiffError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder made by `pocketdiff export`")
    p.add_argument("--prompt", default=None, help="reference prompt (default: the manifest's golden prompt)")
    p.add_argument("--seed", type=int, default=0, help="reference seed (numpy's latents, as run-bundle draws them)")
    p.add_argument("--no-reference", action="store_true", help="no reference/ folder (the check mode then skips the image check)")
    p.add_argument("--reference-accelerator", choices=["cpu", "gpu"], default="cpu", help="run-bundle's accelerator for the reference image")
    p.add_argument("--litertjs", default=None, help="folder with @litertjs core/ and wasm-utils/ (default: web/node_modules/@litertjs from setup)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing BUNDLE/web")
    p.add_argument("--check", action="store_true", help="run the page's check mode in headless Chromium")
    p.add_argument("--accelerator", choices=["webgpu", "wasm"], default="webgpu", help="--check: what the page runs on")
    p.add_argument("--screenshot", default=None, metavar="PNG", help="--check: save a screenshot of the page")
    p.add_argument("--timeout", type=float, default=600.0, help="--check: seconds to wait for the page's report")
    # the reference (and --check's run) from a picture or with a LoRA, as run-bundle's flags make it; the page itself picks
    # pictures and LoRAs at run time: these only choose what its check mode compares with
    p.add_argument("--init-image", default=None, metavar="PATH", help="the reference is run-bundle's image-to-image run from this "
                   "picture (copied to reference/; --check opens the page with it); needs a bundle with an image encoder")
    p.add_argument("--mask", default=None, metavar="PATH", help="with --init-image: inpainting (white = repaint, the picture's size)")
    p.add_argument("--strength", type=float, default=None, metavar="S", help="with --init-image: as run-bundle's --strength")
    p.add_argument("--lora", default=None, metavar="FILE", help="the reference with this LoRA fed to the bundle's slots "
                   "(a .safetensors; copied to reference/; --check feeds the page the same)")
    p.add_argument("--lora-scale", type=float, default=None, metavar="S", help="with --lora: as run-bundle's --lora-scale (default 1)")
    p.add_argument("--debug", action="store_true")


def check_params(ref: dict) -> dict:
    """The check mode's URL parameters for a reference made from a picture and/or with a LoRA (its files under
    reference/): the page then runs what run-bundle ran."""
    params = {}
    if ref.get("init_image"):
        params.update(init_image=f"reference/{ref['init_image']}", strength=ref["strength"])
        if ref.get("mask"):
            params["mask"] = f"reference/{ref['mask']}"
    if ref.get("lora"):
        params.update(lora=f"reference/{ref['lora']}", lora_scale=ref["lora_scale"])
    return params


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder with web/ (pocketdiff web BUNDLE)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on: 127.0.0.1 (this machine only; a phone through adb reverse) "
                   "or 0.0.0.0 (every machine that reaches this one can read the bundle and its page)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 1 to 65535 (0: any free one)")
    p.add_argument("--https", action="store_true", help="TLS with a self-signed certificate kept in the user's config folder "
                   "($XDG_CONFIG_HOME/pocketdiff/serve-cert; WebGPU needs a secure context off localhost)")
    p.add_argument("--cert", default=None, metavar="PEM", help="--https with this certificate (with --key) instead of the generated one")
    p.add_argument("--key", default=None, metavar="PEM", help="the private key of --cert")
    p.add_argument("--reports", default=None, metavar="DIR", help="take the page's check reports (POST /report/NAME, JSON) "
                   "and write them into DIR (outside the bundle); off unless given")
    p.add_argument("--debug", action="store_true")


def summarize(result: dict) -> str:
    lines = []
    for name, c in (result.get("components") or {}).items():
        g = c.get("golden") or {}
        cos = f"cos {g['cosine']:.6f} PSNR {g['psnr_db']:.1f} dB" if g.get("cosine") is not None else g.get("skipped", "")
        lines.append(f"  {name:13s} {c['accelerator']:6s} fully accelerated: {c['fully_accelerated']}  compile {c['compile_ms']:.0f} ms  run {c['run_ms']:.0f} ms  golden {cos}")
    img = result.get("image") or {}
    if "psnr_db" in img:
        lines.append(f"  image vs run-bundle: {img['psnr_db']:.1f} dB (min {img['min_psnr_db']})")
    lat = result.get("latency_ms") or {}
    if lat:
        lines.append(f"  page load {lat.get('page_load') or 0:.0f} ms, LiteRT.js ready {lat.get('runtime_ready') or 0:.0f} ms, "
                     f"UNet {lat.get('unet_step_mean_ms') or 0:.0f} ms/step, total {lat.get('total_ms') or 0:.0f} ms")
    return "\n".join(lines)


def main(args) -> int:
    from pocketdiff.runtime.cli_checks import check_web_flags

    from .page import PageConfig, write_page

    check_web_flags(args)  # before the page folder is touched
    t0 = time.perf_counter()
    picked = [f for f, v in (("--init-image", args.init_image), ("--lora", args.lora)) if v is not None]
    if args.no_reference and picked:
        raise PocketdiffError(f"{picked[0]} makes the reference: drop --no-reference, or drop {picked[0]}")
    cfg = PageConfig(bundle=args.bundle, reference=not args.no_reference, prompt=args.prompt, seed=args.seed,
                     reference_accelerator=args.reference_accelerator, litertjs=args.litertjs, overwrite=args.overwrite,
                     init_image=args.init_image, mask=args.mask, strength=args.strength, lora=args.lora,
                     lora_scale=args.lora_scale)
    info = write_page(cfg)
    web = Path(args.bundle) / "web"
    ref = info["reference"]
    print(f"wrote {web}/index.html ({time.perf_counter() - t0:.1f} s"
          + (f"; reference: {ref['prompt']!r} seed {ref['seed']} by run-bundle on {ref['made_by']['accelerator']})" if ref else ")"))
    if not args.check:
        print(f"serve it: pocketdiff serve {args.bundle}   (then open http://localhost:8000/)")
        return 0
    from .headless import check_page, find_chromium

    if find_chromium() is None:
        raise PocketdiffError("--check needs Chromium: apt-get install chromium (scripts/setup.sh does), or set POCKETDIFF_CHROMIUM")
    t1 = time.perf_counter()
    result = check_page(args.bundle, prompt=ref["prompt"] if ref else None, seed=ref["seed"] if ref else None,
                        timeout_s=args.timeout, screenshot=args.screenshot, accelerator=args.accelerator,
                        **(check_params(ref) if ref else {}))
    (web / "check.json").write_text(json.dumps(result, indent=1))
    print(f"check in headless Chromium ({time.perf_counter() - t1:.1f} s): {'ok' if result.get('ok') else 'FAILED'}\n{summarize(result)}")
    if args.screenshot:
        print(f"screenshot: {args.screenshot}")
    if not result.get("ok"):
        raise ParityError(f"web check of {args.bundle}: " + "; ".join(result.get("failures") or [result.get("error", "no result")]))
    return 0
