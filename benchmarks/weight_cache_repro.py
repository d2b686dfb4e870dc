#!/usr/bin/env python
"""The LiteRT GPU accelerator's weight cache on tiny models: which option sets load, which crash, and where, per build.

The accelerator keeps converted weights between launches (`<key>_mldrift_weight_cache.bin`) only on its
"constant tensor sharing" path (`enable_constant_tensors_sharing` with `serialize_external_tensors`,
`serialization_dir`, `model_cache_key`). With the ai-edge-litert wheels (libLiteRt.so and
libLiteRtWebGpuAccelerator.so shipped side by side) every such set dies with SIGSEGV inside
`LiteRtCreateCompiledModel`; with litert-lm-api's liblitert-lm.so (LiteRT's C API and the WebGPU accelerator
linked into ONE library) the same calls load, run and reuse the cache. Each option set runs in a fresh process
(this script's `probe`), cold then warm on one cache folder, per build; its outputs are compared with the CPU
(XNNPACK) outputs of the installed ai-edge-litert; a crash is re-run under cuda-gdb or gdb for the native backtrace.

Models (both committed under benchmarks/data/): weight_cache_tiny.tflite (a 3x3 conv and two 1x1 convs, float
weights: the sharing path keeps them out of the program cache and its weight cache stays empty) and
weight_cache_tiny_fc_w8.tflite (two FULLY_CONNECTED layers with int8 weights in two signatures: the weight
cache holds their converted weights).

  make     (litert-torch installed): write the conv model; make-fc: the int8 FC model (ai-edge-quantizer too).
           python benchmarks/weight_cache_repro.py make benchmarks/data/weight_cache_tiny.tflite
           python benchmarks/weight_cache_repro.py make-fc benchmarks/data/weight_cache_tiny_fc_w8.tflite
  run      (anywhere the accelerator runs). --site NAME=DIR puts DIR, a folder holding another ai_edge_litert,
           first on the path (NAME= : the installed one); --lib NAME=FILE runs the rows with FILE (a library with
           LiteRT's C API, e.g. litert-lm-api's litert_lm/liblitert-lm.so) as libLiteRt.so:
           python benchmarks/weight_cache_repro.py run benchmarks/data/weight_cache_tiny.tflite \
               benchmarks/data/weight_cache_tiny_fc_w8.tflite --site default= \
               --lib litert-lm-api=SITE/litert_lm/liblitert-lm.so --gdb --out $OUT/weight_cache_repro.json
  probe    one launch in this process (what `run` starts per row): one JSON line; --save writes the outputs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = {"serialize_program_cache": True}
SHARING = {"enable_constant_tensors_sharing": True}
WEIGHTS = {**SHARING, **CACHE, "serialize_external_tensors": True}
# option sets, from the plainest to LiteRT-LM's GPU executor's (cache folder and key added where `cache` is true)
SETS = {
    "base": ({}, False),
    "programs_cached": (CACHE, True),
    "sharing": (SHARING, False),
    "sharing_weights_cached": (WEIGHTS, True),
    "sharing_litert_lm": ({**WEIGHTS, "convert_weights_on_gpu": True, "madvise_original_shared_tensors": True}, True),
    "sharing_upload0": ({**WEIGHTS, "num_threads_to_upload": 0}, True),
    # LiteRT-LM's SetCommonGpuOptions + SetGpuCacheOptions (runtime/executor/litert_compiled_model_executor_utils.cc)
    "sharing_litert_lm_common": ({**WEIGHTS, "precision": "fp32", "prefer_texture_weights": True,
                                  "madvise_original_shared_tensors": True, "convert_weights_on_gpu": True,
                                  "hint_fully_delegated_to_single_delegate": True}, True),
}
PARITY_REL = 2e-2  # max |gpu - cpu| / max |cpu| a row may show and still count as the same output
RESTORED = "Initialized InferenceContext from serialized data"  # the accelerator's log line on a cache hit
# tried by hand on the installed ai-edge-litert 2.3.0 (lavapipe), each in a fresh process: every one SIGSEGVs
TRIED_ELSEWHERE = [
    "ai_edge_litert.compiled_model.CompiledModel.from_file(..., Options(hardware_accelerators=GPU, "
    "gpu_options=GpuOptions(constant_tensor_sharing=True))): the wheel's own C++ CompiledModel "
    "(libpywrap_litert_common.so) with the same accelerator: SIGSEGV; without sharing it loads",
    "LiteRtCreateModelFromBuffer with a buffer that outlives the compiled model (instead of ...FromFile): SIGSEGV",
    "hardware accelerators GPU only (no CPU fallback): SIGSEGV",
    "LiteRT-LM's full GPU option set (fp32, prefer_texture_weights, madvise, convert_weights_on_gpu, "
    "hint_fully_delegated_to_single_delegate) without a cache folder: SIGSEGV",
]


def make(out: Path) -> None:
    import litert_torch
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv3 = nn.Conv2d(64, 64, 3, padding=1)
            self.up = nn.Conv2d(64, 128, 1)
            self.down = nn.Conv2d(128, 64, 1)

        def forward(self, x):
            h = self.conv3(x)
            return x + self.down(torch.tanh(self.up(h)))

    torch.manual_seed(0)
    model = Tiny().eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    litert_torch.convert(model, (torch.randn(1, 64, 32, 32),)).export(str(out))
    print(f"{out}: {out.stat().st_size} bytes")


def make_fc(out: Path) -> None:
    """Two FULLY_CONNECTED layers (128 -> 512 -> 128, tanh, residual) in two signatures (256 and 8 rows, as a
    prefill and a decode share weights), weights quantized to int8 (ai-edge-quantizer, weight-only)."""
    import litert_torch
    import torch
    from ai_edge_quantizer import quantizer, recipe
    from torch import nn

    class Fc(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(128, 512)
            self.down = nn.Linear(512, 128)

        def forward(self, x):
            return x + self.down(torch.tanh(self.up(x)))

    torch.manual_seed(0)
    model = Fc().eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        plain = str(Path(tmp) / "fc.tflite")
        litert_torch.signature("serving_default", model, (torch.randn(1, 256, 128),)) \
            .signature("short", model, (torch.randn(1, 8, 128),)).convert().export(plain)
        q = quantizer.Quantizer(plain)
        q.load_quantization_recipe(recipe.dynamic_wi8_afp32())
        q.quantize().export_model(str(out), overwrite=True)
    print(f"{out}: {out.stat().st_size} bytes")


def probe(model: str, options: dict, cache: str | None, key: str, cpu: bool, save: str | None) -> dict:
    """One launch in this process: compile (GPU, or the CPU with `cpu`), run signature 0 once, report."""
    import numpy as np

    sys.path.insert(0, str(HERE))
    from bundle_footprint import _feeds  # the benchmarks' seeded inputs

    from pocketdiff.runtime.delegate import prepare_in_process
    from pocketdiff.runtime.litert_c import CompiledModel, Environment

    driver = prepare_in_process()
    opts = dict(options)
    if cache:
        Path(cache).mkdir(parents=True, exist_ok=True)
        opts.update(serialization_dir=str(cache), model_cache_key=key)
    env = Environment()
    t0 = time.perf_counter()
    compiled = CompiledModel(model, env, opts, accelerator="cpu" if cpu else "gpu")
    load_s = time.perf_counter() - t0
    outs = compiled.run(_feeds(compiled.inputs))
    row = {"driver": driver, "fully_accelerated": compiled.fully_accelerated(), "load_s": round(load_s, 3),
           "finite": all(bool(np.isfinite(o).all()) for o in outs),
           "host_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "cache_files": sorted(f"{f.name}:{f.stat().st_size}" for f in Path(cache).iterdir()) if cache else None}
    if save:
        np.savez(save, *outs)
    compiled.close()
    env.close()
    return row


def _env(site: str) -> dict:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _version(site: str) -> str:
    code = "import importlib.metadata as m, ai_edge_litert as a, os; print(os.path.dirname(a.__file__)); " \
           "print(next((d.version for d in m.distributions() if (d.metadata['Name'] or '').startswith('ai-edge-litert')), '?'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, errors="replace", env=_env(site))
    return " ".join(p.stdout.split()) or p.stderr.strip()[-200:]


def _lib_site(lib: Path, into: Path) -> tuple[str, str]:
    """(site folder, version text) for a library used as libLiteRt.so: a folder with an `ai_edge_litert` package
    holding only a link to it (pocketdiff.runtime.litert_c loads `<ai_edge_litert>/libLiteRt.so`)."""
    if not lib.is_file():
        raise SystemExit(f"--lib: {lib} is not a file")
    pkg = into / "ai_edge_litert"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""stand-in: libLiteRt.so is a link to another build\'s library"""\n')
    (pkg / "libLiteRt.so").symlink_to(lib.resolve())
    meta = next(iter(sorted(lib.resolve().parent.parent.glob("*.dist-info/METADATA"))), None)
    header = meta.read_text().split("\n\n", 1)[0].splitlines() if meta else []
    fields = dict(line.split(": ", 1) for line in header if ": " in line)
    digest = hashlib.sha256(lib.read_bytes()).hexdigest()[:12]
    return str(into), f"{fields.get('Name', '?')} {fields.get('Version', '?')} {lib.name} sha256:{digest}"


