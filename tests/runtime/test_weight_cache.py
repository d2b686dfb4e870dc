"""run-bundle --weight-cache (issue 66 item 2): the GPU accelerator's converted weights kept in the --gpu-cache folder,
through litert-lm-api's one-build LiteRT library (runtime/litert_c.py, runtime/gpu_cache.py), on lavapipe with the
smoke bundle. The issue's bad input, each a test: a read-only cache folder (read when it holds a valid cache, nothing
written or rebuilt), a folder from another LiteRT build, a weight file truncated mid-write, two launches writing one
folder at once; and the workers loading the parent's library. (The trial compile that isolates the library's aborts:
tests/runtime/test_weight_cache_trial.py.) Every launch is a subprocess, so a native crash fails the test instead of killing pytest; every image is
compared with the launch without any cache (default library): PSNR >= PSNR_BAR dB.

LiteRT's own answer to a truncated weight file, tried by hand on lavapipe (int8 FC model of
benchmarks/data/weight_cache_tiny_fc_w8.tflite, no index in front): it rewrote the file and gave the same outputs. The
index's size + CRC-32 (runtime/gpu_cache.py) catches it before the accelerator reads it anyway (tested below).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.cli import main

BUNDLE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle"
PSNR_BAR = 40.0  # dB vs the image without any cache: measured 58.6 dB on lavapipe (another LiteRT build, fp16 rounding)
needs_library = pytest.mark.skipif(importlib.util.find_spec("litert_lm") is None,
                                   reason="litert-lm-api is not installed (pip install 'pocketdiff[gpu-cache]')")


def launch(out: Path, *flags: str, wrap: tuple = (), wait: bool = True):
    cmd = [*wrap, sys.executable, "-m", "pocketdiff.cli", "run-bundle", str(BUNDLE), "--prompt", "a red circle",
           "--seed", "1", "--output", str(out), *flags]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def launch_with(code: str, out: Path, folder: Path, *flags: str):
    """run-bundle --weight-cache into FOLDER through `python -c CODE` (CODE patches the runtime, then calls the CLI), in
    OUT's parent (a core file would show there)."""
    cmd = [sys.executable, "-c", code, "run-bundle", str(BUNDLE), "--prompt", "a red circle", "--seed", "1",
           "--output", str(out), "--gpu-cache", str(folder), "--weight-cache", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out.parent)


def uncached_image(tmp_path_factory, name: str):
    """The image of a launch without any cache (the wheel's own library)."""
    out = tmp_path_factory.mktemp(name) / "ref"
    ok(launch(out, "--no-gpu-cache"), out)
    return image(out)


def ok(proc, out: Path) -> dict:
    """The launch's report, after checking it exited 0 (a native crash is a negative return code)."""
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "report.json").read_text())


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


def image(out: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(out / "image.png")).astype(np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(the reference image without any cache, a cache folder one --weight-cache launch made, that launch's report)."""
    root = tmp_path_factory.mktemp("weight_cache")
    if importlib.util.find_spec("litert_lm") is None:
        pytest.skip("litert-lm-api is not installed (pip install 'pocketdiff[gpu-cache]')")
    ok(launch(root / "ref", "--no-gpu-cache"), root / "ref")
    cold = launch(root / "cold", "--gpu-cache", str(root / "cache"), "--weight-cache")
    return image(root / "ref"), root / "cache", ok(cold, root / "cold")


def copy_of(made, tmp_path: Path) -> Path:
    folder = tmp_path / "cache"
    shutil.copytree(made[1], folder)
    return folder


@needs_library
def test_cold_launch_makes_the_weight_cache_and_a_warm_one_reuses_it(made, tmp_path):
    ref, folder, cold = made
    gc = cold["gpu_cache"]
    assert cold["weight_cache"] is True and gc["weight_cache"] == "made" and gc["library"].startswith("litert-lm")
    assert gc["weight_cache_by_model"] == {"text_encoder": "skipped: EMBEDDING_LOOKUP", "unet": "made", "vae_decoder": "made"}
    index = json.loads((folder / "index.json").read_text())
    assert all(any(f.endswith("_mldrift_weight_cache.bin") for f in index[n]["files"]) for n in ("unet", "vae_decoder"))
    assert (folder / "library.json").is_file()
    assert gc["trial_compiles"] == {"unet": "shared", "vae_decoder": "shared"}  # each shared model's first compile: a child's first
    warm_folder = copy_of(made, tmp_path)
    proc = launch(tmp_path / "warm", "--gpu-cache", str(warm_folder), "--weight-cache")
    warm = ok(proc, tmp_path / "warm")
    assert warm["gpu_cache"]["weight_cache"] == "reused" and all(warm["gpu_cache"]["hits"].values())
    assert warm["gpu_cache"]["trial_compiles"] == {}  # the verdicts are read: no child
    assert not warnings_of(proc.stderr), proc.stderr[-1500:]
    assert psnr(image(tmp_path / "warm"), ref) >= PSNR_BAR


def _can_mount_read_only(folder: Path) -> bool:
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind '{folder}' '{folder}' && "
                            f"mount -o remount,ro,bind '{folder}' '{folder}' && ! touch '{folder}/.x' 2>/dev/null"],
                           capture_output=True, text=True) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


