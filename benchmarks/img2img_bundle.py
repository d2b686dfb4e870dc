#!/usr/bin/env python
"""Image-to-image on an SD-2.1-size phone bundle (issue 64 item 5): an encoder-only export grafted onto a packed
bundle, a picture to start from, and one JSON row from what run-bundle and verify-bundle wrote.

  graft    BUNDLE ENCODER_EXPORT   the export's vae_encoder (file, golden) into BUNDLE, its manifest's pipeline given the
           encode_image stage and the image tasks (the bundle's other stages kept as they are); the manifest is
           replaced, not written through, so a hard-linked copy of a bundle leaves the original alone
  picture  OUT.png W H             a smooth picture (8 x 8 random colours, bilinear) of the bundle's size
  encoder  TFLITE RES --out JSON   one encoder graph alone on the GPU delegate (fp16): compile, runs, memory, finite
  row      --run REPORT [--warm REPORT] [--text REPORT] [--verify JSON] [--encoder768 JSON] --out JSON
           per stage (encoder, text encoder, UNet, decoder) load and run seconds and the memory of its phases, the
           run's host / GPU / host + GPU peaks (at once: polled), against the 4 GB budget; --warm: the same run again
           (programs cached); --text: the bundle's text-to-image run beside it (what the encoder adds)

  python benchmarks/img2img_bundle.py graft /tmp/sd21_bundles/tiny_i2i /tmp/i2i/enc512
  python benchmarks/img2img_bundle.py row --run i2i/report.json --text t2i/report.json --verify v.json --out row.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

BUDGET_MB = 4096.0
TASKS = ["text_to_image", "image_to_image", "inpaint"]


def _replace_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)  # a new inode: a hard-linked original keeps its content


def graft(bundle: Path, export: Path) -> dict:
    from pocketdiff.runtime.pipeline_spec import PIPELINE_SCHEMA_VERSION, derive_pipeline, pipeline_of

    man = json.loads((bundle / "manifest.json").read_text())
    enc = json.loads((export / "manifest.json").read_text())["components"]["vae_encoder"]
    if enc["inputs"][0]["shape"][2:] != [man["image"]["height"], man["image"]["width"]]:
        raise SystemExit(f"graft: the encoder takes {enc['inputs'][0]['shape']}, the bundle's image is "
                         f"{man['image']['height']}x{man['image']['width']}")
    for rel in (enc["path"], enc["golden"]["path"]):
        dst = bundle / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists():
            dst.unlink()
        shutil.copy(export / rel, dst)
    man["components"]["vae_encoder"] = enc
    old = pipeline_of(man)
    stage = next(s for s in derive_pipeline(man, old.get("family", "sd"), tuple(TASKS))["stages"] if s["kind"] == "encode_image")
    stages = [s for s in old["stages"] if s["kind"] != "encode_image"]
    at = next(i for i, s in enumerate(stages) if s["kind"] == "denoise")
    man["pipeline"] = {**old, "tasks": TASKS, "stages": stages[:at] + [stage] + stages[at:]}
    man["schema_version"] = PIPELINE_SCHEMA_VERSION
    _replace_json(bundle / "manifest.json", man)
    return man["pipeline"]


def picture(out: Path, width: int, height: int) -> None:
    import numpy as np
    from PIL import Image

    low = np.random.default_rng(0).uniform(0, 255, (8, 8, 3)).astype(np.uint8)
    Image.fromarray(low).resize((width, height), Image.BILINEAR).save(out)


def encoder(tflite: Path, resolution: int, out: Path, timeout_s: float = 150.0) -> dict:
    """One encoder graph alone on the GPU delegate (fp16): compile, a warm-up and 3 timed runs (outputs read back), its
    measured memory, fully accelerated or not, finite latents; at `resolution` px from a smooth picture."""
    import numpy as np

    from pocketdiff.runtime.delegate import run_on_delegate

    low = np.random.default_rng(0).uniform(0, 1, (8, 8, 3)).astype(np.float32)
    pixels = np.kron(low, np.ones((resolution // 8, resolution // 8, 1), np.float32)).transpose(2, 0, 1)[None].copy()
    r = run_on_delegate(tflite, {"pixels": pixels}, precisions=("fp16",), repeats=3, warmup=1, timeout_s=timeout_s, timed_read=True)
    outs = r.outputs.get("fp16") or []
    res = {"tflite": str(tflite), "resolution": resolution, "bytes": tflite.stat().st_size, "compiled": r.compiled,
           "fully_accelerated": r.fully_accelerated, "driver": r.driver, "adapter": r.adapter, "compile_s": r.compile_s,
           "latency_s": r.latency_s, "memory": r.memory, "finite": bool(outs and all(np.isfinite(o).all() for o in outs)),
           "latent_shape": list(outs[0].shape) if outs else None, "error": r.error or None,
           "rejected": r.rejected_summary() if not r.fully_accelerated else None}
    out.write_text(json.dumps(res, indent=1))
    return res


def _phases(report: dict) -> list[dict]:
    return (report.get("memory") or {}).get("phases") or []


def _stage_rows(report: dict) -> dict:
    """Per model (or whole component, for the sums run-bundle adds): load / run seconds (latency_s), and per model the
    highest host and GPU figures of its memory phases (opened, compiled, settled, first_run, ..., released) and of
    host peak + GPU peak within one phase."""
    lat = report.get("latency_s") or {}
    rows: dict = {}
    for key, v in lat.items():
        for suffix in ("_load", "_run", "_steps", "_step_mean"):
            if key.endswith(suffix):
                rows.setdefault(key[: -len(suffix)], {})[suffix[1:] + "_s"] = v
    for ph in _phases(report):
        r = rows.setdefault(str(ph.get("component")), {})
        r.setdefault("phases", []).append(ph.get("phase"))
        for k in ("host_rss_mb", "host_peak_mb", "gpu_mb", "gpu_peak_mb"):
            if ph.get(k) is not None:
                r[f"max_{k}"] = max(r.get(f"max_{k}", 0.0), float(ph[k]))
        if ph.get("host_peak_mb") is not None and ph.get("gpu_peak_mb") is not None:
            r["max_phase_host_plus_gpu_mb"] = max(r.get("max_phase_host_plus_gpu_mb", 0.0), float(ph["host_peak_mb"]) + float(ph["gpu_peak_mb"]))
    return rows


def _summary(report: dict) -> dict:
    mem = report.get("memory") or {}
    return {"fully_accelerated": report.get("fully_accelerated"),
            "host_peak_mb": report.get("host_peak_mb"), "gpu_peak_mb": report.get("gpu_peak_mb"),
            "host_plus_gpu_peak_mb": report.get("host_plus_gpu_peak_mb"),
            "host_plus_gpu_peak_at_once_mb": mem.get("host_plus_gpu_peak_at_once_mb"),
            "total_s": (report.get("latency_s") or {}).get("total"), "start_s": report.get("start_s"),
            "per_model": _stage_rows(report)}


def _json(path: Path | None):
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def row(run: Path, text: Path | None, verify: Path | None, out: Path, device: str | None, warm: Path | None = None,
        enc768: Path | None = None) -> dict:
    rep = _json(run) or {}  # a launch cut short: the row holds what ran
    res = {"issue": 64, "item": 5, "what": "run-bundle --pipelined --init-image --strength on the SD-2.1-size tiny phone "
           "bundle with a banded SD-2.1-size VAE encoder (random weights, phone profile)", "device": device,
           "strength": rep.get("strength"), "steps_in_bundle": rep.get("steps"), "img2img": _summary(rep) if rep else None}
    once = (res["img2img"] or {}).get("host_plus_gpu_peak_at_once_mb")
    both = (res["img2img"] or {}).get("host_plus_gpu_peak_mb")
    res["budget_mb"] = BUDGET_MB
    res["within_budget_at_once"] = None if once is None else bool(once <= BUDGET_MB)
    res["within_budget_peaks_added"] = None if both is None else bool(both <= BUDGET_MB)
    for key, path in (("img2img_warm", warm), ("text_to_image_warm", text)):
        if _json(path) is not None:
            res[key] = _summary(_json(path))
    if _json(verify) is not None:  # verify-bundle --components vae_encoder: fully accelerated, golden parity on the GPU
        v = _json(verify)
        res["verify_vae_encoder"] = (v.get("components") or {}).get("vae_encoder", v)
    if _json(enc768) is not None:  # the 768 px banded encoder alone (3 bands over 2 blocks)
        res["encoder_768"] = _json(enc768)
    out.write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("graft")
    g.add_argument("bundle", type=Path)
    g.add_argument("export", type=Path)
    p = sub.add_parser("picture")
    p.add_argument("out", type=Path)
    p.add_argument("width", type=int)
    p.add_argument("height", type=int)
    r = sub.add_parser("row")
    r.add_argument("--run", type=Path)
    r.add_argument("--text", type=Path)
    r.add_argument("--verify", type=Path)
    r.add_argument("--warm", type=Path)
    r.add_argument("--encoder768", type=Path)
    r.add_argument("--device")
    e = sub.add_parser("encoder")
    e.add_argument("tflite", type=Path)
    e.add_argument("resolution", type=int)
    e.add_argument("--out", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "graft":
        block = graft(a.bundle, a.export)
        print("graft: stages " + ", ".join(s["stage"] for s in block["stages"]))
    elif a.cmd == "picture":
        picture(a.out, a.width, a.height)
    elif a.cmd == "encoder":
        res = encoder(a.tflite, a.resolution, a.out)
        print(f"encoder {a.resolution} px: compiled {res['compiled']}, fully accelerated {res['fully_accelerated']}, "
              f"compile {res['compile_s']} s, run {res['latency_s']} s, finite {res['finite']}")
    else:
        res = row(a.run, a.text, a.verify, a.out, a.device, a.warm, a.encoder768)
        s = res["img2img"] or {}
        print(f"img2img: {s.get('total_s')} s, host peak {s.get('host_peak_mb')} MB, GPU peak {s.get('gpu_peak_mb')} MB, host + "
              f"GPU at once {s.get('host_plus_gpu_peak_at_once_mb')} MB (budget {BUDGET_MB:.0f}: {res['within_budget_at_once']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
