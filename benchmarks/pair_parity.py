#!/usr/bin/env python
"""Two .tflite files that should compute the same thing, run on the same random feeds through LiteRT's GPU
accelerator (pocketdiff.runtime.litert_c), each in its own environment: cosine and max |diff| per output.

  python benchmarks/pair_parity.py DIR STEM [STEM ...]   # compares DIR/STEM_dequant.tflite with DIR/STEM_direct.tflite

Options per side as JSON in OPTS_dequant / OPTS_direct (e.g. OPTS_direct='{"allow_src_quantized_fc_conv_ops": true}',
what run-bundle asks for int8.storage: direct components). One JSON line per stem on stdout.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

KINDS = ("dequant", "direct")


def _outputs(path: str, options: dict) -> tuple[bool, list]:
    from pocketdiff.runtime.litert_c import CompiledModel, Environment

    env = Environment()
    model = CompiledModel(path, env, options)
    try:
        rng = np.random.default_rng(0)
        feeds = [np.zeros(s.shape, s.dtype) if np.issubdtype(s.dtype, np.integer)
                 else (rng.standard_normal(s.shape) * 0.5).astype(s.dtype) for s in model.inputs]
        return model.fully_accelerated(), [o.astype(np.float64).ravel() for o in model.run(feeds)]
    finally:
        model.close()
        env.close()


def compare(folder: str, stem: str) -> dict:
    runs = {k: _outputs(f"{folder}/{stem}_{k}.tflite", json.loads(os.environ.get("OPTS_" + k, "{}"))) for k in KINDS}
    a, b = runs["dequant"][1], runs["direct"][1]
    cosine = [float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-30)) for x, y in zip(a, b)]
    return {"model": stem, "fully_accelerated": [runs[k][0] for k in KINDS], "cosine_direct_vs_dequant": cosine,
            "max_abs": [float(np.abs(x - y).max()) for x, y in zip(a, b)]}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    for stem in argv[1:]:
        print(json.dumps(compare(argv[0], stem)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
