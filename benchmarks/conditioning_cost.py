#!/usr/bin/env python
"""What a prompt-dependent added embedding costs in the UNet graph (issue 61 item 2), on the GPU delegate.

An SDXL-style UNet (`addition_embed_type: text_time`) adds, to the timestep's embedding, an MLP of the prompt's
pooled embedding and six size / crop time ids; the bundle computes it inside the UNet graph (runtime/BUNDLE.md).
This measures that part alone, as the UNet builds it (diffusers' `Timesteps` of the ids, concat with the pooled
embedding, `TimestepEmbedding` to the time-embedding width, added to the fed table row), at the widths of SD 2.1
(pooled 1024, time embedding 1280: 1024 + 6 x 256 = 2560 -> 1280 -> 1280) and of SDXL (1280 pooled: 2816 -> 1280
-> 1280), at guidance batch 2, against one UNet step of an SD-2.1-size bundle (every UNet graph of it, each run on
random inputs of its declared shapes) in the same process tree; each timed run includes reading its outputs back
(a GPU run may return on submission). Run as a separate graph it also pays one dispatch
and its input copies: an upper bound of what the same layers cost inside the UNet graph.

  here:  python benchmarks/conditioning_cost.py export DEST          (two .tflite files, tiled weights, xz-packed)
  there: python benchmarks/conditioning_cost.py measure DEST BUNDLE --out result.json [--repeats 50]
"""
from __future__ import annotations

import argparse
import json
import lzma
import platform
import shutil
import tempfile
import sys
import time
from pathlib import Path

import numpy as np

WIDTHS = {  # name -> (pooled width, time-embedding width); six time ids of 256 sinusoid channels each
    "sd21_width": (1024, 1280),
    "sdxl_width": (1280, 1280),
}
TIME_ID_CHANNELS = 256
BATCH = 2  # classifier-free guidance batch


def added_embedding_module(pooled: int, width: int, time_channels: int = TIME_ID_CHANNELS):
    """The text_time added embedding of diffusers' UNet2DConditionModel, as a graph of (row, text_embeds, time_ids):
    the fed table row plus the MLP (module names as the UNet's, so a UNet's state loads into it)."""
    import torch
    from diffusers.models.embeddings import TimestepEmbedding, Timesteps

    class AddedEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.add_time_proj = Timesteps(time_channels, True, 0)
            self.add_embedding = TimestepEmbedding(pooled + 6 * time_channels, width)

        def forward(self, row, text_embeds, time_ids):
            ids = self.add_time_proj(time_ids.flatten()).reshape(text_embeds.shape[0], -1)
            return row + self.add_embedding(torch.cat([text_embeds, ids.to(text_embeds.dtype)], dim=-1))

    return AddedEmbedding().eval()


def sample_inputs(pooled: int, width: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[768.0, 768.0, 0.0, 0.0, 768.0, 768.0]] * BATCH)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, pooled, generator=g), ids


def export(dest: Path, widths: dict = WIDTHS) -> dict:
    """Each of `widths` (name -> (pooled width, time-embedding width)) converted, xz-packed with its golden; export.json
    lists them (what `measure` runs)."""
    import torch

    from pocketdiff.export.convert import to_tflite
    from pocketdiff.export.synthetic import fill_tiled

    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (pooled, width) in widths.items():
        module = added_embedding_module(pooled, width)
        fill_tiled(module, seed=7, init="default")
        inputs = sample_inputs(pooled, width)
        path = dest / f"{name}.tflite"
        convert_s = to_tflite(module, inputs, path)
        with torch.no_grad():
            ref = module(*inputs).numpy()
        np.savez(dest / f"{name}.golden.npz", *[t.numpy() for t in inputs], out=ref)
        with open(path, "rb") as f, lzma.open(f"{path}.xz", "wb", preset=6) as g:
            shutil.copyfileobj(f, g)
        params = sum(p.numel() for p in module.parameters())
        out[name] = {"params": params, "tflite_bytes": path.stat().st_size, "convert_s": round(convert_s, 1)}
        path.unlink()
    (dest / "export.json").write_text(json.dumps(out, indent=1))
    return out


def _unpacked(src: Path, work: Path, name: str) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{name}.tflite"
    with lzma.open(src / f"{name}.tflite.xz", "rb") as f, open(path, "wb") as g:
        shutil.copyfileobj(f, g)
    return path