def read_only(folder: Path) -> tuple:
    """A launch prefix that mounts FOLDER read-only for it (a user and mount namespace: root too is refused writes
    there; chmod would not stop root); skips the test where that cannot be done."""
    if not _can_mount_read_only(folder):
        pytest.skip("no read-only bind mount here (unshare -rm refused): cannot make a folder read-only for root")
    return ("unshare", "-rm", "sh", "-c", f"mount --bind '{folder}' '{folder}' && mount -o remount,ro,bind '{folder}' "
            f"'{folder}' && exec \"$@\"", "sh")


def files_of(folder: Path) -> list:
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())


@needs_library
def test_a_read_only_folder_holding_a_valid_cache_is_read_with_one_warning(made, tmp_path):
    """Programs and weights of an earlier launch (same library, bundle, driver) on a read-only mount: every model's
    entry is read (weights reused), nothing is written."""
    folder = copy_of(made, tmp_path)
    wrap, before = read_only(folder), files_of(folder)
    proc = launch(tmp_path / "ro", "--gpu-cache", str(folder), "--weight-cache", wrap=wrap)
    report = ok(proc, tmp_path / "ro")
    lines = warnings_of(proc.stderr)
    assert len(lines) == 1 and "not writable" in lines[0] and "read-only" in lines[0], proc.stderr[-1500:]
    gc = report["gpu_cache"]
    assert gc["read_only"] is True and all(gc["hits"].values()) and gc["weight_cache"] == "reused"
    assert gc["weight_cache_by_model"] == {"text_encoder": "skipped: EMBEDDING_LOOKUP", "unet": "reused", "vae_decoder": "reused"}
    assert files_of(folder) == before
    assert psnr(image(tmp_path / "ro"), made[0]) >= PSNR_BAR


@needs_library
def test_a_read_only_folder_rebuilds_nothing_it_cannot_write(made, tmp_path):
    """The UNet's weight file cut short on a read-only mount: the UNet compiles without the cache (its files are not
    handed to the accelerator, nor replaced), the other models' entries are read; one warning line in all."""
    folder = copy_of(made, tmp_path)
    victim = next(folder.glob("unet-*_mldrift_weight_cache.bin"))
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    wrap, before = read_only(folder), files_of(folder)
    proc = launch(tmp_path / "ro", "--gpu-cache", str(folder), "--weight-cache", wrap=wrap)
    report = ok(proc, tmp_path / "ro")
    assert len(warnings_of(proc.stderr)) == 1, proc.stderr[-1500:]
    gc = report["gpu_cache"]
    assert gc["hits"] == {"text_encoder": True, "unet": False, "vae_decoder": True}
    assert gc["weight_cache_by_model"] == {"text_encoder": "skipped: EMBEDDING_LOOKUP", "unet": "off", "vae_decoder": "reused"}
    assert files_of(folder) == before
    assert psnr(image(tmp_path / "ro"), made[0]) >= PSNR_BAR


