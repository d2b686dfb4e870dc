#!/usr/bin/env python
"""Image-to-image with the students (issue 64 item 4): held-out emoji re-rendered from their own picture and caption.

The inputs are the first N items of the CLIP's held-out split: `train-clip` holds out the first `holdout` items of
load_captioned_dataset(data) in its seeded order (the CLIP folder's pocketdiff_clip.json names both), the same order
`pocketdiff evaluate` reads with `prompts.from_reference`. Each picture is encoded (the VAE's mean, as the bundle's
encoder gives it), noised to the strength's first timestep with noise seeded seed + i (the same for every model) and
denoised with its caption:

- the teacher: DDIM at --teacher-steps (64) under classifier-free guidance --guidance (3, as the teacher's evals),
  the last int(64 x strength) steps (diffusers' img2img rule);
- the consistency student and its W8 calibration (the `calibrate` output: codes x scales rebuilt by
  load_quantized_pipeline; or any pipeline folder) at --student-steps (2) on the grid's first int(K x strength)
  points (LCMScheduler's img2img rule), w = --guidance through their w embedding.

Per (model, strength): FD on the CLIP's image embeddings (evaluate's MetricSetup with features: clip, torchmetrics'
FrechetInceptionDistance on that feature module) against the teacher's outputs at the same strength and against the
real held-out pictures; CLIP score (torchmetrics CLIPScore, same CLIP) against the captions; and how close each output
stays to its input: PSNR and SSIM (torchmetrics, data range 1) of the 8-bit output against the 8-bit input, per image,
averaged. Writes <out-dir>/img2img_openmoji_<tag>.json and a grid (input | teacher | student | W8, per strength) in
<out-dir>/img2img_openmoji_runs/<tag>_grid.png.

  python benchmarks/img2img_openmoji.py --teacher outputs/teacher-openmoji/pipeline \
      --student outputs/distill-openmoji-lcm/round-0 --w8 outputs/calib-lcm2-w8 --clip outputs/clip-openmoji/clip --n 500
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from _checkout import use_checkout  # noqa: E402

use_checkout()

STRENGTHS = (0.3, 0.5, 0.7)
MODELS = ("teacher", "student", "student_w8")
NOTES = [
    "LPIPS is not reported: torchmetrics' LPIPS needs pretrained AlexNet / VGG and LPIPS linear-layer weights fetched "
    "from the network, and nothing here downloads weights; PSNR and SSIM (torchmetrics) measure closeness to the input.",
    "FD is on the domain CLIP's projected image embeddings (evaluate's features: clip), not Inception: name it FD "
    "(<domain>-CLIP). At a few hundred samples per set it is biased upward; compare rows of equal n only.",
    "fd_vs_teacher64 compares a model's outputs with the teacher's at the same strength (same inputs, captions and "
    "noise); the teacher's own row has none. fd_vs_real compares with the real held-out pictures (the inputs themselves).",
    "The inputs are held out from the CLIP's training only; the teacher (and so the students) trained on every item.",
]


class BenchError(Exception):
    """One line for the user; exit 2."""


# ----------------------------------------------------------------------------- inputs


def _portable(path) -> str:
    """A path as the command line should record it: relative to the working folder when under it, else as given
    unless absolute (then its last two parts), so result files hold no machine paths."""
    text = str(path)
    if text.startswith("pocketdiff:") or not os.path.isabs(text):
        return text
    if Path(text).resolve().is_relative_to(Path.cwd().resolve()):
        return os.path.relpath(text)
    return ".../" + "/".join(Path(text).parts[-2:])


def _folder(value: str, flag: str) -> Path:
    from pocketdiff.shipped import resolve_shipped

    try:
        path = Path(resolve_shipped(value)).expanduser()
    except Exception as e:  # noqa: BLE001 - a missing shipped asset: one line
        raise BenchError(f"{flag}: {e}") from None
    if not path.exists():
        raise BenchError(f"{flag}: {value} does not exist")
    if not path.is_dir():
        raise BenchError(f"{flag}: {value} is not a folder")
    return path


def weights_sha256(folder: Path) -> dict:
    """sha256 of every *.safetensors under `folder` (relative name -> hex), read in 1 MiB pieces; a calibrate output's
    rtn/ baseline, which is not measured, left out."""
    out = {}
    for f in sorted(folder.rglob("*.safetensors")):
        if f.relative_to(folder).parts[0] == "rtn" and (folder / "unet_int8.safetensors").is_file():
            continue
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[f.relative_to(folder).as_posix()] = h.hexdigest()
    return out


def load_models(args, device: torch.device) -> dict:
    """name -> pipeline (fp32, eval, on `device`): the teacher, the student and its W8 calibration."""
    from pocketdiff.compress.quant.calibrate_outputs import UNET_FILE, load_quantized_pipeline
    from pocketdiff.models import load_pipeline

    folders = {"teacher": _folder(args.teacher, "--teacher"), "student": _folder(args.student, "--student"),
               "student_w8": _folder(args.w8, "--w8")}
    pipes = {}
    for name, folder in folders.items():
        flag = "--" + name.replace("student_", "")
        calibrated = name == "student_w8" and (folder / UNET_FILE).is_file()
        if not (folder / "model_index.json").is_file() and not calibrated:
            raise BenchError(f"{flag}: {folder} has no model_index.json (not a pipeline folder"
                             + (f" nor a calibrate output with {UNET_FILE})" if name == "student_w8" else ")"))
        try:
            pipe = load_quantized_pipeline(folder) if calibrated else load_pipeline(str(folder))
        except Exception as e:  # noqa: BLE001 - wrong files: one line naming the folder
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise BenchError(f"{flag}: cannot load {folder}: {why}") from None
        for m in (pipe.unet, pipe.vae, pipe.text_encoder):
            m.to(device=device, dtype=torch.float32).eval().requires_grad_(False)
        pipes[name] = pipe
    return pipes, folders


def held_out_items(clip, args, resolution: int):
    """(pictures uint8 [N, 3, R, R], captions, data description): the first N items of the CLIP's held-out split."""
    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captioned_dataset
    from pocketdiff.evaluate.metrics import dataset_fingerprint, describe_data, iter_reference_batches

    meta = clip.meta or {}
    data = dict(meta.get("data") or {})
    if args.source:
        data = {"source": args.source, "seed": 0}
    if not data:
        raise BenchError(f"--clip: {args.clip} has no pocketdiff_clip.json naming its data (a train-clip folder): pass --source")
    data.update(resolution=resolution, max_samples=args.n)  # the seeded order's first N (nothing past them decoded)
    cfg = DataConfig(**{k: v for k, v in data.items() if k in DataConfig.__dataclass_fields__})
    try:
        ds = load_captioned_dataset(cfg)
    except Exception as e:  # noqa: BLE001 - missing data: one line naming it
        raise BenchError(f"data: {e}") from None
    if args.n > len(ds):
        raise BenchError(f"--n: {args.n} items asked, the data set has {len(ds)}")
    pictures, captions = next(iter_reference_batches(ds, args.n))
    holdout = meta.get("holdout")
    info = {"data": describe_data(cfg), "items": f"0..{args.n - 1} of the seeded order", "clip_holdout": holdout,
            "data_sha256": dataset_fingerprint(ds)}
    if holdout is not None and args.n > int(holdout):
        info["warning"] = f"{args.n - int(holdout)} of the {args.n} items are past the CLIP's {holdout} held-out ones"
    return pictures, list(captions), info