def _random_feeds(path: Path) -> dict[str, np.ndarray]:
    """Random inputs of a graph's declared shapes, by name (latency does not depend on the values)."""
    from pocketdiff.runtime.manifest_check import tflite_io

    rng = np.random.default_rng(0)
    feeds = {}
    for spec in tflite_io(path)["inputs"]:
        dtype = np.dtype(spec.get("dtype", "float32"))
        if dtype.kind in "iu":
            feeds[spec["name"]] = rng.integers(0, 1000, size=spec["shape"]).astype(dtype)
        else:
            feeds[spec["name"]] = rng.standard_normal(spec["shape"]).astype(dtype)
    return feeds


def _timed(path: Path, feeds, repeats: int) -> dict:
    from pocketdiff.runtime.delegate import run_on_delegate

    run = run_on_delegate(path, feeds, precisions=["fp16"], repeats=repeats, warmup=3, timed_read=True)
    if not run.compiled:
        raise SystemExit(f"{path.name}: did not compile on the GPU delegate: {run.rejected_summary()}")
    return {"latency_ms": round(1e3 * run.latency_s["fp16"], 3), "fully_accelerated": run.fully_accelerated,
            "compile_s": round(run.compile_s["fp16"], 2), "adapter": run.adapter, "outputs": run.outputs["fp16"]}


def measure(src: Path, bundle: Path, out: Path, repeats: int) -> dict:
    from pocketdiff.runtime.parity import metrics

    work = Path(tempfile.mkdtemp(prefix="conditioning_cost_"))  # not beside the result: $OUT takes no large files
    exported = json.loads((src / "export.json").read_text())  # the graphs `export` made
    rows = []
    for name in exported:
        path = _unpacked(src, work, name)
        golden = np.load(src / f"{name}.golden.npz")
        got = _timed(path, {f"args_{i}": golden[f"arr_{i}"] for i in range(3)}, repeats)  # the converter's names
        m = metrics(golden["out"], got.pop("outputs")[0])
        rows.append({"graph": f"added_embedding_{name}", "batch": BATCH, **got, "cosine_vs_torch": m["cosine"],
                     "params": int(exported[name]["params"])})
    manifest = json.loads((bundle / "manifest.json").read_text())
    unet_files = sorted(p.name for p in bundle.glob("unet*.tflite"))
    step = []
    for name in unet_files:
        got = _timed(bundle / name, _random_feeds(bundle / name), repeats)
        got.pop("outputs")
        step.append({"graph": name, **got})
    step_ms = sum(r["latency_ms"] for r in step)
    for r in rows:
        r["unet_step_ms"] = round(step_ms, 3)
        r["fraction_of_step"] = round(r["latency_ms"] / step_ms, 5)
    result = {
        "what": "the text_time added embedding (prompt-dependent conditioning) as its own graph on the GPU delegate "
                "at guidance batch 2, against one UNet step (all UNet graphs) of an SD-2.1-size bundle, same machine; "
                "a separate graph pays a dispatch and input copies: an upper bound of its in-graph cost",
        "script": "python benchmarks/conditioning_cost.py measure DEST BUNDLE --out ...",
        "bundle": {"path": bundle.name, "unet_graphs": unet_files, "resolution": manifest.get("resolution"),
                   "unet_params": manifest.get("unet_params")},
        "repeats": repeats, "host": platform.node(), "python": sys.version.split()[0],
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows, "unet_step": step,
    }
    out.write_text(json.dumps(result, indent=1))
    shutil.rmtree(work, ignore_errors=True)  # the unpacked graphs: scratch
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("dest", type=Path)
    m = sub.add_parser("measure")
    m.add_argument("src", type=Path)
    m.add_argument("bundle", type=Path)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    if args.cmd == "export":
        print(json.dumps(export(args.dest), indent=1))
        return 0
    if not (args.bundle / "manifest.json").is_file():
        print(f"conditioning_cost: no manifest.json in {args.bundle}", file=sys.stderr)
        return 2
    res = measure(args.src, args.bundle, args.out, args.repeats)
    for r in res["rows"]:
        print(f"{r['graph']}: {r['latency_ms']} ms, {100 * r['fraction_of_step']:.3f} % of a "
              f"{r['unet_step_ms']} ms UNet step, fully accelerated {r['fully_accelerated']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
