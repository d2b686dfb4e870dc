"""The text encoder on the CPU (run-bundle --on-cpu text_encoder): where its time goes, before and after the CPU
variant folds fp16 biases (runtime/cpu_variant.py, VARIANT_VERSION 2).

For each chunk of a bundle's int8 text encoder, two CPU variants are written to a temporary folder: `before` (int8
constants to fp16 / float32 only: VARIANT_VERSION 1's graph) and `after` (fp16_variant today). Each is loaded the way
run-bundle loads a CPU model (LoadedModel on "cpu": ai-edge-litert's CompiledModel, XNNPACK, CpuOptions.num_threads),
side by side in this process for each thread count: load seconds, first run, later runs (median), the process's CPU
seconds per later run (threads at work: ~threads x wall on an idle machine). The XNNPACK partitions and the ops left to
TFLite's own kernels are read from ai-edge-litert's Interpreter (its execution plan's DELEGATE nodes). The three
chunks run as a chain from one token row; the two chains' last outputs are compared (max |diff|, PSNR over the range).

    python benchmarks/te_cpu_profile.py BUNDLE_DIR [--threads 1 2] [--runs 3] [--out benchmarks/results/te_cpu_profile_cpu.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def write_variants(src: str, folder: Path) -> dict[str, str]:
    from pocketdiff.runtime.cpu_variant import dequantize_int8_to_fp16, direct_int8_filters_to_float, fp16_variant
    from pocketdiff.runtime.tflite_file import TfliteModel

    name = Path(src).stem
    before, after = folder / f"{name}.before.tflite", folder / f"{name}.after.tflite"
    m = TfliteModel(src)
    dequantize_int8_to_fp16(m)
    direct_int8_filters_to_float(m)
    m.save(before)
    fp16_variant(src, after)
    return {"before": str(before), "after": str(after)}


def delegation(path: str) -> dict:
    """XNNPACK partitions and the op kinds TFLite runs itself (not in any partition), from the Interpreter's plan."""
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=path, num_threads=1)
    it.allocate_tensors()
    ops = it._get_ops_details()
    parts = [o for o in ops if o["op_name"] == "DELEGATE"]
    d_in = {t for o in parts for t in o["inputs"]}
    d_out = {t for o in parts for t in o["outputs"]}
    need = d_in | {d["index"] for d in it.get_output_details()}
    own, changed = set(), True
    while changed:  # an op is TFLite's own when its outputs are read outside the partitions and no partition makes them
        changed = False
        for o in ops:
            outs = set(o["outputs"])
            if o["op_name"] != "DELEGATE" and o["index"] not in own and outs & need and not outs & d_out:
                own.add(o["index"])
                need |= set(o["inputs"])
                changed = True
    kinds = collections.Counter(o["op_name"] for o in ops if o["index"] in own)
    return {"xnnpack_partitions": len(parts), "ops": sum(1 for o in ops if o["op_name"] != "DELEGATE"),
            "ops_not_delegated": dict(sorted(kinds.items()))}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def time_chain(paths: list[str], threads: int, runs: int, first: dict) -> tuple[list[dict], np.ndarray]:
    from pocketdiff.runtime.loaded_model import LoadedModel

    rows, feeds = [], first
    for path in paths:
        t0 = time.perf_counter()
        lm = LoadedModel(Path(path).stem, {"_path": path, "weights": "float"}, "cpu", cpu_threads=threads)
        load = time.perf_counter() - t0
        out = lm.run_all(feeds)[0]
        cpu = []
        for _ in range(runs):
            c0 = cpu_seconds()
            out = lm.run_all(feeds)[0]
            cpu.append(cpu_seconds() - c0)
        later = statistics.median(lm.run_s[1:])
        rows.append({"chunk": Path(path).name.split(".")[1], "threads": threads, "load_s": round(load, 3),
                     "first_run_s": round(lm.run_s[0], 3), "later_run_s": round(later, 3),
                     "later_runs_s": [round(s, 3) for s in lm.run_s[1:]],
                     "cpu_s_per_later_run": round(statistics.median(cpu), 3)})
        lm.close()
        feeds = {"hidden": out}
    return rows, out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/te_cpu_profile_cpu.json")
    a = ap.parse_args(argv)
    from pocketdiff.runtime.gpu_cache import litert_version
    from pocketdiff.runtime.cpu_variant import fp16_biases_to_float  # noqa: F401  (fails early on a checkout without the fix)

    bundle = Path(a.bundle)
    comps = json.loads((bundle / "manifest.json").read_text())["components"]
    chunks = sorted((k for k in comps if k.startswith("text_encoder")), key=lambda k: (len(k), k))
    vocab_ids = np.random.RandomState(0).randint(0, 1024, size=(1, 77)).astype(np.int32)  # within any tiny vocab
    result = {"what": "text encoder chunks on the CPU (XNNPACK), CPU variant before/after fp16 bias folding",
              "bundle": bundle.name, "chunks": chunks, "machine": platform.processor() or platform.machine(),
              "cores": len(os.sched_getaffinity(0)), "litert": litert_version(),
              "runs": a.runs, "rows": [], "delegation": {}, "outputs": {}}
    with tempfile.TemporaryDirectory(prefix="te-cpu-profile-") as tmp:
        variants = {c: write_variants(str(bundle / comps[c]["path"]), Path(tmp)) for c in chunks}
        for c in chunks:
            result["delegation"][c] = {v: delegation(p) for v, p in variants[c].items()}
        last = {}
        for threads in a.threads:
            for v in ("before", "after"):
                rows, last[v] = time_chain([variants[c][v] for c in chunks], threads, a.runs, {"input_ids": vocab_ids})
                result["rows"] += [dict(r, variant=v) for r in rows]
                print(json.dumps(result["rows"][-len(rows):]), flush=True)
    diff = np.abs(last["after"].astype(np.float64) - last["before"])
    rng = float(last["before"].max() - last["before"].min())
    result["outputs"] = {"max_abs_diff": float(diff.max()), "range": rng,
                         "psnr_db_after_vs_before": float(10 * np.log10(rng ** 2 / max(float((diff ** 2).mean()), 1e-30)))}
    summary = {}
    for threads in a.threads:
        tot = {v: sum(r["later_run_s"] for r in result["rows"] if r["variant"] == v and r["threads"] == threads)
               for v in ("before", "after")}
        summary[f"threads_{threads}"] = {"before_s": round(tot["before"], 3), "after_s": round(tot["after"], 3),
                                         "speedup": round(tot["before"] / tot["after"], 2)}
    result["summary"] = summary
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"summary": summary, "outputs": result["outputs"]}))
    return result


if __name__ == "__main__":
    main()
