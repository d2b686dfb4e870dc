#!/usr/bin/env python
"""LoRA slots at SD-2.1 size on the LiteRT GPU delegate (issue 65 item 3): what `lora_slots` (rank 4 and 16) cost per
UNet step and in memory against the plain UNet, and the time to swap a LoRA between images.

  export DEST [--smoke] [--ranks 4,16] [--unet-chunks K]   here (the 2-core box: litert-torch): the UNet alone, DEST/plain
        and DEST/rR per rank, each `pocketdiff export --config configs/sd21/export_student_int8gpu.yaml` (the phone preset:
        int8 weights the GPU keeps int8, 3x3 convs lowered to 1x1 taps, tiled synthetic weights, 512 px, 4 steps, embedded
        guidance) at model.unet_blocks=tiny (326.8 M) with components [unet], the UNet in the chunks the tiny phone bundle
        ships (unet_chunks=4, the config's layer cuts, as docs/MEASUREMENTS.md's tiny bundles; --unet-chunks K: K chunks
        instead, 1 = one whole graph), the slotted ones with
        `lora_slots: {rank: R, targets: [attn]}` (q, k, v and out of self- and cross-attention: MediaPipe's choice): each
        chunk takes its own slots' factor inputs by the whole UNet's names (runtime/BUNDLE.md). The text encoder and
        decoder are left out: the slots change the UNet only. --smoke: the shipped shapes teacher's UNet instead (int8 RTN,
        ~1 min each; 2 chunks unless --unet-chunks). Then `python benchmarks/sd21_bundle.py pack DEST/plain:plain DEST/r4:r4
        DEST/r16:r16 --dest .devbundle/lora --max-golden-mb 0.5` (the goldens hold random factors xz cannot shrink).
  measure BUNDLES --out JSON   there: each layout under BUNDLES (a folder with manifest.json) in a fresh process
        (`probe`), plain first; rows with the slotted layouts against plain.
  probe LAYOUT --out JSON      one layout in this process, through the runtime's own pieces: the UNet (each of its chunks)
        compiled on the GPU accelerator (runtime/loaded_model.py, the options run-bundle gives it), one step = the chunks
        in sequence with their tensors and the factors passed by name (runtime/chunks.run_parts), fed as run-bundle feeds it (random
        latents, timestep embedding and text states; the factors from runtime/lora_slots.LoraFeeds: zeros = no LoRA);
        STEPS timed steps with no LoRA, then for a slotted UNet the swaps run-bundle --lora / BundleRunner.set_lora make
        between images: LoRA a (the slots' rank), LoRA b (rank 4, zero-padded), none; each swap = LoraFeeds.load of a
        diffusers / PEFT file written here from the slots' shapes, then its first step and STEPS steps. Memory is the
        memory ledger's (runtime/memory.PeakSampler: host RSS and VmHWM, the process's GPU memory by NVML) per phase
        (environment, opened, compiled (every chunk), first_run, each swap's steps, released) and the whole run's peaks; file sizes
        appear only as `file_bytes` and the fed factors as `factor_input_bytes`, never under a memory name.

  python benchmarks/lora_bundle.py export runs/lora_sd21
  python benchmarks/lora_bundle.py measure /tmp/lora_bundles --out $OUT/lora_bundle_h100.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pocketdiff.runtime.chunks import block_key, chunk_aliases, parts_of, run_parts

ROOT = Path(__file__).resolve().parents[1]
SD21 = ["--config", str(ROOT / "configs" / "sd21" / "export_student_int8gpu.yaml"), "model.unet_blocks=tiny",
        "components=[unet]", "int8.components=[unet]", "text_encoder_chunks=1", "vae_tiling.enabled=false"]
TINY_CHUNKS = 4  # the tiny phone bundle's (docs/MEASUREMENTS.md: export_student_int8gpu.yaml model.unet_blocks=tiny unet_chunks=4)
SMOKE = {"seed": 0, "model": {"pretrained": "pocketdiff:shapes-teacher"}, "components": ["unet"], "weights": "int8",
         "int8": {"rtn": True}, "guidance": "cfg", "guidance_scale": 3.0, "steps": 4,
         "golden_prompt": "a large red circle at the center", "verify": {"delegate": False}, "fp16_scan": {"enabled": False}}


# ----------------------------------------------------------------------------- export (here)


def export(dest: Path, ranks: list[int], smoke: bool = False, unet_chunks: int | None = None) -> dict:
    """DEST/plain and DEST/r<R>: the UNet alone, plain and slotted; one `pocketdiff export` process each. `unet_chunks`:
    None = the tiny phone bundle's 4 (smoke: 2), else that many (1: one whole graph)."""
    import yaml

    dest.mkdir(parents=True, exist_ok=True)
    done = {}
    for layout, rank in [("plain", None)] + [(f"r{r}", r) for r in ranks]:
        slots = None if rank is None else {"rank": rank, "targets": ["attn"]}
        if smoke:
            cfg = dict(SMOKE, unet_chunks=unet_chunks or 2, **({"lora_slots": slots} if slots else {}))
            (dest / f"{layout}.yaml").write_text(yaml.safe_dump(cfg))
            args = ["--config", str(dest / f"{layout}.yaml")]
        else:
            args = SD21 + [f"unet_chunks={unet_chunks or TINY_CHUNKS}"] + ([f"lora_slots={{rank: {rank}, targets: [attn]}}"] if slots else [])
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pocketdiff", "export", *args, "--output", str(dest / layout), "--overwrite"], check=True)
        done[layout] = round(time.perf_counter() - t0, 1)
        print(f"lora_bundle: {layout} exported in {done[layout]} s", flush=True)
    return done


