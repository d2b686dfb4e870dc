"""A crash-isolating first compile for the GPU weight cache's constant-sharing path (run-bundle --weight-cache).

litert-lm-api 0.18.1's one-build library (runtime/litert_c.py) ABORTS the whole process on some graphs when
constant-tensor sharing is on: a C++ CHECK, not an error status. Known: a float EMBEDDING_LOOKUP table ("Unsupported
external weights type: 1"; such models are kept off sharing ahead, runtime/gpu_cache.py's UNSHAREABLE_OPS); by the
library's messages, shared tensors quantized other than affinely ("Only affine quantization is supported for the shared
tensors"); possibly others. So the first time a model file compiles with sharing under a cache key (the key of its
programs: its verified sha256, the library's identity, GPU, driver, options), it compiles in a child process first:

- the child (`python -m pocketdiff.runtime.sharing_child`, a fresh interpreter: no GPU state inherited, no main
  module imported) loads the parent's library and compiles the model with the parent's full options, writing its
  programs and weights into the parent's private folder for that compile; it loads them back (the warm load every launch
  then does), and compiles the model a third time without sharing and without a cache folder; each runs once on the
  bundle's golden inputs of the model (seeded ones when it has none). The parent's own compile then reads the child's
  files (a warm load);
- the sharing outputs (cold and warm) against the output without sharing: lowest cosine and PSNR (runtime/parity.metrics)
  below gpu_cache.SHARING_MIN_COSINE / SHARING_MIN_PSNR_DB, or NaN/Inf: the verdict "wrong output" with the figures
  (litert-lm-api's sharing path computes something else on NVIDIA's Vulkan driver: images 18.7 dB from a plain
  launch's on an H100); the files the child left are removed and the parent compiles the model without sharing;
- the child dies by a signal: the verdict "aborted" is recorded, the files it left are removed, and the parent compiles
  the model without sharing (its programs are still cached); the runner's cache gives one warning line naming the model
  (and the figure or the signal) when it reads the verdict after the load (runtime/gpu_cache.py);
- the verdict (shared, aborted, wrong output) goes into the cache folder's `sharing.json` under the key
  (gpu_cache.write_verdict: merged under the folder's lock, written atomically; a component's verdicts under older keys
  go). Later launches read it and start no child: the extra cost is the first launch's only. A child failing with an
  error status (not a signal) records nothing: the model loads without sharing this time and is tried again next launch.

`litert_c.CompiledModel` runs the trial when its options carry TRIAL_OPTION (put there by gpu_cache for a compile
afresh), so it happens where the model compiles: in the runner's process, a load worker or the overlapped loader's.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from .gpu_cache import SHARING_MIN_COSINE, SHARING_MIN_PSNR_DB, WEIGHT_CACHE_OPTIONS, trial_warning, write_verdict

MARK = "pocketdiff-sharing-trial: "  # the child's line of figures (runtime/sharing_child.py)


def _last_words(stderr: str) -> str:
    """The child's most telling stderr line (a CHECK's message when there is one), shortened."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    told = [ln for ln in lines if ln.startswith("F0") or "Check failed" in ln or "supported" in ln.lower()]
    return re.sub(r"^[FEWI]\d{4} [\d:.]+\s+\d+\s+", "", (told or lines or [""])[-1])[:200]  # glog's time and thread go


def _kept(value: float, digits: int):
    """A figure for sharing.json (strict JSON: no NaN/Infinity): rounded, or "inf" (identical outputs) / "nan"."""
    return round(value, digits) if np.isfinite(value) else ("inf" if value > 0 else "nan")


def parity_verdict(figures: dict, min_psnr_db: float = SHARING_MIN_PSNR_DB, min_cosine: float = SHARING_MIN_COSINE) -> dict:
    """The child's figures (lowest cosine and PSNR of the sharing outputs against the compile without sharing) -> the
    verdict: {"shared": True, "cosine", "psnr_db"} when both reach their floors, else {"shared": False, "verdict":
    "wrong output", "cosine", "psnr_db", "where", "min_psnr_db", "min_cosine"} (NaN, an output holding NaN/Inf, fails)."""
    cosine, psnr = float(figures.get("cosine", float("nan"))), float(figures.get("psnr_db", float("nan")))
    seen = {"cosine": _kept(cosine, 7), "psnr_db": _kept(psnr, 2)}
    if cosine >= min_cosine and psnr >= min_psnr_db:
        return {"shared": True, **seen}
    return {"shared": False, "verdict": "wrong output", **seen, "where": str(figures.get("where", "")),
            "min_psnr_db": min_psnr_db, "min_cosine": min_cosine}


def trial_compile(path: str, options: dict, library: str, library_path: str, trial: Optional[dict] = None) -> Optional[dict]:
    """Compile PATH with OPTIONS in a child process on LIBRARY (litert_c's name) at LIBRARY_PATH, run it against its
    compile without sharing (runtime/sharing_child.py). TRIAL: gpu_cache's trial dict ("golden": the model's golden
    file, "min_psnr_db" / "min_cosine": the floors, "perturb": tests only). The verdict: `parity_verdict`'s when it ran,
    {"shared": False, "signal", "message"} when it died by a signal, None when it failed with an error status or told
    no figures (nothing learnt about sharing)."""
    trial = trial or {}
    spec = json.dumps({"path": str(path), "options": options, "library": library, "library_path": str(library_path),
                       "golden": trial.get("golden"), "perturb": trial.get("perturb")})
    proc = subprocess.run([sys.executable, "-m", "pocketdiff.runtime.sharing_child", spec],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace")
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = f"signal {-proc.returncode}"
        return {"shared": False, "signal": sig, "message": _last_words(proc.stderr)}
    told = [ln[len(MARK):] for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not told:
        return None
    return parity_verdict(json.loads(told[-1]), float(trial.get("min_psnr_db", SHARING_MIN_PSNR_DB)),
                          float(trial.get("min_cosine", SHARING_MIN_COSINE)))


def first_compile(path: str, options: dict, trial: dict, library) -> dict:
    """The options this process compiles PATH with, after a trial compile in a child (TRIAL: gpu_cache's
    {"folder", "key", "name", "golden", ...}; LIBRARY: litert_c's loaded LiteRtLibrary): OPTIONS when the child compiled
    it and its output with sharing matched its output without, else OPTIONS without sharing. The verdict is recorded in
    the folder (none when the child failed with an error status: tried again next launch, this load without sharing).
    The runner's cache reads the verdict after the load and gives the warning line (`trial_warning`): this may be a
    load worker, whose stderr is the native log. Only a verdict that could not be recorded is told here."""
    verdict = trial_compile(path, options, library.which, str(library.path), trial)
    name = trial.get("name", Path(path).stem)
    if verdict is not None:
        try:
            write_verdict(trial["folder"], trial["key"], {"name": name, **verdict})
        except OSError as e:
            if not verdict["shared"]:
                print(f"warning: {trial_warning(name, verdict, trial['folder'])} (not recorded: {e.strerror or e})",
                      file=sys.stderr)
        if verdict["shared"]:
            return options
    folder = Path(options.get("serialization_dir") or trial["folder"])
    for p in folder.glob(f"{trial['key']}_*"):  # what the child left: never read
        p.unlink(missing_ok=True)
    return {k: v for k, v in options.items() if k not in WEIGHT_CACHE_OPTIONS}
