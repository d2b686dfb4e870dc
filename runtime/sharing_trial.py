"""A crash-isolating first compile for the GPU weight cache's constant-sharing path (run-bundle --weight-cache).

litert-lm-api 0.18.1's one-build library (runtime/litert_c.py) ABORTS the whole process on some graphs when
constant-tensor sharing is on: a C++ CHECK, not an error status. Known: a float EMBEDDING_LOOKUP table ("Unsupported
external weights type: 1"; such models are kept off sharing ahead, runtime/gpu_cache.py's UNSHAREABLE_OPS); by the
library's messages, shared tensors quantized other than affinely ("Only affine quantization is supported for the shared
tensors"); possibly others. So the first time a model file compiles with sharing under a cache key (the key of its
programs: its verified sha256, the library's identity, GPU, driver, options), it compiles in a child process first:

- the child (`python -m pocketdiff.runtime.sharing_child`, a fresh interpreter: no GPU state inherited, no main
  module imported) loads the parent's library and compiles the model with the parent's full options, writing its
  programs and weights into the parent's private folder for that compile; the parent's own compile then reads them (a
  warm load), so the first launch pays the child's start (interpreter, imports, library: ~0.2 s on lavapipe, plus its
  GPU context) and a warm load, not a second cold compile;
- the child dies by a signal: the verdict "aborted" is recorded, the files it left are removed, and the parent compiles
  the model without sharing (its programs are still cached); the runner's cache gives one warning line naming the model
  when it reads that verdict after the load (runtime/gpu_cache.py);
- the verdict (shared or aborted) goes into the cache folder's `sharing.json` under the key (gpu_cache.write_verdict:
  merged under the folder's lock, written atomically; a component's verdicts under older keys go). Later launches read
  it and start no child: the extra cost is the first launch's only. A child failing with an error status (not a
  signal) records nothing: the parent's own compile reports that error.

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

from .gpu_cache import WEIGHT_CACHE_OPTIONS, abort_warning, write_verdict


def _last_words(stderr: str) -> str:
    """The child's most telling stderr line (a CHECK's message when there is one), shortened."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    told = [ln for ln in lines if ln.startswith("F0") or "Check failed" in ln or "supported" in ln.lower()]
    return re.sub(r"^[FEWI]\d{4} [\d:.]+\s+\d+\s+", "", (told or lines or [""])[-1])[:200]  # glog's time and thread go


def trial_compile(path: str, options: dict, library: str, library_path: str) -> Optional[dict]:
    """Compile PATH with OPTIONS in a child process on LIBRARY (litert_c's name) at LIBRARY_PATH. The verdict:
    {"shared": True} when it compiled, {"shared": False, "signal", "message"} when it died by a signal, None when it
    failed with an error status (nothing learnt about sharing)."""
    spec = json.dumps({"path": str(path), "options": options, "library": library, "library_path": str(library_path)})
    proc = subprocess.run([sys.executable, "-m", "pocketdiff.runtime.sharing_child", spec],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace")
    if proc.returncode == 0:
        return {"shared": True}
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = f"signal {-proc.returncode}"
        return {"shared": False, "signal": sig, "message": _last_words(proc.stderr)}
    return None


def first_compile(path: str, options: dict, trial: dict, library) -> dict:
    """The options this process compiles PATH with, after a trial compile in a child (TRIAL: gpu_cache's
    {"folder", "key", "name"}; LIBRARY: litert_c's loaded LiteRtLibrary): OPTIONS when the child compiled it, else
    OPTIONS without sharing, the verdict recorded in the folder either way. The runner's cache reads the verdict after
    the load and gives the warning line (`abort_warning`): this may be a load worker, whose stderr is the native log.
    Only a verdict that could not be recorded is told here."""
    verdict = trial_compile(path, options, library.which, str(library.path))
    if verdict is None:
        return options
    name = trial.get("name", Path(path).stem)
    try:
        write_verdict(trial["folder"], trial["key"], {"name": name, **verdict})
    except OSError as e:
        if not verdict["shared"]:
            print(f"warning: {abort_warning(name, verdict, trial['folder'])} (not recorded: {e.strerror or e})", file=sys.stderr)
    if verdict["shared"]:
        return options
    folder = Path(options.get("serialization_dir") or trial["folder"])
    for p in folder.glob(f"{trial['key']}_*"):  # what the child left half-written: never read
        p.unlink(missing_ok=True)
    return {k: v for k, v in options.items() if k not in WEIGHT_CACHE_OPTIONS}
