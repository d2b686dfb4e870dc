"""`pocketdiff demo`: the whole chain on the embedded default, one report page at the end.

1. distill the shipped shapes teacher to a guidance-conditioned student, 16 -> 8 -> 4 -> 2 steps
2. calibrate the 2-step student to W8 (block reconstruction, real int8 codes)
3. prune the 2-step student's large convolutions and recover by distillation
4. evaluate, on the same prompts and seeds: the teacher's DDIM at 2, 4 and 16 steps (its own
   grid, and the students' trailing grid at 2 and 4), the 4- and 2-step students, the W8 and
   the pruned 2-step student
5. export the W8 student as a bundle that must run entirely on the LiteRT GPU delegate
6. run the bundle on the GPU delegate (lavapipe when the machine has no GPU)

The summary then states, one line per stage, what the stage buys (UNet passes, bytes, MACs)
and the quality it keeps (`demo.summary`).

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

from .summary import TEACHER, TEACHER_TRAILING, build_report, print_summary, write_index

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "demo"
PROMPTS = [
    "a large red circle in the center", "a small blue square at the top left",
    "a large green triangle at the bottom right", "a small yellow star in the center",
]
REFERENCE_STEPS = 16  # the teacher's DDIM count the students are measured against

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


def _evaluate(chain: _Chain, teacher: str, students: dict[int, str], w8: str, pruned: str) -> dict:
    from pocketdiff.compress.prune import load_pruned_pipeline
    from pocketdiff.evaluate import MetricConfig, MetricSetup, ModelSpec, evaluate_pipelines
    from pocketdiff.config import DataConfig

    n = 16 if chain.smoke else 64
    setup = MetricSetup(MetricConfig(features="clip", clip="pocketdiff:clip-shapes"),
                        reference=DataConfig(source="shapes", shapes_count=256 if chain.smoke else 1024, resolution=32))
    prompts = setup.reference_captions()[:n]
    final = min(students)
    counts = sorted(students)
    models = [
        ModelSpec(name=TEACHER, path=teacher, steps=counts + [REFERENCE_STEPS]),
        ModelSpec(name=TEACHER_TRAILING, path=teacher, steps=counts, scheduler={"timestep_spacing": "trailing"}),
        *[ModelSpec(name=f"student {k}", path=students[k]) for k in sorted(students, reverse=True)],
        ModelSpec(name=f"student W8 {final}", path=w8),
        {"name": f"pruned student {final}", "pipe": load_pruned_pipeline(pruned), "steps": [final]},
    ]
    results = evaluate_pipelines(models, prompts, counts, setup, chain.out / "evaluate", seeds=[0], guidance_scale=3.0,
                                 grid_prompts=4)
    return {"results": results}


def _students(distill: dict) -> dict[int, str]:
    """The final student and the one before it (twice its steps): step count -> pipeline folder."""
    rounds = [r for r in distill["rounds"] if r["stage"] == "progressive"][-2:]
    return {int(r["steps"]): r["pipeline_dir"] for r in rounds}


def run_demo(out: Path, smoke: bool) -> dict:
    chain = _Chain(out, smoke)
    distill = chain.stage(1, "distill", lambda: chain.verb("distill", "distill", []))
    students = _students(distill)
    student, steps = distill["pipeline_dir"], int(distill["final_steps"])
    calib = chain.stage(2, "calibrate", lambda: chain.verb("calibrate", "calibrate", [
        f"model.pretrained={student}", f"calib.steps={steps}"]))
    prune = chain.stage(3, "prune", lambda: chain.verb("prune", "prune", [f"model.pretrained={student}", f"eval.steps={steps}"]))
    evaluation = chain.stage(4, "evaluate", lambda: _evaluate(chain, EMBEDDED_TEACHER, students, calib["pipeline_dir"],
                                                               prune["pipeline_dir"]))
    export = chain.stage(5, "export", lambda: chain.verb("export", "export", [
        f"model.pretrained={student}", f"int8.checkpoint={calib['checkpoint']}", f"steps={steps}", f"fp16_scan.steps={steps}"]))
    bundle = export["bundle_dir"]

    def run_bundle() -> dict:
        from pocketdiff.runtime.run_bundle import main as run_bundle_main

        from pocketdiff.cli import build_parser  # the verb's own options and defaults

        run_bundle_main(build_parser().parse_args(["run-bundle", bundle, "--prompt", PROMPTS[0], "--output",
                                                   str(out / "run-bundle"), "--pipelined", "--overwrite"]))
        return read_json(out / "run-bundle" / "report.json")

    ran = chain.stage(6, "run-bundle", run_bundle)
    report = build_report(chain, students, calib, prune, evaluation, export, ran, REFERENCE_STEPS, EMBEDDED_TEACHER)
    write_index(out, report)
    return report


def main(args: argparse.Namespace) -> int:
    from pocketdiff.outputs import finish_output_dir
    from pocketdiff.shipped import ASSETS

    out = prepare_output_dir(args.output, overwrite=args.overwrite, inputs=[("demo recipes", CONFIGS), ("shipped models", ASSETS)], verb="demo")
    report = run_demo(out, smoke=args.smoke)
    write_json(out / "report.json", report)
    finish_output_dir(out)
    print_summary(report, out)
    return 0
