#!/usr/bin/env python
"""run-bundle before and after the runner refactor (issue 61 deliverable 6), side by side in one call.

"before" and "after" are two installs of pocketdiff (`pip install --target SITE` of `git archive COMMIT`), each put
first on PYTHONPATH of its own `python -m pocketdiff.cli run-bundle` processes; the wheels (ai-edge-litert) come after
them. Bundles exported since the refactor are schema_version 3 (the manifest declares its pipeline), which the code
before refuses: both run the same files under a version-2 manifest (the "pipeline" block dropped, as export wrote it
before; the code after reads that through its compatibility reader), and the code after runs the version-3 one too.

  v2     BUNDLE DEST: DEST holds BUNDLE's files hard-linked (copied across file systems) and manifest.json rewritten
         to its version-2 form.
  run    blocks of launches, in --order (e.g. before,after,after,before: drift shows as a difference between the two
         launches of one variant), each block: `--pipelined` cold (empty program and driver caches), `--pipelined` warm
         (the same caches), plain warm (the same caches); then --v3 blocks of the code after on the version-3 manifest.
         Rows: variant, commit, manifest version, block, mode, launch, start_s, total_s, latency_s, host / GPU / at-once
         peaks, memory phases (t_s), image sha256; written after every launch (a call cut short keeps what ran).
  timeline REPORT.json --out PNG: where the seconds of one cold and one warm launch go (each model's open + compile,
         first run, release, the steps, the decode); prints the largest items.

  python benchmarks/runner_before_after.py v2 /tmp/b/tiny /tmp/b/tiny_v2
  python benchmarks/runner_before_after.py run --v2-bundle /tmp/b/tiny_v2 --v3-bundle /tmp/b/tiny \
      --site before=/tmp/sites/site_before --site after=/tmp/sites/site_after --order before,after,after,before --v3 1 --out R.json
  python benchmarks/runner_before_after.py timeline R.json --variant after --manifest 3 --out docs/results/timeline.png
  python benchmarks/runner_before_after.py timeline STARTUP.json --mode te_cpu --out T.png   (startup_levers.py rows)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundle_footprint import _run_bundle  # noqa: E402  (one run-bundle process, its report's measured fields)

LAUNCHES = (("pipelined", "cold"), ("pipelined", "warm"), ("plain", "warm"))


def v2_copy(src: Path, dest: Path) -> dict:
    """DEST: SRC's files (hard links where one file system holds both) and a version-2 manifest."""
    man = json.loads((src / "manifest.json").read_text())
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if p.is_dir() or rel.as_posix() == "manifest.json":
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(p, dest / rel)
        except OSError:
            shutil.copy2(p, dest / rel)
    chunked = any("." in name for name in man["components"])  # unet.0, text_encoder.1, vae_up_tile.0: parts of a model
    old = {k: v for k, v in man.items() if k != "pipeline"}
    old["schema_version"] = 2 if chunked else 1
    (dest / "manifest.json").write_text(json.dumps(old, indent=1))
    return {"from_version": man.get("schema_version"), "to_version": old["schema_version"], "dropped": ["pipeline"]}


def _sha(path: Path) -> str | None:
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def variant_info(site: str) -> dict:
    """Which pocketdiff and LiteRT a variant's processes import (checked, not assumed)."""
    code = ("import json, pocketdiff, pocketdiff.runtime as r, ai_edge_litert as a, os;"
            "print(json.dumps({'pocketdiff': pocketdiff.__file__, 'has_model_pool': os.path.exists(os.path.join(os.path.dirname(r.__file__), 'model_pool.py')),"
            " 'litert': getattr(a, '__version__', None), 'litert_file': a.__file__}))")
    env = dict(os.environ, PYTHONPATH=_pythonpath(site))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    info = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-800:]}
    commit = Path(site) / "POCKETDIFF_COMMIT"
    info["commit"] = commit.read_text().strip() if commit.is_file() else None
    return info


