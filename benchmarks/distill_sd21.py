"""SD-2.1 size through `pocketdiff distill` and `pocketdiff prune`: the pieces of
scripts/gpu/sd21_distill.sh (one GPU) and scripts/gpu/sd21_distill_ngpu.sh (N GPUs).

    python benchmarks/distill_sd21.py teacher DIR [--arch sd21 --resolution 512]
        build an SD-size pipeline with random weights (once) and save it as a diffusers folder
    python benchmarks/distill_sd21.py summary --out A.json [--out B.json] --distill DIR --bench BENCH.json
        [--default-bench D.json] [--prune DIR] [--meta META.json]
        one JSON: per round the verb's steady samples/s, first step (compilation apart), peak GPU
        memory, next to distill_step.py's matching variant at the same batch (guided stage:
        ours_guided, progressive rounds after it: ours_wcond, a consistency stage: ours_lcm) and
        their ratio; disk (du) of the
        run and of each round folder; the largest batch under the memory cap; prune's wall time,
        peak memory, and whether its output loads with our loader
    python benchmarks/distill_sd21.py scaling --out S.json --one DIR --multi DIR [--resumed DIR ...]
        weak scaling per round (N-GPU samples/s / (N x 1-GPU samples/s)) and the loss
        trajectories of the resumed runs next to the uninterrupted one

Every number comes from files the verbs wrote (report.json, logs.jsonl), not from this script's
own clock; META.json carries what the shell measured (exit codes, wall times, du, nvidia-smi).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from _checkout import use_checkout  # noqa: E402

use_checkout()


def read(path) -> dict:
    p = Path(path) if path else None
    return json.loads(p.read_text()) if p and p.is_file() else {}


def read_config(run: Path) -> dict:
    """The config the CLI wrote into the output folder (config.yaml)."""
    from omegaconf import OmegaConf

    f = run / "config.yaml"
    return OmegaConf.to_container(OmegaConf.load(f)) if f.is_file() else {}


def log_rows(run: Path) -> list[dict]:
    """The rows of a run's logs.jsonl (none when there is no file)."""
    path = Path(run) / "logs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


# the config section that trains each stage, and distill_step.py's variant that measures its step
STAGE_SECTION = {"guided": "guided", "progressive": "progressive", "consistency": "consistency"}
BENCH_VARIANT = {"guided": "ours_guided", "progressive": "ours_wcond", "consistency": "ours_lcm"}


def stage_batch(cfg: dict, stage: str):
    """The global batch of a distill stage ("guided", "progressive" or "consistency") in a run's config."""
    return ((cfg.get(STAGE_SECTION[stage]) or {}).get("train") or {}).get("batch_size")