# ----------------------------------------------------------------------------- sampling


def _sampler(pipe) -> str:
    from pocketdiff.consistency_sampling import is_consistency_scheduler

    return "consistency" if is_consistency_scheduler(pipe.scheduler) else "ddim"


@torch.no_grad()
def render(pipe, pictures: torch.Tensor, captions: list[str], strength: float, steps: int, guidance: float, seed: int,
           start: int) -> torch.Tensor:
    """One batch re-rendered: uint8 [B, 3, R, R]; item j's noise seeded seed + start + j (the same for every model)."""
    from pocketdiff.conditioning import encode_conditioning, encode_unconditional
    from pocketdiff.evaluate.generation import unet_takes_w
    from pocketdiff.evaluate.metrics import to_uint8
    from pocketdiff.sampling import ImageInput, consistency_sample, ddim_sample, decode_latents, encode_images, randn_latents

    device = next(pipe.unet.parameters()).device
    lat = encode_images(pipe.vae, pictures.float().div(255).to(device))
    gens = [torch.Generator("cpu").manual_seed(seed + start + j) for j in range(len(captions))]
    noise = randn_latents(tuple(lat.shape), gens, device)
    cond = encode_conditioning(pipe, captions, device)
    image = ImageInput(lat, strength)
    if _sampler(pipe) == "consistency":
        out = consistency_sample(pipe.unet, pipe.scheduler, cond, noise, steps, guidance, gens, image=image)
    else:
        plain = unet_takes_w(pipe.unet) or guidance == 1.0  # a w-conditioned UNet takes w itself: no cfg pair
        uncond = None if plain else encode_unconditional(pipe, [""] * len(captions), device)
        out = ddim_sample(pipe.unet, pipe.scheduler, cond, uncond, steps=steps, guidance_scale=guidance, latents=noise, image=image)
    return to_uint8(decode_latents(pipe.vae, out))