@needs_library
def test_a_read_only_folder_without_an_index_runs_without_the_cache_and_one_warning(made, tmp_path):
    """No index: nothing in the folder is trusted (its files are not read). The hash ledger (verified.json) is kept:
    it is current, so nothing else has to be written there."""
    folder = copy_of(made, tmp_path)
    (folder / "index.json").unlink()
    wrap, before = read_only(folder), files_of(folder)
    proc = launch(tmp_path / "ro", "--gpu-cache", str(folder), "--weight-cache", wrap=wrap)
    report = ok(proc, tmp_path / "ro")
    lines = warnings_of(proc.stderr)
    assert len(lines) == 1 and "not writable" in lines[0] and "running without a program cache" in lines[0], proc.stderr[-1500:]
    assert report["gpu_cache"]["weight_cache"] == "off" and report["gpu_cache"]["folder"] is None
    assert files_of(folder) == before
    assert psnr(image(tmp_path / "ro"), made[0]) >= PSNR_BAR


@needs_library
def test_a_folder_from_another_litert_build_is_rebuilt_with_one_warning(made, tmp_path):
    folder = copy_of(made, tmp_path)
    record = json.loads((folder / "library.json").read_text())
    (folder / "library.json").write_text(json.dumps({**record, "sha256": "0" * 64}))  # as another build's
    old = {p.name for p in folder.glob("*_mldrift_*.bin")}
    proc = launch(tmp_path / "other", "--gpu-cache", str(folder), "--weight-cache")
    report = ok(proc, tmp_path / "other")
    lines = warnings_of(proc.stderr)
    assert len(lines) == 1 and "another model, driver or LiteRT version; rebuilding" in lines[0], proc.stderr[-1500:]
    assert report["gpu_cache"]["weight_cache"] == "made" and not any(report["gpu_cache"]["hits"].values())
    assert not old & {p.name for p in folder.glob("*_mldrift_*.bin")}  # the other build's files are gone
    assert psnr(image(tmp_path / "other"), made[0]) >= PSNR_BAR
    again = launch(tmp_path / "again", "--gpu-cache", str(folder), "--weight-cache")
    assert ok(again, tmp_path / "again")["gpu_cache"]["weight_cache"] == "reused" and not warnings_of(again.stderr)


@needs_library
def test_a_weight_file_truncated_mid_write_is_rebuilt_with_one_warning(made, tmp_path):
    folder = copy_of(made, tmp_path)
    victim = next(folder.glob("unet-*_mldrift_weight_cache.bin"))
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    proc = launch(tmp_path / "cut", "--gpu-cache", str(folder), "--weight-cache")
    report = ok(proc, tmp_path / "cut")
    lines = warnings_of(proc.stderr)
    assert len(lines) == 1 and "unet's cached programs are corrupt or missing" in lines[0], proc.stderr[-1500:]
    assert report["gpu_cache"]["weight_cache_by_model"] == {"text_encoder": "skipped: EMBEDDING_LOOKUP", "unet": "made",
                                                            "vae_decoder": "reused"}
    assert victim.stat().st_size == len(data)  # written again whole (same key, same name)
    assert psnr(image(tmp_path / "cut"), made[0]) >= PSNR_BAR


@needs_library
def test_two_launches_writing_one_cache_at_once_then_a_third_reuses_it(made, tmp_path):
    folder = tmp_path / "cache"
    procs = [launch(tmp_path / f"img{i}", "--gpu-cache", str(folder), "--weight-cache", wait=False) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-2000:]
        assert psnr(image(tmp_path / f"img{i}"), made[0]) >= PSNR_BAR
    third = launch(tmp_path / "img2", "--gpu-cache", str(folder), "--weight-cache")
    report = ok(third, tmp_path / "img2")
    assert report["gpu_cache"]["weight_cache"] == "reused" and not warnings_of(third.stderr), third.stderr[-1500:]
    assert psnr(image(tmp_path / "img2"), made[0]) >= PSNR_BAR


@needs_library
@pytest.mark.parametrize("flags", [("--pipelined", "--overlap-loads"), ("--load-workers", "1")])
def test_worker_processes_load_the_parents_library(made, tmp_path, flags):
    """The sharing options in a worker on the wheel's library would crash it: a weight cache made there means the
    worker loaded the one-build library as its parent did."""
    proc = launch(tmp_path / "w", "--gpu-cache", str(tmp_path / "cache"), "--weight-cache", *flags)
    report = ok(proc, tmp_path / "w")
    assert report["gpu_cache"]["weight_cache_by_model"]["unet"] == "made"
    assert psnr(image(tmp_path / "w"), made[0]) >= PSNR_BAR


