#!/usr/bin/env python
"""The LiteRT GPU accelerator's weight cache on a tiny model: which option sets load, which crash, and where.

The accelerator keeps converted weights between launches (`<key>_mldrift_weight_cache.bin`) only on its
"constant tensor sharing" path (`enable_constant_tensors_sharing` with `serialize_external_tensors`,
`serialization_dir`, `model_cache_key`). On SD-size chunks every such set died with SIGSEGV inside
`LiteRtCreateCompiledModel`. This script is the minimal reproducer: one small .tflite (a 3x3 conv and two
1x1 convs, committed as benchmarks/data/weight_cache_tiny.tflite), each option set in a fresh process
(`bundle_footprint.py probe`), cold then warm on one cache folder, per LiteRT install; a crash is re-run
under cuda-gdb (the GPU machine's image has it) for the native backtrace.

  make  (here, litert-torch installed): write the tiny model.
        python benchmarks/weight_cache_repro.py make benchmarks/data/weight_cache_tiny.tflite
  run   (anywhere the accelerator runs; --site NAME=DIR puts DIR, a folder holding another ai_edge_litert,
        first on the path for that row; NAME=default is the installed one):
        python benchmarks/weight_cache_repro.py run benchmarks/data/weight_cache_tiny.tflite \
            --site default= --site nightly=/tmp/site_nightly --gdb --out $OUT/weight_cache_repro.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROBE = HERE / "bundle_footprint.py"
CACHE = {"serialize_program_cache": True}
SHARING = {"enable_constant_tensors_sharing": True}
# option sets, from the plainest to LiteRT-LM's GPU executor's (cache folder and key added where `cache` is true)
SETS = {
    "base": ({}, False),
    "programs_cached": (CACHE, True),
    "sharing": (SHARING, False),
    "sharing_weights_cached": ({**SHARING, **CACHE, "serialize_external_tensors": True}, True),
    "sharing_litert_lm": ({**SHARING, **CACHE, "serialize_external_tensors": True, "convert_weights_on_gpu": True,
                           "madvise_original_shared_tensors": True}, True),
    "sharing_upload0": ({**SHARING, **CACHE, "serialize_external_tensors": True, "num_threads_to_upload": 0}, True),
}


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


def _probe_cmd(model: str, options: dict, cache: str | None) -> list[str]:
    cmd = [sys.executable, str(PROBE), "probe", model, "--options", json.dumps(options), "--key", "tiny", "--json", "-"]
    return cmd + (["--cache", cache] if cache else [])


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
    return f"{Path(gdb).name}\n" + (text[start - 200:] if start >= 0 else text[-4000:])[:6000]


def _launch(model: str, options: dict, cache: str | None, site: str, timeout: float) -> dict:
    try:
        p = subprocess.run(_probe_cmd(model, options, cache), capture_output=True, text=True, errors="replace", timeout=timeout, env=_env(site))
    except subprocess.TimeoutExpired:
        return {"rc": None, "error": f"timeout after {timeout} s"}
    row: dict = {"rc": p.returncode}
    if p.returncode < 0:
        row["signal"] = -p.returncode
    last = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode == 0 and last:
        got = json.loads(last[-1])
        row.update({k: got.get(k) for k in ("fully_accelerated", "finite", "load_s", "gpu_peak_mb", "host_peak_mb", "cache_files")})
    else:
        row["stderr_tail"] = p.stderr[-1500:]
    return row


def run(model: str, sites: list[tuple[str, str]], sets: list[str], gdb: bool, timeout: float) -> dict:
    rows = []
    for name, site in sites:
        version = _version(site)
        print(f"== {name}: {version}", flush=True)
        for set_name in sets:
            options, cached = SETS[set_name]
            folder = tempfile.mkdtemp(prefix=f"wc_{name}_{set_name}_") if cached else None
            for launch in ("cold", "warm") if cached else ("cold",):
                row = {"litert": name, "version": version, "set": set_name, "options": options, "launch": launch,
                       **_launch(model, options, folder, site, timeout)}
                if gdb and row.get("rc") not in (0, None) and launch == "cold":
                    row["backtrace"] = _backtrace(_probe_cmd(model, options, folder), site, timeout * 3)
                print(json.dumps({k: v for k, v in row.items() if k not in ("stderr_tail", "backtrace", "options")}), flush=True)
                rows.append(row)
                if row.get("rc") != 0:
                    break  # a crashed cold launch leaves nothing for a warm one to read
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
    return {"what": "the LiteRT GPU accelerator's weight cache (constant tensor sharing) on a tiny model, per option set "
                    "and LiteRT install, each launch a fresh process", "model": Path(model).name,
            "device": os.environ.get("DEVICE_NAME"), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("out")
    rn = sub.add_parser("run")
    rn.add_argument("model")
    rn.add_argument("--site", action="append", default=[], help="NAME=DIR (DIR empty: the installed ai_edge_litert)")
    rn.add_argument("--sets", default=",".join(SETS))
    rn.add_argument("--gdb", action="store_true", help="re-run a crashed launch under cuda-gdb (or gdb) for the backtrace")
    rn.add_argument("--timeout", type=float, default=120)
    rn.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "make":
        make(Path(a.out))
        return 0
    sets = [s for s in a.sets.split(",") if s]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        ap.error(f"--sets: unknown {unknown}; known: {sorted(SETS)}")
    sites = [tuple(s.split("=", 1)) for s in a.site] or [("default", "")]
    if any(len(s) != 2 for s in sites):
        ap.error("--site: expected NAME=DIR")
    result = run(a.model, sites, sets, a.gdb, a.timeout)
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