# ----------------------------------------------------------------------------- LoRA files (there, from the slots)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> Path:
    """A safetensors file from float32 arrays, numpy only (the GPU machine's runtime needs no torch for it)."""
    header, offset, blobs = {}, 0, []
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return path


def lora_for_slots(path: Path, shapes: dict, rank: int, seed: int) -> Path:
    """A diffusers / PEFT LoRA of `rank` on every slotted module (`shapes`: module -> (in, out)); no alpha (= rank: x1).
    down ~ N(0, 1/in), up ~ N(0, 0.05^2): each projection moves by a few percent, as a real LoRA does."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for m, (n_in, n_out) in shapes.items():
        tensors[f"unet.{m}.lora_A.weight"] = rng.standard_normal((rank, n_in)).astype(np.float32) / np.sqrt(n_in)
        tensors[f"unet.{m}.lora_B.weight"] = 0.05 * rng.standard_normal((n_out, rank)).astype(np.float32)
    return write_safetensors(path, tensors)


# ----------------------------------------------------------------------------- probe (one layout, one process)


def _random_inputs(details: dict, skip: set) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for name, d in details.items():
        if name in skip:
            continue
        dtype = np.dtype(d["dtype"])
        shape = tuple(d["shape"])
        out[name] = np.zeros(shape, dtype) if dtype.kind in "iu" else (0.5 * rng.standard_normal(shape)).astype(dtype)
    return out


def _whole_inputs(man: dict, models: list) -> dict:
    """The UNet's inputs: the chunks block's (the whole UNet's, factors among them), else the one graph's."""
    block = man.get(block_key("unet"))
    if isinstance(block, dict):
        return {i["name"]: {"shape": i["shape"], "dtype": i["dtype"]} for i in block["inputs"]}
    return models[0].in_details


def _load_parts(folder: Path, man: dict, env, mark) -> tuple[list, dict]:
    """Each part of the UNet (runtime/chunks.parts_of: its chunks, or the whole unet) compiled on the GPU with the options
    run-bundle gives it; the memory ledger's opened / compiled marks once the last part is (every chunk compiled)."""
    from pocketdiff.runtime.loaded_model import LoadedModel

    names = parts_of(man)
    models, options = [], {}
    for k, name in enumerate(names):
        e = man["components"][name]
        opts = {"allow_src_quantized_fc_conv_ops": True} if (e.get("int8") or {}).get("storage") == "direct" else {}
        options.update(opts)
        last = k == len(names) - 1
        models.append(LoadedModel(name, dict(e, _path=str(folder / e["path"])), "gpu", env=env, gpu_options=opts,
                                  on_phase=(lambda phase, **_: mark(phase)) if last else None))
    return models, options


def _timed_steps(model, feeds: dict, n: int) -> tuple[list[float], np.ndarray]:
    times, out = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        out = model(feeds)  # run + readback (the next step needs the output on the host)
        times.append(time.perf_counter() - t0)
    return times, out


def _ms(times: list[float]) -> dict:
    s = sorted(times)
    return {"step_ms": round(1e3 * s[len(s) // 2], 3), "step_ms_min": round(1e3 * s[0], 3), "step_ms_max": round(1e3 * s[-1], 3)}


def _swaps(model, lora, base: dict, zero_out: np.ndarray, steps: int, mark, work: Path) -> list[dict]:
    """LoRA a (the slots' rank), LoRA b (rank 4), none: each LoraFeeds.load (set_lora) then its first step and steps."""
    plan = [("lora_a", lora.rank, 1), ("lora_b", min(4, lora.rank), 2), ("none", 0, None)]
    rows = []
    for name, rank, seed in plan:
        path = None if seed is None else lora_for_slots(work / f"{name}.safetensors", lora.shapes, rank, seed)
        t0 = time.perf_counter()
        if path is None:
            lora.clear()
        else:
            lora.load(path, 1.0)
        load_s = time.perf_counter() - t0
        feeds = {**base, **lora.feeds}
        t1 = time.perf_counter()
        first = model(feeds)
        first_s = time.perf_counter() - t1
        times, out = _timed_steps(model, feeds, steps)
        mark(f"steps_{name}")
        change = float(np.abs(out.astype(np.float64) - zero_out).max())
        rows.append({"to": name, "rank": rank, "load_ms": round(1e3 * load_s, 3), "first_step_ms": round(1e3 * first_s, 3),
                     **_ms(times), "finite": bool(np.isfinite(out).all() and np.isfinite(first).all()),
                     "max_abs_change_vs_no_lora": change, "file_bytes": None if path is None else path.stat().st_size})
    return rows


def probe(folder: Path, steps: int, save_out: Path | None = None) -> dict:
    if str(Path(__file__).resolve().parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bundle_footprint import _phase_recorder  # benchmarks/: the same phases and memory as its probes

    from pocketdiff.runtime.litert_c import Environment
    from pocketdiff.runtime.lora_slots import LoraFeeds

    man = json.loads((folder / "manifest.json").read_text())
    driver, sampler, phases, mark = _phase_recorder()
    mark("start")
    env = Environment()
    mark("environment")
    t0 = time.perf_counter()
    models, options = _load_parts(folder, man, env, mark)
    load_s = time.perf_counter() - t0
    aliases = chunk_aliases(man)
    model = lambda feeds: run_parts(models, feeds, aliases)  # noqa: E731  one UNet step: the chunks in sequence
    lora = LoraFeeds(man, folder)  # zeros (no LoRA); no slots: no factor inputs
    base = _random_inputs(_whole_inputs(man, models), set(lora.feeds))
    feeds = {**base, **lora.feeds}
    t1 = time.perf_counter()
    first = model(feeds)
    first_s = time.perf_counter() - t1
    mark("first_run")
    times, zero_out = _timed_steps(model, feeds, steps)
    mark("steps_no_lora")
    zero_out = zero_out.astype(np.float64)
    if save_out is not None:
        np.save(save_out, zero_out)
    swaps = []
    if lora.slots:
        with tempfile.TemporaryDirectory(prefix="lora_bundle_") as work:
            swaps = _swaps(model, lora, base, zero_out, steps, mark, Path(work))
    fully = all(bool(m.fully_accelerated) for m in models)
    for m in models:
        m.close()
    mark("released")
    env.close()
    totals = sampler.totals()
    sampler.close()
    factor_bytes = sum(a.nbytes for a in lora.feeds.values())
    entry = man["components"][parts_of(man)[0]]
    return {"layout": folder.name, "unet_chunks": len(models), "rank": lora.rank, "slot_modules": len(lora.targets),
            "factor_inputs": len(lora.feeds), "factor_input_bytes": factor_bytes,
            "file_bytes": sum(os.path.getsize(folder / man["components"][n]["path"]) for n in parts_of(man)),
            "weights": entry.get("weights"), "int8_storage": (entry.get("int8") or {}).get("storage"), "gpu_options": options, "driver": driver,
            "fully_accelerated": fully, "finite": bool(np.isfinite(first).all()), "load_s": round(load_s, 2),
            "first_run_ms": round(1e3 * first_s, 3), "steps": steps, **_ms(times), "swaps": swaps, "phases": phases, **totals}


# ----------------------------------------------------------------------------- measure (every layout, one process each)


def _phase(row: dict, name: str, key: str):
    return next((p.get(key) for p in row.get("phases", []) if p["phase"] == name), None)


def _layouts(bundles: Path) -> list[Path]:
    found = [p for p in sorted(bundles.iterdir()) if (p / "manifest.json").is_file()]
    rank = lambda p: (json.loads((p / "manifest.json").read_text()).get("lora_slots") or {}).get("rank", 0)  # noqa: E731
    return sorted(found, key=lambda p: (rank(p), p.name))


def _against_plain(rows: list[dict]) -> None:
    plain = next((r for r in rows if not r.get("rank") and "error" not in r), None)
    if plain is None:
        return
    for r in rows:
        if "error" in r:
            continue
        r["step_ms_over_plain"] = round(r["step_ms"] / plain["step_ms"], 4) if plain["step_ms"] else None
        for key in ("host_peak_mb", "gpu_peak_mb", "host_plus_gpu_peak_mb"):
            if r.get(key) is not None and plain.get(key) is not None:
                r[f"{key}_over_plain"] = round(r[key] - plain[key], 1)
        for phase in ("compiled", "steps_no_lora"):  # the same moment in both: after the load, after the no-LoRA steps
            for key in ("gpu_mb", "host_rss_mb"):
                a, b = _phase(r, phase, key), _phase(plain, phase, key)
                if a is not None and b is not None:
                    r[f"{key}_{phase}_over_plain"] = round(a - b, 1)


def _probe_process(folder: Path, tmp: Path, steps: int, timeout: float) -> dict:
    """One layout's probe in a fresh process; its no-LoRA output kept as tmp/<layout>.npy."""
    res = tmp / f"{folder.name}.json"
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "probe", str(folder), "--out", str(res), "--steps",
                            str(steps), "--save-out", str(tmp / f"{folder.name}.npy")], timeout=timeout, capture_output=True, text=True)
        last = ((p.stderr or "").strip().splitlines() or [""])[-1]
        row = json.loads(res.read_text()) if p.returncode == 0 and res.is_file() else \
            {"layout": folder.name, "error": f"exit {p.returncode}: {last}"}
    except subprocess.TimeoutExpired:
        row = {"layout": folder.name, "error": f"over {timeout} s"}
    row["process_s"] = round(time.perf_counter() - t0, 1)
    row.setdefault("unet_chunks", len(parts_of(json.loads((folder / "manifest.json").read_text()))))
    return row


def _no_lora_vs_plain(rows: list[dict], tmp: Path) -> None:
    """Each slotted row's no-LoRA step output (zero factors) against the plain layout's (same inputs): max |difference|."""
    plain = next((r for r in rows if not r.get("rank") and "error" not in r), None)
    if plain is None or not (tmp / f"{plain['layout']}.npy").is_file():
        return
    ref = np.load(tmp / f"{plain['layout']}.npy")
    for r in rows:
        f = tmp / f"{r['layout']}.npy"
        if r is not plain and "error" not in r and f.is_file():
            got = np.load(f)
            r["no_lora_max_abs_vs_plain"] = float(np.abs(got - ref).max()) if got.shape == ref.shape else None
            r["plain_max_abs"] = float(np.abs(ref).max())


def measure(bundles: Path, out: Path, steps: int, timeout: float) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="lora_probe_") as tmp:
        for folder in _layouts(bundles):
            row = _probe_process(folder, Path(tmp), steps, timeout)
            rows.append(row)
            print(f"lora_bundle: {folder.name} ({row['unet_chunks']} UNet part(s)): " + (row.get("error") or
                  f"step {row['step_ms']} ms, GPU peak {row.get('gpu_peak_mb')} MB, host peak {row.get('host_peak_mb')} MB, "
                  f"swaps {[(s['to'], s['load_ms']) for s in row['swaps']]}"), flush=True)
        _no_lora_vs_plain(rows, Path(tmp))
    _against_plain(rows)
    man = json.loads((_layouts(bundles)[0] / "manifest.json").read_text()) if rows else {}
    chunks = len(parts_of(man)) if man else None
    result = {
        "what": "LoRA slots (export lora_slots: {rank, targets: [attn]}) against the plain UNet of the same bundle recipe on "
                "the LiteRT GPU delegate: per UNet step (median of the timed steps, run + readback), memory by phase and "
                "peaks (the memory ledger: runtime/memory.PeakSampler), and the swap run-bundle --lora / "
                "BundleRunner.set_lora makes between images (LoraFeeds.load, then the first step with the new factors); "
                "a chunked UNet's step is its chunks in sequence, the factors fed to each by name (runtime/chunks.run_parts)",
        "script": "python benchmarks/lora_bundle.py measure BUNDLES --out ... (scripts/gpu/lora_bundle.sh)",
        "bundle": {"recipe": "configs/sd21/export_student_int8gpu.yaml model.unet_blocks=tiny components=[unet] "
                             "(no text encoder or decoder; unet_chunks as below)", "unet_chunks": chunks,
                   "resolution": (man.get("image") or {}).get("height"), "latent": man.get("latent"),
                   "guidance": (man.get("guidance") or {}).get("mode")},
        "device": next((r.get("gpu_name") for r in rows if r.get("gpu_name")), None),
        "driver": next((r.get("driver") for r in rows if r.get("driver")), None),
        "host": platform.node(), "python": sys.version.split()[0], "steps": steps,
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("dest", type=Path)
    e.add_argument("--ranks", default="4,16")
    e.add_argument("--smoke", action="store_true", help="the shipped shapes teacher's UNet (seconds), not SD-2.1 size")
    e.add_argument("--unet-chunks", type=int, default=None, help="the UNet in K chunks (1: one whole graph); default 4 (the tiny phone bundle's; smoke 2)")
    m = sub.add_parser("measure")
    m.add_argument("bundles", type=Path)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--steps", type=int, default=20)
    m.add_argument("--timeout", type=float, default=240.0, help="seconds for each layout's process")
    p = sub.add_parser("probe")
    p.add_argument("layout", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-out", type=Path, default=None, help="the no-LoRA step's output as .npy")
    args = ap.parse_args(argv)
    if args.cmd == "export":
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        if args.unet_chunks is not None and args.unet_chunks < 1:
            print(f"lora_bundle: --unet-chunks must be >= 1, got {args.unet_chunks}", file=sys.stderr)
            return 2
        export(args.dest, ranks, args.smoke, args.unet_chunks)
    elif args.cmd == "measure":
        if not args.bundles.is_dir() or not _layouts(args.bundles):
            print(f"lora_bundle: {args.bundles} holds no bundle folder (manifest.json)", file=sys.stderr)
            return 2
        measure(args.bundles, args.out, args.steps, args.timeout)
    else:
        args.out.write_text(json.dumps(probe(args.layout, args.steps, args.save_out)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
