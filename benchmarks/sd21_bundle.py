#!/usr/bin/env python
"""SD-2.1-size bundles at 512 px: carry them to a GPU machine, and collect what ran there.

  pack     (here, after `pocketdiff export --config configs/sd21/export*.yaml`): each bundle's
           files into DEST/LAYOUT/, every .tflite compressed with xz (Python's lzma unpacks it:
           nothing to install on the GPU machine); a file equal in two bundles (the text
           encoder and decoder of both layouts) is stored once under DEST/_shared/. Tiled
           synthetic weights (export.synthetic) make an SD-2.1 bundle of ~1.7 GB a few MB.
  unpack   (there): DEST/LAYOUT/ -> a bundle folder per layout, sha256 checked against the
           manifest by verify-bundle afterwards.
  summarize (here): an exported bundle's report.json (per component peak RSS, convert time,
           bytes, bytes/param, the phone profile's largest tensor / heaviest op) + the packed
           size -> benchmarks/results JSON.
  collect  (there): verify-bundle / run-bundle JSON files of scripts/gpu/sd21_bundle.sh -> one
           summary JSON (per component: fully accelerated, finite at fp16, compile, latency;
           end to end per layout, plain vs pipelined peak RSS; XNNPACK beside).

  python benchmarks/sd21_bundle.py pack runs/sd21_cfg:cfg runs/sd21_student:student --dest .devbundle
  python benchmarks/sd21_bundle.py pack runs/chunk1:whole runs/chunk2:chunk2 --dest .devbundle --max-golden-mb 16
  python benchmarks/sd21_bundle.py unpack .devbundle bundles
  python benchmarks/sd21_bundle.py collect $OUT --out $OUT/sd21_bundle.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

SKIP = {"_export", "report.json", "config.yaml", ".pocketdiff-output.json"}
XZ_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6, "dict_size": 64 << 20}]  # the tiling period fits the window many times


def _xz(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, lzma.open(dst, "wb", format=lzma.FORMAT_XZ, filters=XZ_FILTERS) as g:
        shutil.copyfileobj(f, g, 1 << 24)


def _big_goldens(folder: Path, max_mb) -> tuple[set, Optional[str]]:
    """Per-component golden files over `max_mb` (a UNet chunk's holds the skip tensors: ~27 MB of noise-like
    floats that xz cannot shrink) and the manifest text without their entries: run-bundle reads no golden;
    verify-bundle then has none for those components (the chunked UNet's end-to-end golden is kept)."""
    if max_mb is None:
        return set(), None
    man = json.loads((folder / "manifest.json").read_text())
    dropped = set()
    for entry in man["components"].values():
        g = entry.get("golden")
        if g and (folder / g["path"]).stat().st_size > max_mb * 2**20:
            dropped.add(g["path"])
            del entry["golden"]
    return dropped, (json.dumps(man, indent=1) if dropped else None)


def pack(bundles: list[tuple[Path, str]], dest: Path, max_golden_mb: Optional[float] = None) -> dict:
    from pocketdiff.outputs import sha256_file

    dest.mkdir(parents=True, exist_ok=True)
    shared = dest / "_shared"
    seen: dict[str, str] = {}  # sha -> stored name under _shared
    index: dict = {"layouts": {}, "shared": {}}
    for folder, layout in bundles:
        files = {}
        dropped, manifest_text = _big_goldens(folder, max_golden_mb)
        if dropped:
            index.setdefault("dropped_goldens", {})[layout] = sorted(dropped)
        for p in sorted(folder.rglob("*")):
            rel = p.relative_to(folder)
            if not p.is_file() or rel.parts[0] in SKIP or str(rel) in dropped:
                continue
            if manifest_text is not None and str(rel) == "manifest.json":
                (dest / layout).mkdir(parents=True, exist_ok=True)
                (dest / layout / "manifest.json").write_text(manifest_text)
                files[str(rel)] = {"stored": f"{layout}/manifest.json", "sha256": hashlib.sha256(manifest_text.encode()).hexdigest()}
                continue
            sha = sha256_file(p)
            if sha in seen:  # stored already (same component in another layout)
                files[str(rel)] = {"shared": seen[sha], "sha256": sha}
                continue
            t0 = time.perf_counter()
            big = p.suffix == ".tflite" or p.stat().st_size > (1 << 20)
            if big and len(bundles) > 1:
                shared.mkdir(exist_ok=True)
                name = f"{sha[:16]}{p.suffix}.xz"
                _xz(p, shared / name)
                seen[sha] = name
                files[str(rel)] = {"shared": name, "sha256": sha}
                stored = shared / name
            else:
                stored = dest / layout / (str(rel) + (".xz" if big else ""))
                stored.parent.mkdir(parents=True, exist_ok=True)
                _xz(p, stored) if big else shutil.copyfile(p, stored)
                files[str(rel)] = {"stored": str(stored.relative_to(dest)), "sha256": sha}
            print(f"packed {layout}/{rel}: {p.stat().st_size / 2**20:.1f} MiB -> {stored.stat().st_size / 2**20:.2f} MiB "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        index["layouts"][layout] = files
    index["bytes_packed"] = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    (dest / "index.json").write_text(json.dumps(index, indent=1))
    print(f"{dest}: {index['bytes_packed'] / 2**20:.1f} MiB in all")
    return index


def unpack(src: Path, dest: Path) -> dict[str, Path]:
    index = json.loads((src / "index.json").read_text())
    out = {}
    for layout, files in index["layouts"].items():
        root = dest / layout
        for rel, e in files.items():
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            stored = src / "_shared" / e["shared"] if "shared" in e else src / e["stored"]
            if stored.suffix == ".xz":
                with lzma.open(stored, "rb") as f, open(target, "wb") as g:
                    shutil.copyfileobj(f, g, 1 << 24)
            else:
                shutil.copyfile(stored, target)
        out[layout] = root
        print(f"unpacked {layout} -> {root} ({sum(p.stat().st_size for p in root.rglob('*') if p.is_file()) / 2**20:.0f} MiB)")
    return out


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(out: Path) -> dict:
    """verify_<layout>_<acc>.json and run_<layout>_<mode>/report.json files under `out`."""
    res: dict = {"verify": {}, "run": {}, "host": os.uname().nodename, "cpu_count": os.cpu_count()}
    for f in sorted(out.glob("verify_*.json")):
        r = _load(f)
        if r is None:
            continue
        res["verify"][f.stem[len("verify_"):]] = {
            n: {k: c.get(k) for k in ("ok", "failed_check", "error", "fully_accelerated", "compile_s", "latency_ms", "ops_split")}
            | {"finite": {p: m.get("finite") for p, m in (c.get("parity") or {}).items()},
               "cosine": {p: m.get("cosine") for p, m in (c.get("parity") or {}).items()}}
            for n, c in r.get("components", {}).items()
        }
    for d in sorted(out.glob("run_*")):
        r = _load(d / "report.json")
        if r is not None:
            res["run"][d.name[len("run_"):]] = {k: r.get(k) for k in ("accelerator", "driver", "pipelined", "fully_accelerated",
                                                                     "fully_accelerated_by_component", "latency_s", "peak_rss_mb",
                                                                     "peak_model_mb", "peak_model_mb_all_resident", "steps", "guidance")}
    for f in sorted(out.glob("*.status")):
        res.setdefault("status", {})[f.stem] = f.read_text().strip()
    return res


def summarize(bundle: Path, packed: Path | None) -> dict:
    from pocketdiff.export.device_profile import DeviceProfile, check_component

    rep = json.loads((bundle / "report.json").read_text())
    cfg = (bundle / "config.yaml").read_text() if (bundle / "config.yaml").is_file() else ""
    comps = {}
    for n, c in rep["components"].items():
        d = c.get("details") or {}
        comps[n] = {
            "weights": c.get("weights"), "params": c.get("params"), "bytes": c.get("bytes"), "bytes_per_param": c.get("bytes_per_param"),
            "peak_rss_gb": round(c["peak_rss_mb"] / 1024, 2) if c.get("peak_rss_mb") else None,  # None: a UNet chunk (its row is the UNet's) "convert_s": d.get("convert_s"), "op_count": c.get("op_count"),
            "transposes": c.get("transposes"), "rewrite_parity_cosine": (d.get("rewrite_parity") or {}).get("cosine"),
            "phone_profile": check_component(n, bundle / f"{n}.tflite", DeviceProfile("phone")) if c.get("file") else None,  # None: a chunked UNet's summary row
        }
    out = {
        "what": "pocketdiff export of an SD-2.1-size bundle (random tiled weights, norm affines perturbed) on a 2-core / 24 GB machine",
        "command": "pocketdiff export --config <config> --output <bundle>",
        "config": cfg, "host": os.uname().nodename, "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "guidance": rep.get("guidance"), "resolution": rep.get("resolution"), "weights": rep.get("weights"),
        "export_s": rep.get("export_s"), "timings": rep.get("timings"), "bundle_bytes": rep.get("bundle_bytes"),
        "peak_rss_gb_max": max(c["peak_rss_gb"] or 0 for c in comps.values()), "components": comps,
    }
    if packed is not None and (packed / "index.json").is_file():
        out["packed_bytes"] = json.loads((packed / "index.json").read_text()).get("bytes_packed")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("bundles", nargs="+", help="FOLDER:LAYOUT")
    a.add_argument("--dest", required=True)
    a.add_argument("--max-golden-mb", type=float, default=None, help="leave out per-component goldens over this size (and their manifest entries)")
    b = sub.add_parser("unpack")
    b.add_argument("src")
    b.add_argument("dest")
    s = sub.add_parser("summarize")
    s.add_argument("bundle")
    s.add_argument("--packed", default=None)
    s.add_argument("--out", required=True)
    c = sub.add_parser("collect")
    c.add_argument("dir")
    c.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "pack":
        pairs = []
        for item in args.bundles:
            folder, _, layout = item.rpartition(":")
            if not folder or not (Path(folder) / "manifest.json").is_file():
                p.error(f"{item}: give BUNDLE_FOLDER:LAYOUT of an exported bundle")
            pairs.append((Path(folder), layout))
        pack(pairs, Path(args.dest), args.max_golden_mb)
    elif args.cmd == "summarize":
        res = summarize(Path(args.bundle), Path(args.packed) if args.packed else None)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(json.dumps({k: v for k, v in res.items() if k not in ("config", "components")}, indent=1))
    elif args.cmd == "unpack":
        unpack(Path(args.src), Path(args.dest))
    else:
        res = collect(Path(args.dir))
        Path(args.out).write_text(json.dumps(res, indent=2))
        for k, v in res["verify"].items():
            for n, c in v.items():
                print(f"verify {k} {n}: ok {c['ok']} fully {c['fully_accelerated']} finite {c['finite']} "
                      f"compile {c['compile_s']} latency_ms {c['latency_ms']} {c.get('error') or ''}")
        for k, v in res["run"].items():
            lat = v.get("latency_s") or {}
            print(f"run {k}: total {lat.get('total')} s, unet_step_mean {lat.get('unet_step_mean')} s, "
                  f"peak RSS {v.get('peak_rss_mb')} MB, fully {v.get('fully_accelerated')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
