"""The README sentence and the docs/MEASUREMENTS.md sections of scripts/gpu/sdxl_size.sh's rows, with the numbers
filled in from the committed result files (so that no figure is copied by hand):

    python benchmarks/sdxl_size_text.py --distill benchmarks/results/sdxl_distill_step_h100.json \\
        --calibrate benchmarks/results/sdxl_calibrate_h100.json [--date 2026-12-07]

prints three blocks: the Distill section (after "SD-2.1 size: the distillation step"), the Calibrate section (after
"SD-2.1 size through the verb"), and the README sentence that replaces "Not yet measured at SDXL size on a GPU".
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Optional

VARIANT_TEXT = {
    "eager": "eager: diffusers' default step (fp32 weights under bf16 autocast, cond / uncond as two calls, foreach AdamW)",
    "ours_eager": "ours, the same two-step progressive target (4 teacher passes)",
    "ours_wcond": "ours, a progressive round's step (the w-conditioned teacher: 2 teacher passes)",
    "ours_guided": "ours, the guided stage's step",
    "ours_lcm": "ours, the consistency step (cond + uncond teacher, the live student as target)",
    "ours": "ours, compiled (the same target as eager)",
}
LEVER_TEXT = (("teacher_dtype", "bf16 teacher weights", "bfloat16"), ("fused_cond_uncond", "one cond/uncond batch", True),
              ("channels_last", "channels_last", True), ("cudnn_benchmark", "cudnn.benchmark", True),
              ("fused_adamw", "fused AdamW", True), ("compiled", "torch.compile", True))


def levers(row: dict) -> str:
    on = [text for key, text, value in LEVER_TEXT if (row.get("levers") or {}).get(key) == value]
    return ", ".join(on) or "none"


def _gib(v) -> str:
    return "n/a" if v is None else f"{v / 2 ** 30:.1f} GiB"


def distill_section(d: dict, file: str, date: str) -> str:
    rows = [r for r in d.get("rows", [])]
    batches = sorted({r["batch"] for r in rows})
    head = (f"### SDXL size: the distillation step ({d.get('device')}, {date})\n\n"
            f"`bash scripts/gpu/sdxl_size.sh`: `benchmarks/distill_step.py --arch sdxl --batch "
            f"{','.join(str(b) for b in batches)} --flops off` (SDXL base's UNet, {d.get('unet_params', 0) / 1e6:,.0f} M "
            f"parameters, random weights with perturbed norm affines; 1024 px = {d.get('latent')}×{d.get('latent')} latents; "
            f"both text encoders' hidden states, the pooled embedding and the time ids; {d.get('dtype')}; every step side by "
            f"side in one process; torch {d.get('torch')}; `benchmarks/results/{file}`):\n\n"
            "| step | batch | samples/s | × eager | peak GPU | × eager's memory | levers on |\n|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        name = VARIANT_TEXT.get(r["variant"], r["variant"])
        if r.get("oom"):
            lines.append(f"| {name} | {r['batch']} | out of memory | – | – | – | {levers(r)} |")
            continue
        ratio, mem = r.get("samples_per_s_vs_eager"), r.get("peak_mem_vs_eager")
        lines.append(f"| {name} | {r['batch']} | {r['samples_per_s']:.2f} | {'–' if ratio is None else f'{ratio:.2f}'} | "
                     f"{_gib(r.get('peak_mem_bytes'))} | {'–' if mem is None else f'{mem:.2f}'} | {levers(r)} |")
    best = d.get("best")
    verdict = ("no step was measured beside an eager row" if not best else
               f"{'met' if d.get('meets_target') else 'not met'}: the best is {best['variant']} at {best['ratio']:.2f}× "
               f"(batch {best['batch']})")
    compiled = any((r.get("levers") or {}).get("compiled") for r in rows)
    tail = (f"\n\nThe target, ≥ {d.get('target_ratio', 1.5)}× eager's samples/s at the same batch, is {verdict}. "
            + ("torch.compile was on." if compiled else
               "torch.compile was off (compiling an SDXL UNet's step takes minutes; it did not fit the call)."))
    return head + "\n".join(lines) + tail


def _within(ok, target: str) -> str:
    return f"not measured against the {target} target" if ok is None else f"{'within' if ok else 'over'} the {target} target"


def _num(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def calibrate_section(c: dict, file: str, date: str) -> str:
    t, cal, tm = c.get("targets", {}), c.get("calibration", {}), c.get("timings", {})
    host_pred = (c.get("host_memory") or {}).get("predicted_gb")
    phases = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in tm.items())
    return (f"### SDXL size through the verb ({c.get('meta', {}).get('device')}, {date})\n\n"
            "`bash scripts/gpu/sdxl_size.sh`: `pocketdiff calibrate --config configs/sdxl/calibrate_smoke.yaml "
            "model.pretrained=FOLDER` on an SDXL base-shaped folder that `benchmarks/sdxl_size.py build` saved (random weights, "
            "loaded through `StableDiffusionXLPipeline.from_pretrained`), W8, "
            f"{c.get('iters')} iterations per block ({len(c.get('blocks', []))} blocks), {cal.get('samples')} calibration inputs, "
            f"streamed per block, capped at 40 GiB GPU / 48 GiB host (`benchmarks/results/{file}`): {_num(c.get('wall_time_s'), '.0f')} s "
            f"({phases}); peak GPU {_num(t.get('gpu_peak_gib'), '.1f')} GiB ({_within(t.get('gpu_ok'), '40 GiB')}); host peak "
            f"RSS {_num(t.get('host_peak_gib'), '.1f')} GiB ({_within(t.get('host_ok'), '48 GiB')}; predicted "
            f"{_num(host_pred, '.1f')} GiB); UNet cosine {_num(c.get('unet_cosine'), '.6f')} (RTN {_num(c.get('unet_cosine_rtn'), '.6f')})."
            + (f" Under `host_cap_gib: 48` the run was refused before loading (`{refused}`); the figures are its rerun "
               "under 64." if (refused := c.get("meta", {}).get("calibrate_refused_at_cap")) else ""))


def readme_sentence(d: dict, c: Optional[dict], dfile: str, cfile: Optional[str]) -> str:
    best = d.get("best") or {}
    eager = next((r for r in d.get("rows", []) if r["variant"] == "eager" and r["batch"] == best.get("batch")), {})
    ours = next((r for r in d.get("rows", []) if r["variant"] == best.get("variant") and r["batch"] == best.get("batch")), {})
    step = (f"At SDXL size on {d.get('device')} (random weights, 1024 px): the distill step runs at "
            f"{best.get('ratio', float('nan')):.2f}× diffusers' default eager step's samples/s, {_gib(ours.get('peak_mem_bytes'))} "
            f"of GPU against {_gib(eager.get('peak_mem_bytes'))} (`benchmarks/results/{dfile}`); ")
    if c is None:
        return step + "calibrate at SDXL size is not yet measured on a GPU. The phone-path rows above are SD 2.1's."
    t = c.get("targets", {})
    return (step + f"calibrate W8 took {_num(c.get('wall_time_s'), '.0f')} s at {c.get('iters')} iterations per block, "
            f"{_num(t.get('host_peak_gib'), '.1f')} GiB host and {_num(t.get('gpu_peak_gib'), '.1f')} GiB GPU at its peaks "
            f"(`benchmarks/results/{cfile}`). The phone-path rows above are SD 2.1's.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--distill", required=True, help="sdxl_size.sh's sdxl_distill_step_<gpu>.json")
    p.add_argument("--calibrate", help="sdxl_size.sh's sdxl_calibrate_<gpu>.json (left out: a call that measured the step only)")
    p.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
    args = p.parse_args(argv)
    try:
        d = json.loads(Path(args.distill).read_text())
        c = json.loads(Path(args.calibrate).read_text()) if args.calibrate else None
    except (OSError, ValueError) as e:
        print(f"sdxl_size_text: {e}", file=sys.stderr)
        return 2
    dfile, cfile = Path(args.distill).name, (Path(args.calibrate).name if args.calibrate else None)
    parts = [distill_section(d, dfile, args.date)] + ([calibrate_section(c, cfile, args.date)] if c is not None else [])
    print(*parts, readme_sentence(d, c, dfile, cfile), sep="\n\n----\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