def render_all(pipes: dict, pictures, captions, args, bar) -> tuple[dict, dict]:
    """(outputs[(model, strength)] uint8 [N, 3, R, R], seconds per image[(model, strength)])."""
    outputs, seconds = {}, {}
    for name in MODELS:
        steps = args.teacher_steps if name == "teacher" else args.student_steps
        for s in args.strengths:
            parts, t0 = [], time.perf_counter()
            for start in range(0, len(captions), args.batch_size):
                end = min(len(captions), start + args.batch_size)
                try:
                    parts.append(render(pipes[name], pictures[start:end], captions[start:end], s, steps, args.guidance,
                                        args.seed, start))
                except Exception as e:  # noqa: BLE001 - a strength that leaves no step, a wrong model: one line
                    if type(e).__name__ != "PocketdiffError":
                        raise
                    raise BenchError(f"{name} at strength {s}, {steps} steps: {e}") from None
                bar.update(end - start)
            outputs[(name, s)] = torch.cat(parts)
            seconds[(name, s)] = (time.perf_counter() - t0) / len(captions)
    return outputs, seconds


# ----------------------------------------------------------------------------- metrics


def closeness(out: torch.Tensor, pictures: torch.Tensor) -> tuple[float, float]:
    """(mean per-image PSNR dB, SSIM) of uint8 outputs against the uint8 inputs, data range 1 (torchmetrics)."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    a, b = out.float() / 255, pictures.float() / 255
    psnr = peak_signal_noise_ratio(a, b, data_range=1.0, reduction="none", dim=(1, 2, 3))
    ssim = structural_similarity_index_measure(a, b, data_range=1.0)
    return float(psnr.mean()), float(ssim)


def measure(setup, outputs: dict, seconds: dict, pictures, captions, args) -> list[dict]:
    rows = []
    for (name, s), out in outputs.items():
        psnr, ssim = closeness(out, pictures)
        teacher = outputs[("teacher", s)]
        rows.append({
            "model": name, "steps": args.teacher_steps if name == "teacher" else args.student_steps, "strength": s,
            "fd_vs_teacher64": None if name == "teacher" else setup.fd_between(out, teacher),
            "fd_vs_real": setup.fd_between(out, pictures),
            "clip_score": setup.clip_score(out, captions),
            "psnr_to_input": psnr, "ssim_to_input": ssim, "n": len(out),
            "seconds_per_image": round(seconds[(name, s)], 4),
        })
    return rows


def references(setup, pipes, pictures, captions) -> dict:
    """What the rows compare with: the real pictures' CLIP score and the teacher's VAE round trip (encode, decode: the
    closest any output can stay to its input)."""
    from pocketdiff.evaluate.metrics import to_uint8
    from pocketdiff.sampling import decode_latents, encode_images

    vae = pipes["teacher"].vae
    device = next(vae.parameters()).device
    with torch.no_grad():
        trip = torch.cat([to_uint8(decode_latents(vae, encode_images(vae, pictures[i:i + 64].float().div(255).to(device))))
                          for i in range(0, len(pictures), 64)])
    psnr, ssim = closeness(trip, pictures)
    return {"clip_score_real": setup.clip_score(pictures, captions), "vae_roundtrip_psnr": psnr, "vae_roundtrip_ssim": ssim}


# ----------------------------------------------------------------------------- outputs


def write_grid(path: Path, outputs: dict, pictures, strengths, rows: int = 4, scale: int = 2) -> None:
    """Per strength a labelled block: one row per item, columns input | teacher | student | W8."""
    from PIL import Image, ImageDraw

    k = min(rows, len(pictures))
    side = pictures.shape[-1] * scale
    label_h = 14
    header = ["input", *MODELS]
    width, height = side * len(header), label_h + len(strengths) * (label_h + k * side)
    grid = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(grid)
    for c, text in enumerate(header):
        draw.text((c * side + 3, 1), text.replace("student_w8", "W8"), fill="black")
    y = label_h
    for s in strengths:
        draw.text((3, y + 1), f"strength {s}", fill="black")
        y += label_h
        for i in range(k):
            cells = [pictures[i], *(outputs[(m, s)][i] for m in MODELS)]
            for c, cell in enumerate(cells):
                tile = Image.fromarray(cell.permute(1, 2, 0).numpy()).resize((side, side), Image.NEAREST)
                grid.paste(tile, (c * side, y))
            y += side
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)


def provenance(args, folders: dict, clip_folder: Path, device: torch.device) -> dict:
    import diffusers
    import torchmetrics

    argv = [_portable(a) for a in args.argv]
    return {
        "command": " ".join(["python", "benchmarks/img2img_openmoji.py", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__, "diffusers": diffusers.__version__, "torchmetrics": torchmetrics.__version__,
        "device": str(device), "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "folders": {name: {"path": _portable(folder), "weights_sha256": weights_sha256(folder)}
                    for name, folder in {**folders, "clip": clip_folder}.items()},
    }


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="the teacher's pipeline folder (pocketdiff train-teacher's pipeline/)")
    p.add_argument("--student", required=True, help="the consistency student's pipeline folder (LCMScheduler)")
    p.add_argument("--w8", required=True, help="the student's `pocketdiff calibrate` output folder (or a pipeline folder)")
    p.add_argument("--clip", required=True, help="the domain CLIP folder (pocketdiff train-clip's clip/)")
    p.add_argument("--n", type=int, default=512, help="held-out items re-rendered (default 512)")
    p.add_argument("--strengths", type=float, nargs="+", default=list(STRENGTHS))
    p.add_argument("--teacher-steps", type=int, default=64)
    p.add_argument("--student-steps", type=int, default=2)
    p.add_argument("--guidance", type=float, default=3.0, help="the teacher's cfg scale and the students' w (default 3)")
    p.add_argument("--source", default=None, help="data source instead of the CLIP's pocketdiff_clip.json data (seed 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="file name tag (default: the device type, e.g. cpu)")
    p.add_argument("--grid-rows", type=int, default=4)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.n < 2:
        p.error("--n must be >= 2 (FD needs two images per set)")
    if any(not 0 < s <= 1 for s in args.strengths):
        p.error(f"--strengths must be in (0, 1], got {args.strengths}")
    if args.teacher_steps < 1 or args.student_steps < 1 or args.batch_size < 1:
        p.error("--teacher-steps, --student-steps and --batch-size must be >= 1")
    return args


def run(args) -> dict:
    from tqdm.auto import tqdm

    from pocketdiff.device import resolve_device
    from pocketdiff.evaluate.metrics import MetricConfig, MetricSetup
    from pocketdiff.models import vae_scale_factor
    from pocketdiff.outputs import write_json

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device, "--device")
    clip_folder = _folder(args.clip, "--clip")
    pipes, folders = load_models(args, device)
    teacher = pipes["teacher"]
    resolution = int(teacher.unet.config.sample_size) * vae_scale_factor(teacher.vae)
    setup = MetricSetup(MetricConfig(features="clip", clip=str(clip_folder), reference_clip_samples=0), None, device)
    pictures, captions, data = held_out_items(setup.clip, args, resolution)
    total = len(MODELS) * len(args.strengths) * len(captions)
    with tqdm(total=total, desc="img2img", unit="img", dynamic_ncols=True) as bar:
        outputs, seconds = render_all(pipes, pictures, captions, args, bar)
    rows = measure(setup, outputs, seconds, pictures, captions, args)
    tag = args.tag or device.type
    out_dir = Path(args.out_dir)
    grid = out_dir / "img2img_openmoji_runs" / f"{tag}_grid.png"
    write_grid(grid, outputs, pictures, args.strengths, args.grid_rows)
    result = {
        "what": "held-out emoji re-rendered from their picture and caption (issue 64 item 4)",
        "rows": rows,
        "reference": references(setup, pipes, pictures, captions),
        "metrics": {"fd": setup.fd_label, "fd_feature_dim": setup.feature_dim, "clip_score": setup.clip_label,
                    "psnr_ssim": "torchmetrics, 8-bit output vs 8-bit input, data range 1, PSNR averaged per image"},
        "samplers": {name: {"sampler": _sampler(p), "steps": args.teacher_steps if name == "teacher" else args.student_steps,
                            "guidance": args.guidance} for name, p in pipes.items()},
        "data": data, "resolution": resolution, "seed": args.seed, "grid": grid.relative_to(out_dir).as_posix(),
        "notes": NOTES, "provenance": provenance(args, folders, clip_folder, device),
    }
    path = out_dir / f"img2img_openmoji_{tag}.json"
    write_json(path, result)
    print(f"img2img_openmoji: wrote {path} and {grid}", file=sys.stderr)
    return result


def main(argv=None) -> int:
    args = parse(argv)
    from pocketdiff.errors import PocketdiffError

    try:
        run(args)
    except (BenchError, PocketdiffError) as e:
        print(f"img2img_openmoji: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
