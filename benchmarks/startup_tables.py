"""The generated blocks of the start-up levers section (issue 66 items 3/4), an app's later images, and image-to-image at
SD-2.1 size (issue 64 item 5), from benchmarks/results/startup_sd21_h100.json, app_images_sd21_h100.json and
img2img_bundle_sd21_h100.json. benchmarks/measurements_tables.py registers TABLES and writes them between the markers.
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
STARTUP = "startup_sd21_h100.json"
APP_EARLIER = "app_images_sd21_h100.json"
I2I = "img2img_bundle_sd21_h100.json"
BUDGET_MB = 4096
TARGET_COLD_S, TARGET_WARM_S, TARGET_LATER_S = 15, 5, 1
LEVERS = {"pipelined": "the baseline", "te_cpu": "a", "compile_ahead": "b, in a thread", "overlap": "b, in workers",
          "one_env": "c", "te_cpu_ahead": "a + b, in a thread", "overlap_te_cpu": "a + b, in workers",
          "overlap_ahead2_te_cpu": "a + b, two ahead",
          "overlap_ahead3_te_cpu": "a + b, the UNet and all three decoder graphs at once", "te_cpu_one_env": "a + c"}
APP_TEXT = {"keep_unet_decoder_te_cpu": '`pipelined=True, keep=("unet", "vae_decoder"), on_cpu=("text_encoder",)`',
            "keep_unet_te_cpu": '`pipelined=True, keep=("unet",), on_cpu=("text_encoder",)`',
            "plain_te_cpu": '`on_cpu=("text_encoder",)` (every model kept)',
            "plain": "all on the GPU, all kept", "keep_unet": '`pipelined=True, keep=("unet",)`',
            "keep_unet_text": '`pipelined=True, keep=("unet", "text_encoder")`', "pipelined": "`pipelined=True`"}


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def mb(v: float) -> str:
    return f"{v:,.0f} MB"


def _rows(d: dict) -> dict:
    """(mode, launch) -> row, measured rows only (no error)."""
    return {(r["mode"], r["launch"]): r for r in d["rows"] if not r.get("error")}


def _modes(d: dict) -> list[str]:
    rows = _rows(d)
    return [m for m in d["plan"] if m in d["configs"] and any((m, l) in rows for l in ("cold", "warm"))]


def _pair(rows: dict, mode: str, key: str, fmt: str) -> str:
    return " / ".join(fmt.format(rows[(mode, l)][key]) if (mode, l) in rows else "-" for l in ("cold", "warm"))


def _image_vs(r: dict) -> str:
    if r["mode"] == "pipelined":
        return "(itself)"
    return "the same" if r.get("same_image_as_baseline") else f"{r['psnr_vs_baseline_db']:.1f} dB"


def startup_levers() -> str:
    d = load(STARTUP)
    rows = _rows(d)
    out = []
    for m in _modes(d):
        w = rows.get((m, "warm")) or rows[(m, "cold")]
        out.append([f"`{' '.join(d['configs'][m])}`", LEVERS.get(m, m), _pair(rows, m, "start_s", "{:.1f}") + " s",
                    _pair(rows, m, "total_s", "{:.1f}") + " s",
                    f"{w['host_peak_mb']:,.0f} / {w['gpu_peak_mb']:,.0f} MB",
                    _pair(rows, m, "host_plus_gpu_peak_at_once_mb", "{:,.0f}") + " MB", _image_vs(w)])
    done = set(_modes(d))
    skipped = [m for m in d["plan"] if m in d["configs"] and m not in done]
    others = [s for s in d["skipped"] if s.split()[0] not in d["configs"] or s.split()[0] in done]
    return table(["run-bundle", "lever", "first step cold / warm", "image cold / warm", "host / GPU peak, warm",
                  "host + GPU at once, cold / warm", "image vs `--pipelined`"], out) + (
        "\nNot measured (the call's time budget ran out first): "
        + ", ".join(f"`{' '.join(d['configs'][m])}`" for m in skipped)
        + (", and " + ", ".join(f"`{s}`" for s in others) if others else "") + ".\n" if skipped or others else "")


def _group(phases: dict, test) -> float:
    return sum(s for k, s in phases.items() if test(k))


def startup_phases() -> str:
    d = load(STARTUP)
    rows = _rows(d)
    out = []
    for m in _modes(d):
        for launch in ("cold", "warm"):
            r = rows.get((m, launch))
            if r is None:
                continue
            p = r["phases_s"]
            dec = ("vae_decoder_head compile", "vae_up_tile compile")
            runs = _group(p, lambda k: k.split()[0] in ("unet", "vae_decoder_head", "vae_up_tile")
                          and k.split(" ", 1)[1] in ("settle run", "step 1", "later steps", "first run"))
            out.append([m, launch, f"{_group(p, lambda k: k.startswith('text_encoder ')):.1f} s",
                        f"{p.get('text_encoder cpu_variant', 0):.1f} / {p.get('text_encoder first run', 0):.1f} s",
                        f"{p.get('unet compile', 0):.1f} s", f"{sum(p.get(k, 0) for k in dec):.1f} s", f"{runs:.1f} s",
                        f"{r['total_s']:.1f} s", ", ".join(f"{x['what']} {x['s']:.1f} s" for x in r["largest"])])
    return table(["configuration", "launch", "text encoder, all its phases", "of which CPU variant / first run",
                  "UNet compile", "decoder compiles (head + up path)", "UNet + decoder runs", "image",
                  "three largest (`largest`)"], out)


def _best(d: dict, launch: str, within: bool):
    rows = [r for (m, l), r in _rows(d).items() if l == launch
            and (r["host_plus_gpu_peak_at_once_mb"] <= BUDGET_MB) == within]
    return min(rows, key=lambda r: r["total_s"]) if rows else None


def _at(r: dict) -> str:
    return f"`{r['mode']}` {r['total_s']:.1f} s at {mb(r['host_plus_gpu_peak_at_once_mb'])}"


def startup_targets() -> str:
    d = load(STARTUP)
    app = {s["mode"]: s for s in d["app_summary"]}
    cold, warm = _best(d, "cold", True), _best(d, "warm", True)
    fast_warm = _best(d, "warm", False)
    met_cold = cold["total_s"] <= TARGET_COLD_S
    met_warm = warm["total_s"] <= TARGET_WARM_S
    later = [s for s in app.values() if s["later_max_s"] <= TARGET_LATER_S and s["at_once_within_4gb"]]
    text = (f"Against the targets (within {BUDGET_MB / 1024:.0f} GB at once; the `tiny` image <= {TARGET_COLD_S} s cold, "
            f"<= {TARGET_WARM_S} s warm; an app's later images <= {TARGET_LATER_S} s): "
            f"{'met' if met_cold else 'not met'} cold (best within the budget: {_at(cold)}), "
            f"{'met' if met_warm else 'not met'} warm (best within the budget: {_at(warm)})")
    if fast_warm and fast_warm["total_s"] < warm["total_s"]:
        text += f"; the fastest warm launch, {_at(fast_warm)}, is over the budget"
    text += ("; later images " + ("met by " + ", ".join(s["mode"] for s in later) if later else "not met") + ": "
             + "; ".join(f"`{m}` {s['later_min_s']:.1f}-{s['later_max_s']:.1f} s at {mb(s['host_plus_gpu_peak_at_once_mb'])}"
                         for m, s in app.items()) + ".\n")
    return text


def _app_row(s: dict, where: str) -> list[str]:
    p = s["later_phases_mean_s"]
    return [s["mode"], APP_TEXT.get(s["mode"], s["mode"]), where, f"{s['first_s']:.2f} s",
            f"{s['later_min_s']:.2f}-{s['later_max_s']:.2f} s",
            f"{p['text_encoder_load']:.2f} / {p['decoder_load']:.2f} / {p['runs']:.2f} s",
            mb(s["host_plus_gpu_peak_at_once_mb"])]


def startup_app() -> str:
    d, earlier = load(STARTUP), load(APP_EARLIER)
    rows = [_app_row(s, "this call") for s in d["app_summary"]]
    rows += [_app_row(s, f"`{APP_EARLIER}`") for s in earlier["summary"] if s["launch"] == "warm"]
    return table(["mode", "`BundleRunner` options", "measured in", "1st image", f"images 2-{d['images']} (earlier: 2-10)",
                  "later image, mean: text encoder load / decoder load / runs", "host + GPU at once"], rows)


def _i2i_stage(pm: dict, stage: str) -> tuple[float, float]:
    if stage == "vae_decoder":
        load_s = sum(v.get("load_s", 0) for k, v in pm.items() if k.startswith(("vae_decoder_head", "vae_up_tile.")))
        return load_s, pm["vae_decoder_head"]["run_s"] + pm["vae_up_tiles"]["run_s"]
    return pm[stage]["load_s"], pm[stage].get("run_s", pm[stage].get("steps_s", 0))


def img2img_sd21() -> str:
    d = load(I2I)
    runs = [("img2img", "image-to-image, cold"), ("img2img_warm", "image-to-image, warm"),
            ("text_to_image_warm", "text-to-image, warm (same bundle)")]
    stages = [("text_encoder", "text encoder"), ("vae_encoder", "VAE encoder"), ("unet", "UNet"),
              ("vae_decoder", "decoder")]
    rows = []
    for key, name in runs:
        r = d[key]
        cells = []
        for stage, _ in stages:
            if stage not in r["per_model"] and not (stage == "vae_decoder" and "vae_up_tiles" in r["per_model"]):
                cells.append("-")
                continue
            lo, ru = _i2i_stage(r["per_model"], stage)
            cells.append(f"{lo:.2f} / {ru:.2f} s")
        rows.append([name, *cells, f"{r['start_s']:.1f} s", f"{r['total_s']:.1f} s",
                     f"{mb(r['host_plus_gpu_peak_at_once_mb'])} ({mb(r['host_plus_gpu_peak_mb'])})"])
    return table(["run", *(f"{s}: load / run" for _, s in stages), "first step", "image",
                  "host + GPU at once (peaks added)"], rows)


def img2img_encoder() -> str:
    d = load(I2I)
    enc = d["img2img_warm"]["per_model"]["vae_encoder"]
    e768 = d["encoder_768"]
    largest = max(v.get("max_phase_host_plus_gpu_mb", 0) for v in d["img2img_warm"]["per_model"].values())
    return (f"The encoder at 512 px in the warm launch: {enc['max_gpu_mb']:,.0f} MB on the GPU, "
            f"{enc['max_phase_host_plus_gpu_mb']:,.0f} MB host + GPU at its largest phase"
            f"{' (the largest of any model of the launch)' if enc['max_phase_host_plus_gpu_mb'] == largest else ''}; at once "
            f"{mb(d['img2img']['host_plus_gpu_peak_at_once_mb'])} cold / {mb(d['img2img_warm']['host_plus_gpu_peak_at_once_mb'])} "
            f"warm against the {mb(d['budget_mb'])} budget (within: {str(d['within_budget_at_once']).lower()}). "
            f"The 768 px banded encoder alone (compiled and run once in a process of its own, {e768['bytes'] / 2 ** 20:.0f} MiB file): "
            f"compile {e768['compile_s']['fp16']:.1f} s, run {e768['latency_s']['fp16'] * 1000:.0f} ms, GPU peak "
            f"{mb(e768['memory']['gpu_peak_mb'])}, host + GPU at once {mb(e768['memory']['host_plus_gpu_peak_at_once_mb'])}, "
            f"fully on the GPU: {str(e768['fully_accelerated']).lower()}, latents {'x'.join(map(str, e768['latent_shape']))}.\n")


ANCHOR = "docs/MEASUREMENTS.md#start-up-levers-and-an-apps-later-images-one-h100-80gb-2026-12-07"


def app_advice() -> str:
    """The README's "what an app should do" paragraph: three long lines (the README is capped at 360 lines)."""
    d, earlier = load(STARTUP), load(APP_EARLIER)
    rows, app = _rows(d), {s["mode"]: s for s in d["app_summary"]}
    old = {s["mode"]: s for s in earlier["summary"] if s["launch"] == "warm"}
    first, base = _best(d, "cold", True)["mode"], "pipelined"
    cpu, text, plain = app["keep_unet_decoder_te_cpu"], old["keep_unet_text"], old["plain"]
    te_runs = [r["latency_s"]["text_encoder_run"] for r in d["app_rows"] if r["mode"] == cpu["mode"] and r["image"] > 0]
    span = lambda s: f"{s['later_min_s']:.2f}-{s['later_max_s']:.2f} s at {mb(s['host_plus_gpu_peak_at_once_mb'])}"  # noqa: E731
    return (f"**What an app should do** (`tiny`, one H100, [figures]({ANCHOR})). A launch's first image within 4 GB: "
            f"`run-bundle {' '.join(d['configs'][first])}`, {_pair(rows, first, 'total_s', '{:.1f}')} s cold / warm at "
            f"{_pair(rows, first, 'host_plus_gpu_peak_at_once_mb', '{:,.0f}')} MB (`--pipelined` "
            f"{_pair(rows, base, 'total_s', '{:.1f}')} s on that host); no lever measured reaches {TARGET_COLD_S} s cold "
            f"/ {TARGET_WARM_S} s warm within 4 GB.\n"
            f"Later images: keep one `BundleRunner` open. `BundleRunner(b, pipelined=True, keep=(\"unet\", \"text_encoder\"))`"
            f" drew them in {span(text)} (`{APP_EARLIER}`, an earlier call on a faster H100 host), "
            f"`keep=(\"unet\", \"vae_decoder\"), on_cpu=(\"text_encoder\",)` in {span(cpu)} (`{STARTUP}`): "
            f"the CPU text encoder's run alone takes {min(te_runs):.2f}-{max(te_runs):.2f} s an image (it is reloaded for "
            f"each; its linear layers ran outside XNNPACK: the CPU variant v2 fixes that, 3.2x on the 2-core CPU, not yet "
            f"re-measured there), about a whole image of the first mode. Two calls, two "
            f"hosts, not side by side; within 4 GB we advise `keep=(\"unet\", \"text_encoder\")`.\n"
            f"Plain mode (every model kept) draws later images in {span(plain)}: the only mode measured under "
            f"{TARGET_LATER_S} s, over 4 GB.")


TABLES = {"app-advice": app_advice, "startup-levers": startup_levers, "startup-phases": startup_phases, "startup-targets": startup_targets,
          "startup-app": startup_app, "img2img-sd21": img2img_sd21, "img2img-encoder": img2img_encoder}