def _probe_cmd(model: str, options: dict, cache: str | None, cpu: bool = False, save: str | None = None) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "probe", model, "--options", json.dumps(options),
           "--key", Path(model).stem]
    return cmd + (["--cache", cache] if cache else []) + (["--cpu"] if cpu else []) + (["--save", save] if save else [])


def _backtrace(cmd: list[str], site: str, timeout: float) -> str | None:
    gdb = shutil.which("cuda-gdb") or shutil.which("gdb")
    if gdb is None:
        return None
    full = [gdb, "-q", "-batch", "-ex", "set pagination off", "-ex", "set print thread-events off", "-ex", "run",
            "-ex", "bt 40", "-ex", "info registers rip", "--args"] + cmd
    try:
        p = subprocess.run(full, capture_output=True, text=True, errors="replace", timeout=timeout, env=_env(site))
    except subprocess.TimeoutExpired:
        return f"{Path(gdb).name}: timeout after {timeout} s"
    text = p.stdout + p.stderr
    start = text.find("received signal")
    text = text[start - 200:] if start >= 0 else text[-4000:]
    end = text.find("\n", text.find("LiteRtCreateCompiledModel"))  # the Python frames below it say nothing
    return f"{Path(gdb).name}\n" + (text[:end] if text.find("LiteRtCreateCompiledModel") >= 0 else text)[:6000]