def du_bytes(*paths) -> int:
    """Bytes on disk of `paths` together (du counts a file hardlinked between them once)."""
    paths = [str(p) for p in paths if Path(p).exists()]
    if not paths:
        return 0
    out = subprocess.run(["du", "-scb", *paths], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def build_teacher(args) -> int:
    import torch

    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captions
    from pocketdiff.models import ModelConfig, build_pipeline, count_params, save_pipeline

    out = Path(args.dir)
    if (out / "model_index.json").is_file():
        print(f"[distill_sd21] teacher {out} exists")
        return 0
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    captions = load_captions(DataConfig(source="shapes", shapes_count=64, resolution=args.resolution))
    pipe = build_pipeline(ModelConfig(arch=args.arch, prediction_type="epsilon"), captions=captions, resolution=args.resolution)
    tmp = out.with_name(out.name + ".tmp")
    save_pipeline(pipe, tmp)
    tmp.rename(out)
    print(f"[distill_sd21] teacher {out}: UNet {count_params(pipe.unet) / 1e6:.0f} M params")
    return 0


def _bench_variant(bench: dict, name: str, batch: int):
    v = bench.get("variants", {})
    return v.get(f"{name}@{batch}") or (v.get(name) if bench.get("batch") == batch else None)


def distill_summary(run: Path, bench: dict) -> dict:
    report, rows, cfg = read(run / "report.json"), log_rows(run), read_config(run)
    rounds = []
    for r in report.get("rounds", []):
        t = r.get("timing") or {}
        steps_rows = [x for x in rows if x.get("phase") == f"round-{r['round']}" and "loss" in x]
        variant = BENCH_VARIANT[r["stage"]]
        entry = {"round": r["round"], "stage": r["stage"], "steps": r["steps"], "train_steps": r["train_steps"],
                 "steady_samples_per_s": t.get("steady_samples_per_s"), "first_step_s": t.get("first_step_s"), "ema_setup_s": t.get("ema_setup_s"),
                 "warmup_steps": t.get("warmup_steps"), "warmup_s": t.get("warmup_s"),
                 "checkpoint_s": t.get("checkpoint_s"), "peak_gpu_mem_gib": t.get("peak_gpu_mem_gib"),
                 "processes": t.get("processes"), "memory_cap_gib": t.get("memory_cap_gib"),
                 "log_rows": len(steps_rows), "folder_files": r.get("folder_files"), "bench_variant": variant,
                 "step_phases": [x for x in rows if x.get("phase") == f"round-{r['round']}" and x.get("event") == "step_phases"]}
        batch = stage_batch(cfg, r["stage"])
        entry["batch"] = batch
        if r["stage"] == "consistency":  # one stage sampled at several counts: the grids it wrote
            entry["sampled_steps"] = sorted(int(n) for n in (r.get("eval") or {}))
        ref = _bench_variant(bench, variant, batch) if batch else None
        if ref and entry["steady_samples_per_s"]:
            entry["bench_samples_per_s"] = ref["samples_per_s"]
            entry["verb_over_bench"] = entry["steady_samples_per_s"] / ref["samples_per_s"]
            entry["bench_peak_mem_gib"] = ref.get("peak_mem_gib")
        entry["folder_bytes_standalone"] = du_bytes(run / f"round-{r['round']}")
        rounds.append(entry)
    return {"method": report.get("method"), "complete": report.get("complete"), "rounds": rounds, "run_bytes": du_bytes(run),
            "checkpoint_bytes": du_bytes(run / "checkpoints"),
            "peak_gpu_mem_gib": max((x["peak_gpu_mem_gib"] or 0 for x in rounds), default=None)}


def prune_summary(run: Path) -> dict:
    report, rows = read(run / "report.json"), log_rows(run)
    out = {"report_keys": sorted(report), "pipeline_dir": report.get("pipeline_dir"),
           "recovery_peak_gpu_mem_gib": max((x.get("peak_gpu_mem_gib") or 0 for x in rows), default=None),
           "recovery_samples_per_s": [x.get("samples_per_s") for x in rows if "loss" in x][-1:] or None,
           "run_bytes": du_bytes(run)}
    for key in ("params", "unet_params", "params_before", "params_after", "ratio_removed", "parity", "probe"):
        if key in report:
            out[key] = report[key]
    folder = report.get("pipeline_dir")
    if folder:
        try:
            from pocketdiff.models import count_params, load_pipeline

            pipe = load_pipeline(str(folder))
            out["loads"] = True
            out["loaded_unet_params"] = count_params(pipe.unet)
        except Exception as e:  # noqa: BLE001 - the failure is the finding
            out["loads"] = False
            out["load_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


def ablation_row(spec: str, bench: dict, meta: dict) -> dict:
    """`DIR=overrides` of one ablation run -> its steady rate, phases and ratio to the bench's ours_wcond."""
    folder, _, overrides = spec.partition("=")
    run = Path(folder)
    name = run.name.removeprefix("ablate_")
    d = distill_summary(run, bench) if (run / "report.json").is_file() else {"rounds": []}
    r = d["rounds"][0] if d["rounds"] else {}
    return {"name": name, "overrides": overrides.replace(";", " "), "exit": meta.get(f"ablate_{name}_exit"),
            **{k: r.get(k) for k in ("batch", "steady_samples_per_s", "bench_samples_per_s", "verb_over_bench",
                                     "peak_gpu_mem_gib", "first_step_s", "warmup_s", "step_phases")}}


def summary(args) -> int:
    bench = read(args.bench)
    result = {"benchmark": "distill_sd21", "meta": read(args.meta), "bench": {
        "device": bench.get("device"), "settings": bench.get("settings"), "batch_sweep": bench.get("batch_sweep")}}
    sweep = [r for r in bench.get("batch_sweep") or [] if not r.get("oom")]
    if sweep:
        best = max(r["batch"] for r in sweep)
        result["largest_batch_under_cap"] = {"batch": best, "cap_gib": (bench.get("settings") or {}).get("memory_cap_gib"),
                                             "rows": [r for r in sweep if r["batch"] == best]}
    default = read(args.default_bench)
    if default:
        result["default_settings"] = {k: {"samples_per_s": v.get("samples_per_s"), "peak_mem_gib": v.get("peak_mem_gib")}
                                      for k, v in default.get("variants", {}).items()}
        result["default_settings_note"] = ("distill_step.py with the trainer's defaults (AdamW, no gradient checkpointing, "
                                           "bf16 teacher), no cap: the step's peak on an 80 GB card")
    if args.distill:
        result["distill"] = distill_summary(Path(args.distill), bench)
    if args.prune:
        result["prune"] = prune_summary(Path(args.prune))
    if args.vsweep:  # larger batches through the verb: one progressive round each under the same cap
        rows = []
        for run in map(Path, args.vsweep):
            if not run.exists():
                continue
            rounds = read(run / "report.json").get("rounds") or []
            t = (rounds[0].get("timing") or {}) if rounds else {}
            batch = int(run.name.rsplit("_", 1)[-1])
            rows.append({"batch": batch, "completed": bool(rounds), "exit": (result["meta"] or {}).get(f"vsweep_{batch}_exit"),
                         "steady_samples_per_s": t.get("steady_samples_per_s"), "peak_gpu_mem_gib": t.get("peak_gpu_mem_gib")})
        result["verb_batch_sweep"] = rows
        ran = [r for r in rows if r["completed"]]
        prog = next((r for r in (result.get("distill") or {}).get("rounds", []) if r["stage"] == "progressive"), None)
        if prog:  # the distill run's own batch ran under the same cap
            ran.append({k: prog[k] for k in ("batch", "steady_samples_per_s", "peak_gpu_mem_gib")})
        if ran:
            result["largest_verb_batch_under_cap"] = max(ran, key=lambda r: r["batch"] or 0)
    if args.ablate:  # one progressive round per setting, at the distill run's batch, against the bench's ours_wcond
        result["verb_ablations"] = [ablation_row(spec, bench, result["meta"] or {}) for spec in args.ablate]
    text = json.dumps(result, indent=2)
    for out in args.out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    d = result.get("distill") or {}
    for r in d.get("rounds", []):
        print(f"[distill_sd21] round {r['round']} ({r['stage']}): {r['steady_samples_per_s'] or 0:.2f} samples/s "
              f"(bench {r.get('bench_samples_per_s') or 0:.2f}, ratio {r.get('verb_over_bench') or 0:.2f}), "
              f"first step {r['first_step_s'] or 0:.1f} s, peak {r['peak_gpu_mem_gib']} GiB")
    if d:
        print(f"[distill_sd21] method {d['method']}, peak {d['peak_gpu_mem_gib']} GiB")
        print(f"[distill_sd21] distill run on disk: {d['run_bytes'] / 2**30:.2f} GiB (checkpoints {d['checkpoint_bytes'] / 2**30:.2f} GiB)")
    if "largest_batch_under_cap" in result:
        print(f"[distill_sd21] largest batch under the cap: {result['largest_batch_under_cap']['batch']}")
    for r in result.get("verb_batch_sweep", []):
        print(f"[distill_sd21] verb at batch {r['batch']}: exit {r['exit']}, {r['steady_samples_per_s'] or 0:.2f} samples/s, "
              f"peak {r['peak_gpu_mem_gib']} GiB")
    for r in result.get("verb_ablations", []):
        print(f"[distill_sd21] ablation {r['name']} ({r['overrides'] or 'smoke settings'}): {r['steady_samples_per_s'] or 0:.2f} samples/s, "
              f"ratio {r.get('verb_over_bench') or 0:.2f}, peak {r['peak_gpu_mem_gib']} GiB")
    if "prune" in result:
        p = result["prune"]
        print(f"[distill_sd21] prune: loads={p.get('loads')} recovery peak {p.get('recovery_peak_gpu_mem_gib')} GiB")
    return 0


def window_rate(rows: list[dict], round_index: int, batch, after_step: int, until_step: int | None = None):
    """Samples/s of a run's log windows of round `round_index` that end after `after_step` (and at or
    before `until_step`; checkpoint saves left out, as the loop leaves them out of each row's rate): the
    rate once later warm-up is over."""
    rows = [r for r in rows if r.get("phase") == f"round-{round_index}" and "loss" in r]
    samples = seconds = 0.0
    for prev, row in zip(rows, rows[1:]):
        if row["step"] > after_step and (until_step is None or row["step"] <= until_step) and row.get("samples_per_s") and batch:
            n = (row["step"] - prev["step"]) * batch
            samples, seconds = samples + n, seconds + n / row["samples_per_s"]
    return samples / seconds if seconds else None


def weak_scaling(one_gpu, multi_gpu, processes):
    """N processes' samples/s over N times one process's (None when either is missing)."""
    return multi_gpu / (processes * one_gpu) if one_gpu and multi_gpu and processes else None


def round_rows(one: dict, multi: dict, logs: dict, late: list[int], windows: list[str]) -> list[dict]:
    """Per round: both runs' steady samples/s, the weak scaling, and the same over later log windows."""
    rounds = []
    for a, b in zip(one.get("rounds", []), multi.get("rounds", [])):
        ta, tb = a.get("timing") or {}, b.get("timing") or {}
        s1, sn, n = ta.get("steady_samples_per_s"), tb.get("steady_samples_per_s"), tb.get("processes")
        row = {"round": a["round"], "stage": a["stage"], "processes": n, "steps_run": tb.get("steps_run"), "steady_steps": tb.get("steady_steps"),
               "one_gpu_samples_per_s": s1, "multi_gpu_samples_per_s": sn, "weak_scaling": weak_scaling(s1, sn, n),
               "one_gpu_peak_gpu_mem_gib": ta.get("peak_gpu_mem_gib"), "multi_gpu_peak_gpu_mem_gib": tb.get("peak_gpu_mem_gib"),
               "slowest_steady_step": {"one_gpu": [ta.get("slowest_steady_step"), ta.get("slowest_steady_step_s")],
                                       "multi_gpu": [tb.get("slowest_steady_step"), tb.get("slowest_steady_step_s")]}}
        spans = [(f"after_step_{after}", after, None) for after in late]  # the loop's own rate starts at step 3
        spans += [(f"window_{w.replace(':', '_')}", int(w.split(":")[0]), int(w.split(":")[1])) for w in windows]
        for key, after, until in spans:  # the same ratio over the log windows of a later span of steps
            l1, ln = (window_rate(rows, a["round"], stage_batch(cfg, a["stage"]), after, until)
                      for rows, cfg in (logs["one"], logs["multi"]))
            row[key] = {"one_gpu_samples_per_s": l1, "multi_gpu_samples_per_s": ln, "weak_scaling": weak_scaling(l1, ln, n)}
        rounds.append(row)
    return rounds


def scaling(args) -> int:
    one, two = read(Path(args.one) / "report.json"), read(Path(args.multi) / "report.json")
    logs = {k: (log_rows(Path(d)), read_config(Path(d))) for k, d in (("one", args.one), ("multi", args.multi))} if args.late or args.window else {}
    rounds = round_rows(one, two, logs, args.late or [], args.window or [])
    for spec in args.alt or []:  # more 2-GPU runs (other settings) against the same 1-GPU run
        name, _, folder = spec.partition("=")
        alt = read(Path(folder) / "report.json")
        for r, b in zip(rounds, alt.get("rounds", [])):
            tb = b.get("timing") or {}
            r[f"multi_gpu_{name}_samples_per_s"] = tb.get("steady_samples_per_s")
            r[f"multi_gpu_{name}_peak_gpu_mem_gib"] = tb.get("peak_gpu_mem_gib")
            r[f"weak_scaling_{name}"] = weak_scaling(r["one_gpu_samples_per_s"], tb.get("steady_samples_per_s"), tb.get("processes"))
    result = {"benchmark": "distill_sd21_scaling", "rounds": rounds, "meta": read(args.meta), "resumes": {}}
    ref = {r["round"]: r["losses"] for r in two.get("rounds", [])}
    for d in args.resumed or []:
        rep = read(Path(d) / "report.json")
        result["resumes"][Path(d).name] = {
            "complete": rep.get("complete"),
            "rounds": [{"round": r["round"], "losses": r["losses"], "uninterrupted_losses": ref.get(r["round"]),
                        "processes": (r.get("timing") or {}).get("processes")} for r in rep.get("rounds", [])[-1:]]}
    bench = read(args.bench)
    if bench:  # the 1-GPU run's rounds against the benchmark's matching variant, measured before it on the same GPU
        result["bench"] = {"settings": bench.get("settings"), "batch_sweep": bench.get("batch_sweep")}
        for r, a in zip(rounds, one.get("rounds", [])):
            ref = _bench_variant(bench, BENCH_VARIANT[a["stage"]], args.batch)
            if ref and r["one_gpu_samples_per_s"]:
                r["bench_samples_per_s"] = ref["samples_per_s"]
                r["one_gpu_verb_over_bench"] = r["one_gpu_samples_per_s"] / ref["samples_per_s"]
    text = json.dumps(result, indent=2)
    for out in args.out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    for r in rounds:
        print(f"[distill_sd21] round {r['round']}: 1 GPU {r['one_gpu_samples_per_s'] or 0:.2f}, {r['processes']} GPUs "
              f"{r['multi_gpu_samples_per_s'] or 0:.2f} samples/s, weak scaling {r['weak_scaling'] or 0:.2f}"
              + (f", 1 GPU verb/bench {r['one_gpu_verb_over_bench']:.2f}" if r.get("one_gpu_verb_over_bench") else "")
              + "".join(f", {k.removeprefix('weak_scaling_')} {v:.2f}" for k, v in r.items()
                        if k.startswith("weak_scaling_") and v)
              + "".join(f", {k} {v['weak_scaling']:.2f}" for k, v in r.items()
                        if k.startswith(("after_step_", "window_")) and v["weak_scaling"]))
    for name, r in result["resumes"].items():
        print(f"[distill_sd21] resume {name}: complete={r['complete']}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("teacher")
    t.add_argument("dir")
    t.add_argument("--arch", default="sd21")
    t.add_argument("--resolution", type=int, default=512)
    s = sub.add_parser("summary")
    s.add_argument("--out", action="append", required=True)
    s.add_argument("--distill")
    s.add_argument("--prune")
    s.add_argument("--bench")
    s.add_argument("--default-bench")
    s.add_argument("--meta")
    s.add_argument("--vsweep", action="append", help="run folders of the verb batch sweep (NAME_<batch>)")
    s.add_argument("--ablate", action="append", help="DIR=overrides of an ablation run (ablate_<name>)")
    c = sub.add_parser("scaling")
    c.add_argument("--out", action="append", required=True)
    c.add_argument("--one", required=True)
    c.add_argument("--multi", "--two", dest="multi", required=True, help="the run under accelerate launch (N processes)")
    c.add_argument("--resumed", action="append")
    c.add_argument("--bench", help="distill_step.py JSON measured on the 1-GPU run's device")
    c.add_argument("--batch", type=int, help="the 1-GPU run's batch (the bench row it is compared with)")
    c.add_argument("--late", type=int, action="append", help="also the rates over the log windows ending after this step")
    c.add_argument("--window", action="append", help="A:B: also the rates over the log windows ending in A < step <= B")
    c.add_argument("--alt", action="append", help="NAME=DIR: another N-GPU run (other settings) against the same 1-GPU run")
    c.add_argument("--meta")
    args = p.parse_args(argv)
    return {"teacher": build_teacher, "summary": summary, "scaling": scaling}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
