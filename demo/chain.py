"""`pocketdiff demo`: the whole chain on the embedded default, one report page at the end.

1. distill the shipped shapes teacher to a guidance-conditioned 4-step student
2. calibrate the student to W8 (block reconstruction, real int8 codes)
3. prune the student's large convolutions and recover by distillation
4. evaluate teacher, student, W8 student and pruned student on the same prompts and seeds
5. export the W8 student as a bundle that must run entirely on the LiteRT GPU delegate
6. run the bundle on the GPU delegate (lavapipe when the machine has no GPU)

Each stage runs exactly as its verb does (`pocketdiff.cli.run_stage`) with the recipes in
`configs/demo/`; `--smoke` shrinks every stage so the chain finishes in a few minutes.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import EMBEDDED_TEACHER
from pocketdiff.outputs import prepare_output_dir, read_json, write_json
from pocketdiff.report import img, table, write_page

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "demo"
PROMPTS = [
    "a large red circle in the center", "a small blue square at the top left",
    "a large green triangle at the bottom right", "a small yellow star in the center",
]

# Overrides that shrink each stage for `--smoke` (the chain and its checks stay the same).
SMOKE = {
    "distill": ["guided.train.max_steps=6", "progressive.train.max_steps=6", "progressive.start_steps=8",
                "data.shapes_count=128", "guided.train.batch_size=8", "progressive.train.batch_size=8"],
    "calibrate": ["calib.num_prompts=2", "calib.holdout_prompts=1", "recon.iters=10", "output.samples=2"],
    "prune": ["train.max_steps=4", "train.batch_size=8", "data.shapes_count=64", "eval.probe_samples=8"],
    "export": ["fp16_scan.enabled=false"],
}


def _config(name: str) -> str:
    path = CONFIGS / f"{name}.yaml"
    if not path.is_file():
        raise PocketdiffError(f"demo recipe {path} is missing (the demo runs from a pocketdiff checkout)")
    return str(path)


class _Chain:
    """Runs stages in order, timing each and printing a one-line status."""

    def __init__(self, out: Path, smoke: bool):
        self.out, self.smoke, self.timings, self.reports = out, smoke, {}, {}

    def stage(self, index: int, name: str, fn: Callable[[], dict]) -> dict:
        print(f"[demo {index}/6] {name} ...", flush=True)
        start = time.time()
        report = fn()
        self.timings[name] = round(time.time() - start, 1)
        self.reports[name] = report
        print(f"[demo {index}/6] {name} done in {self.timings[name]} s", flush=True)
        return report

    def verb(self, verb: str, recipe: str, overrides: list[str]) -> dict:
        from pocketdiff.cli import run_stage

        extra = SMOKE.get(recipe, []) if self.smoke else []
        return run_stage(verb, _config(recipe), self.out / recipe, overrides + extra, overwrite=True)


def _evaluate(chain: _Chain, teacher: str, student: str, w8: str, pruned: str, steps: int) -> dict:
    from pocketdiff.compress.prune import load_pruned_pipeline
    from pocketdiff.evaluate import MetricConfig, MetricSetup, ModelSpec, evaluate_pipelines
    from pocketdiff.config import DataConfig

    n = 16 if chain.smoke else 64
    setup = MetricSetup(MetricConfig(features="clip", clip="pocketdiff:clip-shapes"),
                        reference=DataConfig(source="shapes", shapes_count=256 if chain.smoke else 1024, resolution=32))
    prompts = setup.reference_captions()[:n]
    pruned_pipe = load_pruned_pipeline(pruned)
    models = [
        ModelSpec(name=f"teacher DDIM {steps}", path=teacher, steps=[steps]),
        ModelSpec(name="teacher DDIM 16", path=teacher, steps=[16]),
        ModelSpec(name=f"student {steps}", path=student),
        ModelSpec(name=f"student W8 {steps}", path=w8),
        {"name": f"pruned student {steps}", "pipe": pruned_pipe},
    ]
    results = evaluate_pipelines(models, prompts, [steps], setup, chain.out / "evaluate", seeds=[0], guidance_scale=3.0,
                                 grid_prompts=4)
    return {"results": results}


def run_demo(out: Path, smoke: bool) -> dict:
    chain = _Chain(out, smoke)
    distill = chain.stage(1, "distill", lambda: chain.verb("distill", "distill", []))
    student, steps = distill["pipeline_dir"], int(distill["final_steps"])
    calib = chain.stage(2, "calibrate", lambda: chain.verb("calibrate", "calibrate", [f"model.pretrained={student}"]))
    prune = chain.stage(3, "prune", lambda: chain.verb("prune", "prune", [f"model.pretrained={student}"]))
    teacher = EMBEDDED_TEACHER
    evaluation = chain.stage(4, "evaluate", lambda: _evaluate(chain, teacher, student, calib["pipeline_dir"],
                                                               prune["pipeline_dir"], steps))
    export = chain.stage(5, "export", lambda: chain.verb("export", "export", [
        f"model.pretrained={student}", f"int8.checkpoint={calib['checkpoint']}", f"steps={steps}"]))
    bundle = export["bundle_dir"]

    def run_bundle() -> dict:
        from pocketdiff.runtime.run_bundle import main as run_bundle_main

        from pocketdiff.cli import build_parser  # the verb's own options and defaults

        run_bundle_main(build_parser().parse_args(["run-bundle", bundle, "--prompt", PROMPTS[0], "--output",
                                                   str(out / "run-bundle"), "--pipelined", "--overwrite"]))
        return read_json(out / "run-bundle" / "report.json")

    ran = chain.stage(6, "run-bundle", run_bundle)
    return _summary(chain, student, steps, calib, prune, evaluation, export, ran)


def _bundle_bytes(bundle: str) -> int:
    return sum(p.stat().st_size for p in Path(bundle).rglob("*") if p.is_file())


def _summary(chain, student, steps, calib, prune, evaluation, export, ran) -> dict:
    out = chain.out
    components = export.get("components", {})
    report = {
        "smoke": chain.smoke,
        "teacher": EMBEDDED_TEACHER,
        "student": {"pipeline_dir": student, "steps": steps},
        "calibrate": {"checkpoint": calib.get("checkpoint"), "unet_cosine": calib.get("unet_cosine"), "bits": calib.get("bits")},
        "prune": {"pipeline_dir": prune.get("pipeline_dir"), "params_before": prune.get("params_before"),
                  "params_after": prune.get("params_after")},
        "metrics": [{k: r.get(k) for k in ("model", "steps", "fd", "clip_score", "features", "num_samples")}
                    for r in evaluation["results"]],
        "bundle": {"dir": export.get("bundle_dir"), "bytes": _bundle_bytes(export["bundle_dir"]),
                   "components": {k: {f: v.get(f) for f in ("fully_accelerated", "cosine", "psnr_db", "bytes")}
                                  for k, v in components.items()}},
        "run_bundle": {k: ran.get(k) for k in ("image", "accelerator", "driver", "fully_accelerated", "latency_s", "peak_rss_mb")},
        "timings_s": chain.timings,
    }
    sections = [
        ("Timings (s)", table(["stage", "seconds"], chain.timings.items())),
        ("Quality (same prompts and seeds)", table(["model", "steps", "FD", "CLIP score", "features", "samples"],
                                                   [[m["model"], m["steps"], m["fd"], m["clip_score"], m["features"], m["num_samples"]]
                                                    for m in report["metrics"]])),
        ("Bundle", table(["component", "fully on GPU delegate", "cosine", "PSNR dB", "bytes"],
                         [[k, v["fully_accelerated"], v["cosine"], v["psnr_db"], v["bytes"]] for k, v in report["bundle"]["components"].items()])
         + f"<p>total {report['bundle']['bytes'] / 1e6:.2f} MB in {report['bundle']['dir']}</p>"),
    ]
    for name, rel in (("distill", "distill/index.html"), ("calibrate", "calibrate/index.html"), ("prune", "prune/index.html"),
                      ("evaluate", "evaluate/index.html"), ("export", "export/index.html")):
        if (out / rel).is_file():
            sections.append((f"Stage page: {name}", f"<a href='{rel}'>{rel}</a>"))
    grids = sorted((out / "evaluate").glob("*.png"))
    if grids:
        sections.append(("Grids (evaluate)", "".join(img(str(g.relative_to(out))) for g in grids)))
    image = Path(ran.get("image", ""))
    if image.is_file():
        sections.append((f"run-bundle on the {ran.get('accelerator')} delegate ({ran.get('driver')})", img(str(image.relative_to(out.resolve())))))
    write_page(out / "index.html", "pocketdiff demo", sections, report)
    return report


def _print_summary(report: dict, out: Path) -> None:
    print("\npocketdiff demo summary")
    print(f"  student: {report['student']['steps']} steps, W8 UNet cosine {report['calibrate']['unet_cosine']:.6f}")
    print(f"  pruned UNet params: {report['prune']['params_before']} -> {report['prune']['params_after']}")
    for m in report["metrics"]:
        fd = "n/a" if m["fd"] is None else f"{m['fd']:.4g}"
        cs = "n/a" if m["clip_score"] is None else f"{m['clip_score']:.4g}"
        print(f"  {m['model']:<24} FD {fd:>8}  CLIP {cs:>8}  ({m['features']}, {m['num_samples']} samples)")
    for k, v in report["bundle"]["components"].items():
        cos = "n/a" if v["cosine"] is None else f"{v['cosine']:.6f}"
        print(f"  bundle {k:<13} fully on GPU delegate: {v['fully_accelerated']}  cosine {cos}")
    rb = report["run_bundle"]
    lat = rb.get("latency_s") or {}
    print(f"  run-bundle ({rb['accelerator']}, {rb['driver']}): {lat.get('total', float('nan')):.2f} s, "
          f"UNet step {1000 * lat.get('unet_step_mean', float('nan')):.1f} ms -> {rb['image']}")
    print("  seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in report["timings_s"].items())
          + f" (total {sum(report['timings_s'].values()):.0f})")
    print(f"  report: {out / 'index.html'}")
    print(f"  third-party logs: {out / 'logs' / 'native.log'} (shown with --verbose)")


def main(args: argparse.Namespace) -> int:
    from pocketdiff.outputs import finish_output_dir
    from pocketdiff.shipped import ASSETS

    out = prepare_output_dir(args.output, overwrite=args.overwrite, inputs=[("demo recipes", CONFIGS), ("shipped models", ASSETS)], verb="demo")
    report = run_demo(out, smoke=args.smoke)
    write_json(out / "report.json", report)
    finish_output_dir(out)
    _print_summary(report, out)
    return 0
