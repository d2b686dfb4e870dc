"""Every committed smoke bundle through `pocketdiff run-bundle` (CPU and the GPU delegate, plain and --pipelined), the
sha256 of each image: run it at two revisions of the runtime and compare, e.g. before and after a runner refactor
(issue 61 item 6: byte-identical images). Twin bundles (tests/web/smoke_bundle_*) are assembled with the files they
share with tests/web/smoke_bundle, as the tests do.

    python benchmarks/runner_images.py --out images.json [--prompt "a red circle"] [--seed 3]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "tests" / "web"


def assemble(twin: Path, dst: Path) -> Path:
    """`twin`'s manifest files (the runtime's list of the files a manifest names), from it where present, else from
    smoke_bundle."""
    from pocketdiff.runtime.bundle import _file_entries

    man = json.loads((twin / "manifest.json").read_text())
    for rel in ["manifest.json", *(e["path"] for e, _, _ in _file_entries(man, None))]:
        src = twin / rel if (twin / rel).is_file() else WEB / "smoke_bundle" / rel
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst / rel)
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", default="a red circle")
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for twin in sorted(p for p in WEB.glob("smoke_bundle*") if (p / "manifest.json").is_file()):
            bundle = assemble(twin, Path(tmp) / twin.name)
            for acc in ("cpu", "gpu"):
                for mode in ("plain", "pipelined"):
                    out = Path(tmp) / f"{twin.name}.{acc}.{mode}"
                    cmd = [sys.executable, "-m", "pocketdiff", "run-bundle", str(bundle), "--prompt", args.prompt, "--seed",
                           str(args.seed), "--accelerator", acc, "--output", str(out), "--no-gpu-cache",
                           *(["--pipelined"] if mode == "pipelined" else [])]
                    ok = subprocess.run(cmd, capture_output=True).returncode == 0
                    sha = hashlib.sha256((out / "image.png").read_bytes()).hexdigest() if ok else None
                    rows.append({"bundle": twin.name, "accelerator": acc, "mode": mode, "image_sha256": sha})
                    print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"prompt": args.prompt, "seed": args.seed, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
