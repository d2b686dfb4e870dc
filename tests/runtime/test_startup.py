"""run-bundle's start-up, up to 'runner ready': the bundle's files hashed in threads (the first mismatch still named in
the manifest's order), each .tflite checked through the flatbuffer's accessors (every cut file the object tree refuses
is refused), and nothing imported beyond the runtime (no torch; PIL only to write the PNG, after the run)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.bundle import load_manifest
from pocketdiff.runtime.tflite_file import TfliteModel, check_tflite_file

SMOKE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle_tiny"
HEAVY = ("torch", "diffusers", "transformers", "litert_torch", "tensorflow", "accelerate", "PIL")


def _object_tree_refuses(path: Path) -> None:
    """What the check read before: the object tree of the whole model, then its indices and buffer bounds."""
    m = TfliteModel(path)
    g, nt, nb, size = m.graph, len(m.graph.tensors), len(m.model.buffers), path.stat().st_size
    if any(t >= nt for op in g.operators for t in list(op.inputs) + list(op.outputs)) or any(t.buffer >= nb for t in g.tensors):
        raise PocketdiffError(f"{path}: index out of range")
    if any(b.offset > 1 and b.offset + b.size > size for b in m.model.buffers):
        raise PocketdiffError(f"{path}: a weight buffer past the end")


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
def test_every_cut_file_is_refused_as_the_object_tree_refuses_it(tmp_path, external):
    src = tmp_path / "model.tflite"
    if external:  # the >2 GB layout: the weights after the flatbuffer, by offset and size
        TfliteModel(SMOKE / "unet.1.tflite").save(src, external=True)
    else:
        shutil.copyfile(SMOKE / "unet.1.tflite", src)
    check_tflite_file(src)
    data = src.read_bytes()
    cuts = sorted(set(np.linspace(8, len(data) - 1, 40).astype(int).tolist() + list(range(len(data) - 80, len(data)))))
    cut = tmp_path / "cut.tflite"
    for n in cuts:
        cut.write_bytes(data[:n])
        with pytest.raises(Exception):
            _object_tree_refuses(cut)
        with pytest.raises(PocketdiffError, match="truncated|corrupted|not a .tflite"):
            check_tflite_file(cut)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_files_hashed_in_threads_name_the_first_mismatch_in_the_manifests_order(tmp_path):
    bundle = shutil.copytree(SMOKE, tmp_path / "bundle")
    man = load_manifest(bundle)
    assert all(Path(e["_path"]).is_file() for e in man["components"].values())
    _flip(bundle / "unet.3.tflite")  # last in the manifest's order, and the smallest: hashed last of all
    _flip(bundle / "golden" / "vae_decoder.npz")  # the second component's golden, named before any UNet chunk
    with pytest.raises(PocketdiffError, match=r"sha256 mismatch for golden/vae_decoder.npz"):
        load_manifest(bundle)
    shutil.copyfile(SMOKE / "golden" / "vae_decoder.npz", bundle / "golden" / "vae_decoder.npz")
    with pytest.raises(PocketdiffError, match=r"sha256 mismatch for unet.3.tflite"):
        load_manifest(bundle)
    assert load_manifest(bundle, verify_sha=False)["components"]["unet.3"]["_path"].endswith("unet.3.tflite")


def test_the_runner_is_ready_with_the_runtime_alone(gpu_delegate, tmp_path):
    """Up to 'runner ready' (the CLI's parser, the bundle checked, the GPU environment, the tokenizer): no torch, no
    converter stack, no PIL."""
    code = ("import sys, json; from pocketdiff.cli import build_parser; "
            f"args = build_parser().parse_args(['run-bundle', {str(SMOKE)!r}, '--prompt', 'x', '--output', 'o']); "
            "from pocketdiff.runtime.manifest_check import check_bundle; from pocketdiff.runtime.run_bundle import BundleRunner; "
            f"r = BundleRunner(args.bundle, manifest=check_bundle(args.bundle), gpu_cache={str(tmp_path / 'cache')!r}); "
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))); r.close()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
