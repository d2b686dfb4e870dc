"""The child process of a weight-cache trial compile (runtime/sharing_trial.py): `python -m
pocketdiff.runtime.sharing_child SPEC`, SPEC a JSON object {path, options, library, library_path, golden, perturb}. It
loads that LiteRT library (the parent's: runtime/litert_c.py) and, on the GPU, one model at a time:

1. compiles the model with the options (constant sharing on: the accelerator writes its programs and converted weights
   where they say) and runs it once;
2. compiles it again from those files (what the parent's load and every later launch do: a warm load) and runs it;
3. compiles it WITHOUT sharing and without any cache folder (the path run-bundle takes without --weight-cache) and runs it.

The inputs: the bundle's golden inputs of the model when SPEC names a golden file holding them (by signature name and
shape), else seeded ones (float: standard normal, integer: 0 or 1, bool: random). Each output of 1 and 2 is compared
with 3's (runtime/parity.metrics: cosine, PSNR over the reference's range); the last stdout line is sharing_trial.MARK + a JSON object
with the lowest cosine and PSNR and where they were. Exit status 0 when all of it ran. An abort inside the library ends
it by a signal, which is what the parent looks for. No core file is written. `perturb` (tests only): noise of that
fraction of each output's range added to 1's and 2's outputs, standing for a sharing path that computes something else.
"""
from __future__ import annotations

import json
import os
import resource
import sys
from typing import Optional

import numpy as np

CACHE_FOLDER_OPTIONS = ("serialization_dir", "model_cache_key", "serialize_program_cache")


def trial_inputs(specs: list, golden: Optional[str]) -> list[np.ndarray]:
    """One array per input spec (name, shape, dtype): the golden file's `input_<name>` when it has that shape, else seeded."""
    data = {}
    if golden:
        try:
            with np.load(golden, allow_pickle=False) as npz:
                data = {k: npz[k] for k in npz.files if k.startswith("input_")}
        except (OSError, ValueError):
            data = {}
    rng = np.random.default_rng(0)
    feeds = []
    for s in specs:
        got = data.get(f"input_{s.name}")
        if got is not None and tuple(got.shape) == tuple(s.shape):
            feeds.append(np.asarray(got, dtype=s.dtype))
        elif np.issubdtype(s.dtype, np.floating):
            feeds.append(rng.standard_normal(s.shape).astype(s.dtype))
        elif s.dtype == np.bool_:
            feeds.append(rng.random(s.shape) < 0.5)
        else:
            feeds.append(rng.integers(0, 2, s.shape).astype(s.dtype))
    return feeds


def compile_and_run(lib, path: str, options: dict, golden: Optional[str]) -> list[np.ndarray]:
    """Compile PATH with OPTIONS in a fresh environment (nothing shared with the other compiles), run it once, free it."""
    from .litert_c import CompiledModel, Environment

    env = Environment(lib)
    model = None
    try:
        model = CompiledModel(path, env, options)
        return [np.array(o, dtype=np.float64) for o in model.run(trial_inputs(model.inputs, golden))]
    finally:
        if model is not None:
            model.close()
        env.close()


def compare(reference: list, outputs: list, where: str) -> dict:
    """The lowest cosine and PSNR over the outputs (runtime/parity.metrics; NaN when an output holds NaN/Inf)."""
    from .parity import metrics

    worst = {"cosine": 1.0, "psnr_db": float("inf"), "where": where}
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        m = metrics(ref, out)
        if not m["finite"]:
            return {"cosine": float("nan"), "psnr_db": float("nan"), "where": f"{where} output {i} (NaN/Inf)"}
        if m["psnr_db"] < worst["psnr_db"] or m["cosine"] < worst["cosine"]:
            worst = {"cosine": min(worst["cosine"], m["cosine"]), "psnr_db": min(worst["psnr_db"], m["psnr_db"]),
                     "where": f"{where} output {i}"}
    return worst


def perturbed(outputs: list, fraction: float, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [o + fraction * float(np.ptp(o) or 1.0) * rng.standard_normal(o.shape) for o in outputs]


def main(spec: dict) -> int:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort here is expected: no core file
    from .delegate import prepare_in_process
    from .gpu_cache import WEIGHT_CACHE_OPTIONS
    from .sharing_trial import MARK
    from .litert_c import SINGLE_BUILD, SINGLE_BUILD_ENV, LiteRtLibrary

    if spec["library"] == SINGLE_BUILD:
        os.environ[SINGLE_BUILD_ENV] = spec["library_path"]  # the parent's very file
    prepare_in_process()
    lib = LiteRtLibrary.shared(spec["library"])
    path, options, golden = spec["path"], spec["options"], spec.get("golden")
    cold = compile_and_run(lib, path, options, golden)  # writes the files the parent then loads
    warm = compile_and_run(lib, path, options, golden)  # reads them back
    plain = {k: v for k, v in options.items() if k not in WEIGHT_CACHE_OPTIONS and k not in CACHE_FOLDER_OPTIONS}
    reference = compile_and_run(lib, path, plain, golden)
    if spec.get("perturb"):
        cold, warm = perturbed(cold, spec["perturb"], 1), perturbed(warm, spec["perturb"], 2)
    a, b = compare(reference, cold, "cold"), compare(reference, warm, "warm")
    bad = [m for m in (a, b) if np.isnan(m["psnr_db"])]
    worst = bad[0] if bad else min(a, b, key=lambda m: m["psnr_db"])
    cosine = float("nan") if bad else min(a["cosine"], b["cosine"])
    print(MARK + json.dumps({"cosine": cosine, "psnr_db": worst["psnr_db"], "where": worst["where"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
