"""A model file's pages given back once the GPU accelerator holds the model (runtime/file_pages.py): LiteRT maps each
.tflite it opens and reads all of it while compiling; run-bundle drops those clean pages from its resident set on every
load path, and the image stays the same bit for bit."""
from __future__ import annotations

import ctypes
import json
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pocketdiff.runtime.file_pages import file_mappings, release_file_pages, resident_mb

SMOKE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle_tiny"  # text encoder, 4 UNet chunks, decoder
PROMPT, SEED = "a red circle", 5
HEAVY = ("torch", "diffusers", "transformers", "litert_torch", "tensorflow", "accelerate")


def _file(tmp_path, mb: int = 4) -> Path:
    path = tmp_path / "weights.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, mb << 20, dtype=np.uint8).tobytes())
    return path


def test_a_read_only_mapping_is_given_back_and_reads_the_same(tmp_path):
    path = _file(tmp_path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        want = bytes(m)  # every page touched
        assert resident_mb(path) > 3.9
        out = release_file_pages(path)
        assert out["mappings"] == 1 and out["file_resident_mb_before"] > 3.9 and out["file_resident_mb_after"] < 0.1, out
        assert resident_mb(path) < 0.1
        assert bytes(m) == want  # faulted back in from the file: the same bytes
    assert file_mappings(path) == [] and release_file_pages(path) is None  # no mapping: nothing to do


@pytest.mark.parametrize("written", [True, False])
def test_a_private_mapping_is_given_back_only_without_data_of_its_own(tmp_path, written):
    path = _file(tmp_path, 1)
    libc = ctypes.CDLL("libc.so.6")
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        want = bytes(m)
        if written:
            m[:8] = b"modified"  # a private copy of a page: data the file does not hold
            out = release_file_pages(path)
            assert out["skipped_mappings"] == 1 and out["released_mb"] == 0.0, out  # writable: left alone
            want = bytes(m)
        assert libc.mprotect(ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m), mmap.PROT_READ) == 0  # read-only now
        out = release_file_pages(path)
        if written:  # its copied page stays, and with it the whole mapping
            assert out["skipped_mappings"] == 1 and out["file_resident_mb_after"] > 0.9, out
        else:
            assert "skipped_mappings" not in out and out["file_resident_mb_after"] < 0.01, out
        assert bytes(m) == want


def _run(bundle, **kwargs):
    from pocketdiff.runtime.run_bundle import BundleRunner

    with BundleRunner(bundle, gpu_cache=False, **kwargs) as runner:
        image, stats = runner.run(PROMPT, seed=SEED)
        resident = {name: resident_mb(model.entry["_path"]) for name, model in runner.loaded.items()}
    return image, stats["memory"], resident


@pytest.fixture(scope="module")
def plain(gpu_delegate):
    """The tiny bundle, every model resident (plain), with its file pages given back and without."""
    on, off = _run(SMOKE), _run(SMOKE, release_file_pages=False)
    return {"on": on, "off": off}


def test_every_file_is_given_back_after_its_compile_and_the_image_is_the_same(plain):
    (image, memory, resident), (image_off, memory_off, resident_off) = plain["on"], plain["off"]
    np.testing.assert_array_equal(image, image_off)
    models = ["text_encoder", "unet.0", "unet.1", "unet.2", "unet.3", "vae_decoder"]
    assert sorted(resident) == sorted(resident_off) == sorted(models)
    sizes = {n: (SMOKE / f"{n}.tflite").stat().st_size / 2**20 for n in models}
    for name in models:  # without: LiteRT's mapping keeps the file resident after the compile and the runs
        assert resident_off[name] > 0.5 * sizes[name], (name, resident_off[name], sizes[name])
        assert resident[name] < 0.05, (name, resident[name])  # with: ~0, and the runs did not bring it back
    released = {p["component"]: p for p in memory["phases"] if p["phase"] == "pages_released"}
    assert sorted(released) == sorted(models)
    for name, p in released.items():
        assert p["file_resident_mb_before"] > 0.5 * sizes[name] and p["file_resident_mb_after"] < 0.05, p
    assert memory["release_file_pages"] and memory["pages_released_mb"] > 0.5 * sum(sizes.values())
    assert not memory_off["release_file_pages"] and memory_off["pages_released_mb"] == 0.0
    assert not [p for p in memory_off["phases"] if p["phase"] == "pages_released"]


@pytest.mark.parametrize("kwargs", [{"pipelined": True, "stream_unet": True}, {"load_workers": 2}],
                         ids=["streamed", "load_workers"])
def test_each_load_path_gives_the_pages_back(plain, kwargs):
    image, memory, _ = _run(SMOKE, **kwargs)
    np.testing.assert_array_equal(image, plain["on"][0])
    released = [p for p in memory["phases"] if p["phase"] == "pages_released"]
    loads = [p for p in memory["phases"] if p["phase"] == "compiled"]
    assert len(released) == len(loads) >= 6  # streamed: each chunk at each load; workers: in the worker, reported back
    assert all(p["file_resident_mb_after"] < 0.05 and p["released_mb"] > 0.5 for p in released), released


def test_run_bundle_cli_pipelined_gives_the_pages_back_without_torch(plain, tmp_path):
    """The CLI in a fresh process (--pipelined): the pages go back, its report shows them, and nothing heavier than
    the runtime (numpy, tokenizers, ai-edge-litert, PIL) is imported."""
    out = tmp_path / "out"
    code = ("import sys; from pocketdiff.cli import main; "
            f"rc = main(['run-bundle', {str(SMOKE)!r}, '--prompt', {PROMPT!r}, '--output', {str(out)!r}, '--seed', '{SEED}', "
            "'--pipelined', '--no-gpu-cache']); "
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}); "
            "assert not heavy, heavy; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    startup = report["memory"]["startup_s"]  # where the time to 'runner ready' went: process ages, in order
    assert 0 < startup["main"] <= startup["bundle_checked"] <= startup["runner_ready"], startup
    released = [p for p in report["memory"]["phases"] if p["phase"] == "pages_released"]
    assert len(released) == 6 and all(p["file_resident_mb_after"] < 0.05 for p in released), released
    png = np.asarray(Image.open(out / "image.png"))
    np.testing.assert_array_equal(png, (plain["on"][0] * 255).round().astype(np.uint8))


def test_run_bundle_cli_keep_file_pages_keeps_them(plain, tmp_path):
    """`--keep-file-pages`: no model gives its pages back, the report says so, and the image is the same."""
    from pocketdiff.cli import main

    out = tmp_path / "kept"
    rc = main(["run-bundle", str(SMOKE), "--prompt", PROMPT, "--output", str(out), "--seed", str(SEED),
               "--pipelined", "--no-gpu-cache", "--keep-file-pages"])
    assert rc == 0
    memory = json.loads((out / "report.json").read_text())["memory"]
    assert memory["release_file_pages"] is False
    assert not [p for p in memory["phases"] if p["phase"] == "pages_released"]
    png = np.asarray(Image.open(out / "image.png"))
    np.testing.assert_array_equal(png, (plain["on"][0] * 255).round().astype(np.uint8))
