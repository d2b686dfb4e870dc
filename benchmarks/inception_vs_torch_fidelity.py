#!/usr/bin/env python
"""Our FID Inception-v3 port (evaluate/inception.py) against torch-fidelity's, on the same weights and
images: pool3 features (2048-d), max absolute and relative difference. Runs where torchvision exists
(torch-fidelity needs it; the CPU torch 2.13 here has no torchvision build), e.g. a GPU machine.
Seeded random weights (evaluate/inception.py: seeded_random_state, the tests' too), so no download:

  python benchmarks/inception_vs_torch_fidelity.py --out benchmarks/results/inception_vs_torch_fidelity.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", type=int, default=8)
    a = ap.parse_args(argv)
    import torch_fidelity
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    inception = _module(ROOT / "evaluate" / "inception.py", "pd_inception")  # the port alone, not the evaluate package
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "random-inception.pth"
        torch.save(inception.seeded_random_state(0), path)
        ours, _ = inception.load_fid_inception(str(path))
        ref = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(path))
        g = torch.Generator().manual_seed(1)
        for shape in ((a.images, 3, 64, 48), (a.images, 3, 299, 299), (a.images, 3, 512, 512)):
            x = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
            with torch.no_grad():
                f_ours, f_ref = ours(x).double(), ref(x)[0].double()
            diff = (f_ours - f_ref).abs()
            rows.append({"input": list(shape), "max_abs_diff": float(diff.max()), "max_abs_feature": float(f_ref.abs().max()),
                         "max_rel_diff": float((diff / f_ref.abs().clamp_min(1e-6)).max()),
                         "allclose_atol_1e-5": bool(torch.allclose(f_ours, f_ref, atol=1e-5))})
    import torchvision

    result = {"torch": torch.__version__, "torchvision": torchvision.__version__, "torch_fidelity": torch_fidelity.__version__,
              "device": "cpu", "weights": "evaluate/inception.py seeded_random_state(0)", "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