def _launch(cmd: list[str], site: str, timeout: float) -> dict:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout, env=_env(site))
    except subprocess.TimeoutExpired:
        return {"rc": None, "error": f"timeout after {timeout} s"}
    row: dict = {"rc": p.returncode}
    if p.returncode < 0:
        row["signal"] = -p.returncode
    last = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode == 0 and last:
        row.update(json.loads(last[-1]))
        row["restored_from_cache"] = RESTORED in p.stderr
    else:
        row["stderr_tail"] = p.stderr[-1500:]
        errors = [ln for ln in p.stderr.splitlines() if "INVALID_ARGUMENT" in ln or "Error:" in ln or "Error " in ln]
        if errors:
            row["error"] = errors[0][-300:]
    return row


def _parity(got: str, ref: str) -> float | None:
    """max |got - ref| / max |ref| over the outputs (None where either file is missing)."""
    import numpy as np

    if not (Path(got).is_file() and Path(ref).is_file()):
        return None
    with np.load(got) as a, np.load(ref) as b:
        err = max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in b.files)
        scale = max(float(np.abs(b[k]).max()) for k in b.files) or 1.0
    return round(err / scale, 6)


def _rows_for(model: str, build: str, site: str, version: str, set_name: str, ref: str, work: Path, gdb: bool,
              timeout: float) -> list[dict]:
    options, cached = SETS[set_name]
    folder = tempfile.mkdtemp(prefix=f"wc_{set_name}_", dir=work) if cached else None
    rows = []
    for launch in ("cold", "warm") if cached else ("cold",):
        save = str(work / "out.npz")
        Path(save).unlink(missing_ok=True)
        cmd = _probe_cmd(model, options, folder, save=save)
        row = {"model": Path(model).name, "litert": build, "version": version, "set": set_name, "options": options,
               "launch": launch, **_launch(cmd, site, timeout)}
        if row.get("rc") == 0:
            row["rel_err_vs_cpu"] = _parity(save, ref)
            row["same_as_cpu"] = row["rel_err_vs_cpu"] is not None and row["rel_err_vs_cpu"] <= PARITY_REL
        if gdb and row.get("signal") and launch == "cold":  # a Python error's traceback is in stderr_tail
            row["backtrace"] = _backtrace(cmd, site, timeout * 3)
        print(json.dumps({k: v for k, v in row.items() if k not in ("stderr_tail", "backtrace", "options", "version")}), flush=True)
        rows.append(row)
        if row.get("rc") != 0:
            break  # a crashed cold launch leaves nothing for a warm one to read
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def run(models: list[str], builds: list[tuple[str, str, str]], sets: list[str], gdb: bool, timeout: float,
        work: Path, reference: str = "cpu") -> dict:
    """`builds`: (name, site folder, version text) each. `reference`: "cpu" (the installed ai-edge-litert on XNNPACK) or
    "gpu" (the installed ai-edge-litert's GPU accelerator, no option set: for graphs XNNPACK refuses, e.g. int8-direct
    UNet chunks; the rows' rel_err_vs_cpu is then against that GPU run)."""
    rows, refs = [], {}
    for model in models:
        refs[model] = str(work / f"ref_{Path(model).stem}.npz")
        got = _launch(_probe_cmd(model, {}, None, cpu=reference == "cpu", save=refs[model]), "", timeout)
        if got.get("rc") != 0:
            raise SystemExit(f"{model}: the {reference} reference failed: {got.get('stderr_tail', got)}")
    for name, site, version in builds:
        print(f"== {name}: {version}", flush=True)
        for model in models:
            for set_name in sets:
                rows += _rows_for(model, name, site, version, set_name, refs[model], work, gdb, timeout)
    return {"what": "the LiteRT GPU accelerator's weight cache (constant tensor sharing) on tiny models, per option set "
                    "and LiteRT build, each launch a fresh process, outputs compared with the CPU's",
            "models": [Path(m).name for m in models], "device": os.environ.get("DEVICE_NAME"), "reference": reference,
            "parity_rel": PARITY_REL, "tried_elsewhere": TRIED_ELSEWHERE, "rows": rows}