def test_one_litert_library_per_process():
    code = ("from pocketdiff.runtime.litert_c import LiteRtLibrary as L\nfrom pocketdiff.errors import PocketdiffError\n"
            "L.shared('ai-edge-litert')\ntry:\n    L.shared('litert-lm')\nexcept PocketdiffError as e:\n    print(e)\n"
            "print(L.shared().which)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]
    lines = proc.stdout.strip().splitlines()
    assert "one LiteRT library per process" in lines[0] and lines[1] == "ai-edge-litert"


@pytest.mark.parametrize("extra,culprit", [(["--no-gpu-cache"], "--no-gpu-cache"), (["--accelerator", "cpu"], "--accelerator gpu")])
def test_weight_cache_flag_refused_without_a_gpu_cache(tmp_path, capsys, extra, culprit):
    out = tmp_path / "out"
    code = main(["run-bundle", str(BUNDLE), "--prompt", "x", "--output", str(out), "--weight-cache", *extra])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--weight-cache" in lines[0] and culprit in lines[0]
    assert not out.exists()


def test_weight_cache_without_the_package_names_the_extra(tmp_path, capsys, monkeypatch):
    import pocketdiff.runtime.litert_c as litert_c

    monkeypatch.delenv(litert_c.SINGLE_BUILD_ENV, raising=False)
    monkeypatch.setattr(litert_c.importlib.util, "find_spec", lambda name: None)
    out = tmp_path / "out"
    code = main(["run-bundle", str(BUNDLE), "--prompt", "x", "--output", str(out), "--weight-cache", "--gpu-cache", str(tmp_path / "c")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "pip install 'pocketdiff[gpu-cache]'" in lines[0] and not out.exists()


def test_library_identity_is_hashed_once_and_remembered(tmp_path, monkeypatch):
    import pocketdiff.runtime.gpu_cache as gpu_cache

    lib = tmp_path / "site" / "litert_lm" / "liblitert-lm.so"
    lib.parent.mkdir(parents=True)
    (tmp_path / "site" / "litert_lm_api-0.18.1.dist-info").mkdir()
    lib.write_bytes(b"\x7fELF" + bytes(1000))
    hashed = []
    real = gpu_cache.sha256_file
    monkeypatch.setattr(gpu_cache, "sha256_file", lambda p: hashed.append(p) or real(p))
    first = gpu_cache.library_identity(lib, tmp_path)
    assert first == gpu_cache.library_identity(lib, tmp_path) and len(hashed) == 1
    assert first.startswith("litert-lm-api 0.18.1 liblitert-lm.so 1004 sha256:")
    lib.write_bytes(b"\x7fELF" + bytes(999) + b"x")  # another build, same size: its mtime differs
    os.utime(lib, ns=(lib.stat().st_atime_ns, lib.stat().st_mtime_ns + 10**9))
    assert gpu_cache.library_identity(lib, tmp_path) != first and len(hashed) == 2
    # a read-only folder (write=False): its record is read, and a missing one is not written
    record = tmp_path / gpu_cache.LIBRARY_RECORD
    second = gpu_cache.library_identity(lib, tmp_path, write=False)
    assert second == gpu_cache.library_identity(lib, tmp_path) and len(hashed) == 2
    record.unlink()
    assert gpu_cache.library_identity(lib, tmp_path, write=False) == second and len(hashed) == 3 and not record.exists()


def test_models_with_an_embedding_lookup_stay_off_the_sharing_path(tmp_path):
    from pocketdiff.runtime.gpu_cache import WEIGHT_CACHE_OPTIONS, GpuProgramCache, unshareable_ops

    assert unshareable_ops(BUNDLE / "text_encoder.tflite") == ["EMBEDDING_LOOKUP"]
    assert unshareable_ops(BUNDLE / "unet.tflite") == []
    cache = GpuProgramCache(tmp_path, "gpu-a", weight_cache=True)
    te = cache.options_for("text_encoder", {"sha256": "a", "_path": str(BUNDLE / "text_encoder.tflite")})
    unet = cache.options_for("unet", {"sha256": "b", "_path": str(BUNDLE / "unet.tflite")})
    assert not set(WEIGHT_CACHE_OPTIONS) & set(te) and te["serialize_program_cache"] is True
    assert all(unet[k] == v for k, v in WEIGHT_CACHE_OPTIONS.items())
    assert GpuProgramCache(tmp_path, "gpu-a").key("unet", {"sha256": "b"}) != cache.key("unet", {"sha256": "b"})