def _pythonpath(site: str) -> str:
    return os.pathsep.join([site] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def _slim(r: dict) -> dict:
    """The report's fields, without the per-model copies of the phases (memory.phases holds them all)."""
    mem = dict(r.get("memory") or {})
    if isinstance(mem.get("models"), dict):
        mem["models"] = {k: {kk: vv for kk, vv in v.items() if kk != "phases"} for k, v in mem["models"].items()}
    return {**r, "memory": mem or None}


def run_block(variant: str, site: str, bundle: str, manifest_version: int, block: int, cache_root: Path,
              timeout: float) -> list[dict]:
    saved = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = _pythonpath(site)
    folder = cache_root / f"{variant}-v{manifest_version}-{block}"
    shutil.rmtree(folder, ignore_errors=True)
    rows = []
    try:
        for mode, launch in LAUNCHES:
            out = Path(f"/tmp/rba-{variant}-v{manifest_version}-{block}-{mode}-{launch}")
            shutil.rmtree(out, ignore_errors=True)
            r = _run_bundle(bundle, str(out), mode == "pipelined", str(folder / "programs"), str(folder / "driver"), timeout, [])
            rows.append({"variant": variant, "manifest_version": manifest_version, "block": block, "mode": mode,
                         "launch": launch, **_slim(r), "image_sha256": _sha(out / "image.png")})
            print(json.dumps({k: rows[-1].get(k) for k in ("variant", "manifest_version", "block", "mode", "launch", "start_s",
                                                          "total_s", "host_peak_mb", "gpu_peak_mb", "host_plus_gpu_peak_at_once_mb",
                                                          "error")} | {"image": (rows[-1]["image_sha256"] or "-")[:12]}), flush=True)
    finally:
        os.environ["PYTHONPATH"] = saved
    return rows


FIELDS = ("start_s", "total_s", "host_peak_mb", "gpu_peak_mb", "host_plus_gpu_peak_mb", "host_plus_gpu_peak_at_once_mb")


def summary(rows: list[dict]) -> list[dict]:
    """Per variant, manifest version, mode and launch: each field's values over the blocks, in run order."""
    groups: dict = {}
    for r in rows:
        if r.get("error"):
            continue
        key = (r["variant"], r["manifest_version"], r["mode"], r["launch"])
        g = groups.setdefault(key, {f: [] for f in FIELDS} | {"unet_step_s": [], "images": set()})
        for f in FIELDS + ("unet_step_s",):
            g[f].append(r.get(f))
        g["images"].add((r.get("image_sha256") or "")[:16])
    return [{"variant": k[0], "manifest_version": k[1], "mode": k[2], "launch": k[3], "launches": len(g["start_s"]),
             **{f: g[f] for f in FIELDS + ("unet_step_s",)}, "images": sorted(g["images"])} for k, g in groups.items()]


_SCRATCH = re.compile(r"(?<![\w.~/:-])/tmp/")


def _relative(o):
    """Records name no machine path (tests/core/test_no_machine_paths.py): the scratch folders' paths made relative."""
    if isinstance(o, dict):
        return {k: _relative(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_relative(v) for v in o]
    return _SCRATCH.sub("", o) if isinstance(o, str) else o


def run(a) -> int:
    sites = dict(s.split("=", 1) for s in a.site)
    order = a.order.split(",")
    for v in order:
        if v not in sites:
            raise SystemExit(f"--order: {v!r} has no --site {v}=DIR")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    doc = {"what": "run-bundle before and after the runner refactor (issue 61 deliverable 6)",
           "device": smi.stdout.strip() if smi is not None and smi.returncode == 0 else None,
           "variants": {v: variant_info(s) for v, s in sites.items()}, "order": order, "v3_blocks": a.v3,
           "bundles": {"v2": a.v2_bundle, "v3": a.v3_bundle}, "launches": [f"{m} {l}" for m, l in LAUNCHES], "rows": []}
    print(json.dumps(doc["variants"]), flush=True)
    out = Path(a.out)
    plan = [(v, a.v2_bundle, 2) for v in order] + [("after", a.v3_bundle, 3)] * a.v3
    for block, (variant, bundle, version) in enumerate(plan):
        doc["rows"] += run_block(variant, sites[variant], bundle, version, block, Path(a.cache_root), a.timeout)
        out.write_text(json.dumps(_relative(doc), indent=1))
    shas = {r["image_sha256"] for r in doc["rows"]}
    doc["images_identical"] = len(shas) == 1 and None not in shas
    doc["summary"] = summary(doc["rows"])
    for g in doc["summary"]:
        print(json.dumps({k: g[k] for k in ("variant", "manifest_version", "mode", "launch", "start_s", "total_s",
                                            "host_plus_gpu_peak_at_once_mb", "images")}))
    out.write_text(json.dumps(_relative(doc), indent=1))
    print(f"images identical across all {len(doc['rows'])} launches: {doc['images_identical']}")
    return 0


PHASE_WORDS = {"opened": "open", "compiled": "compile", "pages_released": "give back file pages", "settled": "settle run",
               "first_run": "first run", "steady_run": "later runs", "released": "release"}


def intervals(row: dict) -> list[dict]:
    """A sequential launch's seconds, mark to mark: [start, end) of each item, named by the mark that ends it (a model's
    "compile" is its opened -> compiled; the UNet chunks' "first run" the first step, "later runs" the other steps)."""
    mem = row.get("memory") or {}
    st = mem.get("startup_s") or {}
    items, t = [], 0.0
    for key, name in (("main", "interpreter + imports"), ("bundle_checked", "bundle check"), ("runner_ready", "runner setup")):
        if st.get(key) is not None:
            items.append({"component": "process", "item": name, "t0": t, "t1": st[key]})
            t = st[key]
    marks = sorted((p for p in mem.get("phases") or [] if p.get("t_s") is not None and p.get("component") != "runner"),
                   key=lambda p: p["t_s"])
    last_group = {}
    for p in marks:
        comp, phase = p["component"], p["phase"]
        group = comp.split(".")[0] if phase in ("first_run", "steady_run") and comp.startswith("unet") else comp
        if group != comp and last_group.get((group, phase)) == p["t_s"]:
            continue  # the UNet's chunks run within each step: one item per step kind, not per chunk
        last_group[(group, phase)] = p["t_s"]
        word = {"first_run": "step 1", "steady_run": "later steps"}[phase] if group != comp else PHASE_WORDS.get(phase, phase)
        items.append({"component": group, "item": word, "t0": t, "t1": p["t_s"]})
        t = max(t, p["t_s"])
    if row.get("total_s") is not None and row["total_s"] > t:
        items.append({"component": "process", "item": "decode tail + image", "t0": t, "t1": row["total_s"]})
    for it in items:
        it["s"] = round(it["t1"] - it["t0"], 3)
    return items


def largest(items: list[dict], n: int = 3) -> list[dict]:
    """The n largest items, a chunked model's parts summed per kind (text_encoder.0-2 compile: one item)."""
    sums: dict = {}
    for it in items:
        key = (it["component"].split(".")[0], it["item"])
        sums[key] = sums.get(key, 0.0) + it["s"]
    top = sorted(sums.items(), key=lambda kv: -kv[1])[:n]
    return [{"what": f"{c} {i}", "s": round(s, 2)} for (c, i), s in top]


def as_report(row: dict) -> dict:
    """A launch row as `intervals` reads it: this script's rows carry run-bundle's `memory` block; startup_levers.py's
    (and sdxl_bundle.sh's) rows its startup seconds (`startup_s`) and phase marks (`marks`)."""
    if "memory" in row:
        return row
    startup = row.get("startup_s") if isinstance(row.get("startup_s"), dict) else {}
    return {**row, "memory": {"startup_s": startup, "phases": row.get("marks") or []}}


def timeline(a) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(a.results).read_text())
    pick = [as_report(r) for r in doc["rows"] if r.get("variant", a.variant) == a.variant
            and r.get("manifest_version", a.manifest) == a.manifest and r["mode"] == a.mode and not r.get("error")]
    launches = [next((r for r in pick if r["launch"] == l), None) for l in ("cold", "warm")]
    launches = [r for r in launches if r is not None]
    if not launches:
        raise SystemExit(f"{a.results}: no {a.mode} launch of {a.variant} on manifest version {a.manifest}")
    kinds = sorted({it["item"] for r in launches for it in intervals(r)})
    colours = {k: plt.get_cmap("tab20")(i % 20) for i, k in enumerate(kinds)}
    fig, axes = plt.subplots(len(launches), 1, figsize=(12, 3.2 * len(launches) + 1), squeeze=False)
    summary = {}
    for ax, r in zip(axes[:, 0], launches):
        items = intervals(r)
        rows = list(dict.fromkeys(it["component"] for it in items))
        for it in items:
            y = rows.index(it["component"])
            ax.barh(y, it["t1"] - it["t0"], left=it["t0"], color=colours[it["item"]], edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_xlim(0, max(it["t1"] for it in items) * 1.01)
        top = largest(items)
        summary[r["launch"]] = {"total_s": r.get("total_s"), "start_s": r.get("start_s"), "largest": top}
        ax.set_title(f"{r['launch']} launch, run-bundle {' '.join(r.get('flags') or ['--pipelined'])}: first step {r.get('start_s')} s, image {r.get('total_s')} s; "
                     f"largest: " + ", ".join(f"{t['what']} {t['s']} s" for t in top), fontsize=9)
        ax.set_xlabel("seconds since process start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in kinds]
    fig.legend(handles, kinds, loc="lower center", ncol=min(len(kinds), 6), fontsize=8)
    fig.suptitle(a.title or f"{a.variant}, manifest v{a.manifest}: {doc.get('device', '')}", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.97))
    fig.savefig(a.out, dpi=110)
    print(json.dumps(summary, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("v2")
    v.add_argument("bundle")
    v.add_argument("dest")
    r = sub.add_parser("run")
    r.add_argument("--v2-bundle", required=True)
    r.add_argument("--v3-bundle", required=True)
    r.add_argument("--site", action="append", required=True, help="VARIANT=DIR: a pip --target install of pocketdiff")
    r.add_argument("--order", default="before,after,after,before")
    r.add_argument("--v3", type=int, default=1, help="blocks of the code after on the version-3 manifest, last")
    r.add_argument("--cache-root", default="/tmp/rba-cache")
    r.add_argument("--timeout", type=float, default=240)
    r.add_argument("--out", required=True)
    t = sub.add_parser("timeline")
    t.add_argument("results")
    t.add_argument("--variant", default="after")
    t.add_argument("--manifest", type=int, default=3)
    t.add_argument("--mode", default="pipelined", help="the rows' mode (startup_levers.py rows: a configuration name)")
    t.add_argument("--title")
    t.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "v2":
        print(json.dumps(v2_copy(Path(a.bundle), Path(a.dest))))
        return 0
    return run(a) if a.cmd == "run" else timeline(a)


if __name__ == "__main__":
    sys.exit(main())