def _pairs(values: list[str], flag: str, ap: argparse.ArgumentParser) -> list[tuple[str, str]]:
    pairs = [tuple(v.split("=", 1)) for v in values]
    if any(len(p) != 2 or not p[0] for p in pairs):
        ap.error(f"{flag}: expected NAME=PATH")
    return pairs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("make", "make-fc"):
        sub.add_parser(name).add_argument("out")
    rn = sub.add_parser("run")
    rn.add_argument("models", nargs="+")
    rn.add_argument("--site", action="append", default=[], help="NAME=DIR (DIR empty: the installed ai_edge_litert)")
    rn.add_argument("--lib", action="append", default=[], help="NAME=FILE: FILE used as libLiteRt.so")
    rn.add_argument("--sets", default=",".join(SETS))
    rn.add_argument("--gdb", action="store_true", help="re-run a crashed launch under cuda-gdb (or gdb) for the backtrace")
    rn.add_argument("--timeout", type=float, default=120)
    rn.add_argument("--reference", choices=("cpu", "gpu"), default="cpu",
                    help="what the rows are compared with: the installed build on the CPU, or on the GPU (no options)")
    rn.add_argument("--out", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("model")
    pr.add_argument("--options", default="{}")
    pr.add_argument("--cache")
    pr.add_argument("--key", default="model")
    pr.add_argument("--cpu", action="store_true")
    pr.add_argument("--save")
    a = ap.parse_args(argv)
    if a.cmd in ("make", "make-fc"):
        (make if a.cmd == "make" else make_fc)(Path(a.out))
        return 0
    if a.cmd == "probe":
        print(json.dumps(probe(a.model, json.loads(a.options), a.cache, a.key, a.cpu, a.save)))
        return 0
    sets = [s for s in a.sets.split(",") if s]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        ap.error(f"--sets: unknown {unknown}; known: {sorted(SETS)}")
    missing = [m for m in a.models if not Path(m).is_file()]
    if missing:
        ap.error(f"model file(s) not found: {missing}")
    with tempfile.TemporaryDirectory(prefix="wcache_") as tmp:
        work = Path(tmp)
        builds = [(n, d, _version(d)) for n, d in _pairs(a.site, "--site", ap)]
        builds += [(n, *_lib_site(Path(f), work / f"lib_{i}")) for i, (n, f) in enumerate(_pairs(a.lib, "--lib", ap))]
        result = run(a.models, builds or [("default", "", _version(""))], sets, a.gdb, a.timeout, work,
                     a.reference)
        # no machine's folders in the result: the checkout, the scratch folder and each build's folder by name
        subs = [(str(Path.cwd()) + os.sep, ""), (str(work), "<scratch>"), (sys.base_prefix, "<python>")]
        subs += [(str(Path(d).resolve()), f"<{n}>") for n, d in _pairs(a.site, "--site", ap) if d]
        subs += [(str(Path(f).resolve().parent.parent), f"<{n}>") for n, f in _pairs(a.lib, "--lib", ap)]
        text = json.dumps(result, indent=1)
        for old, new in sorted(subs, key=lambda sub: -len(sub[0])):
            text = text.replace(json.dumps(old)[1:-1], new)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
