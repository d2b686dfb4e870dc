"""run-bundle --weight-cache's parity check in the trial compile (runtime/sharing_child.py, runtime/sharing_trial.py): a
model's outputs with constant sharing are compared in the child with its compile without sharing; one that misses
gpu_cache.SHARING_MIN_COSINE / SHARING_MIN_PSNR_DB gets the verdict "wrong output" in sharing.json, loads without the
weight cache with one warning line naming it and the figures, and later launches start no child.

On lavapipe the sharing path agrees (the UNet bit-identical, the decoder ~62 dB); a sharing path that computes
something else (NVIDIA's Vulkan driver: images 18.7 dB off) is stood for by the cache's test-only `_perturb_trials`,
passed to its constructor in the launch's own process (WRAP): the child adds noise of 10 % of each output's range
(~20 dB) to the decoder's sharing outputs. Every launch is a subprocess; images are compared with the launch without
any cache, as in tests/runtime/test_weight_cache.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from test_weight_cache import (BUNDLE, PSNR_BAR, image, launch, launch_with, needs_library, ok, psnr,  # same folder
                               uncached_image, warnings_of)

WRAP = ("import sys, functools\nimport pocketdiff.runtime.gpu_cache as g\n"
        "g.GpuProgramCache = functools.partial(g.GpuProgramCache, _perturb_trials={'vae_decoder': 0.1})\n"
        "from pocketdiff.cli import main\nsys.exit(main(sys.argv[1:]))\n")


def perturbed(out: Path, folder: Path):
    return launch_with(WRAP, out, folder)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return uncached_image(tmp_path_factory, "parity")


@needs_library
def test_the_smoke_bundle_passes_the_parity_check(reference, tmp_path):
    from pocketdiff.runtime.gpu_cache import SHARING_MIN_COSINE, SHARING_MIN_PSNR_DB

    folder = tmp_path / "cache"
    proc = launch(tmp_path / "out", "--gpu-cache", str(folder), "--weight-cache")
    gc = ok(proc, tmp_path / "out")["gpu_cache"]
    assert not warnings_of(proc.stderr), proc.stderr[-2000:]
    assert gc["trial_compiles"] == {"unet": "shared", "vae_decoder": "shared"}
    index, verdicts = (json.loads((folder / f).read_text()) for f in ("index.json", "sharing.json"))
    for name in ("unet", "vae_decoder"):
        v = verdicts[index[name]["key"]]
        psnr_db = math.inf if v["psnr_db"] == "inf" else v["psnr_db"]
        assert v["shared"] is True and v["cosine"] >= SHARING_MIN_COSINE and psnr_db >= SHARING_MIN_PSNR_DB, v
    assert psnr(image(tmp_path / "out"), reference) >= PSNR_BAR


@needs_library
def test_a_wrong_output_is_recorded_warned_once_and_loaded_without_sharing(reference, tmp_path):
    folder = tmp_path / "cache"
    first = perturbed(tmp_path / "first", folder)
    gc = ok(first, tmp_path / "first")["gpu_cache"]
    lines = warnings_of(first.stderr)
    assert len(lines) == 1 and "vae_decoder" in lines[0] and "without the weight cache" in lines[0], first.stderr[-2000:]
    assert "SHARING_MIN_PSNR_DB=40.0" in lines[0] and "PSNR " in lines[0]
    assert gc["trial_compiles"]["unet"] == "shared" and gc["trial_compiles"]["vae_decoder"].startswith("output off (cosine ")
    by = gc["weight_cache_by_model"]
    assert by["unet"] == "made" and by["vae_decoder"] == f"skipped: {gc['trial_compiles']['vae_decoder']}"
    index, verdicts = (json.loads((folder / f).read_text()) for f in ("index.json", "sharing.json"))
    v = verdicts[index["vae_decoder"]["key"]]
    assert v["shared"] is False and v["verdict"] == "wrong output" and 10 < v["psnr_db"] < 30, v
    assert not any(f.endswith("_weight_cache.bin") for f in index["vae_decoder"]["files"])  # its programs only
    assert not list(folder.glob(".tmp-*"))
    assert psnr(image(tmp_path / "first"), reference) >= PSNR_BAR

    again = perturbed(tmp_path / "again", folder)  # the verdict read: no child, no warning, the same skip
    gc2 = ok(again, tmp_path / "again")["gpu_cache"]
    assert not warnings_of(again.stderr) and gc2["trial_compiles"] == {}, again.stderr[-1500:]
    assert gc2["weight_cache_by_model"] == {**by, "unet": "reused"}
    assert psnr(image(tmp_path / "again"), reference) >= PSNR_BAR


# ---------------------------------------------------------------------- without a GPU: verdicts, options, records


def test_the_floors_decide_the_verdict_and_nan_fails():
    from pocketdiff.runtime.gpu_cache import SHARING_MIN_COSINE, SHARING_MIN_PSNR_DB, verdict_label
    from pocketdiff.runtime.sharing_trial import parity_verdict

    assert parity_verdict({"cosine": 1.0, "psnr_db": math.inf}) == {"shared": True, "cosine": 1.0, "psnr_db": "inf"}
    assert parity_verdict({"cosine": 0.9999995, "psnr_db": 61.9})["shared"] is True  # lavapipe's decoder
    low = parity_verdict({"cosine": 0.91, "psnr_db": 18.7, "where": "warm output 0"})
    assert low["shared"] is False and low["verdict"] == "wrong output" and low["min_psnr_db"] == SHARING_MIN_PSNR_DB
    assert verdict_label(low) == "output off (cosine 0.91, PSNR 18.7 dB)"
    assert parity_verdict({"cosine": SHARING_MIN_COSINE - 1e-6, "psnr_db": 80.0})["shared"] is False  # each floor counts
    nan = parity_verdict({"cosine": math.nan, "psnr_db": math.nan})
    assert nan["shared"] is False and verdict_label(nan) == "output off (cosine NaN/Inf, PSNR NaN/Inf)"
    json.dumps(nan, allow_nan=False)  # sharing.json stays strict JSON
    assert parity_verdict({"cosine": 0.99, "psnr_db": 35.0}, min_psnr_db=30.0, min_cosine=0.9)["shared"] is True


def test_a_wrong_output_drops_sharing_and_the_childs_files(tmp_path, monkeypatch, capsys):
    import pocketdiff.runtime.sharing_trial as st
    from pocketdiff.runtime.gpu_cache import WEIGHT_CACHE_OPTIONS, read_verdicts

    seen = {}
    monkeypatch.setattr(st, "trial_compile", lambda *a: seen.setdefault("trial", a[-1]) and st.parity_verdict(
        {"cosine": 0.95, "psnr_db": 19.0, "where": "cold output 0"}))
    private = tmp_path / ".tmp-1-vae"
    private.mkdir()
    (private / "vae-k_mldrift_weight_cache.bin").write_bytes(b"weights made with sharing")
    options = {"serialization_dir": str(private), "model_cache_key": "vae-k", "serialize_program_cache": True,
               **WEIGHT_CACHE_OPTIONS}
    lib = type("Lib", (), {"which": "litert-lm", "path": Path("liblitert-lm.so")})()
    trial = {"folder": str(tmp_path), "key": "vae-k", "name": "vae", "golden": "g/vae.npz"}
    got = st.first_compile("m/vae.tflite", dict(options), trial, lib)
    assert got == {k: v for k, v in options.items() if k not in WEIGHT_CACHE_OPTIONS}
    assert seen["trial"]["golden"] == "g/vae.npz" and not list(private.iterdir())
    assert not capsys.readouterr().err.strip()  # recorded: the runner's cache tells it
    v = read_verdicts(tmp_path)["vae-k"]
    assert v["verdict"] == "wrong output" and v["psnr_db"] == 19.0 and v["name"] == "vae"


def test_the_cache_reads_a_wrong_output_and_retries_a_cached_model_without_a_verdict(tmp_path):
    from pocketdiff.runtime.gpu_cache import TRIAL_OPTION, WEIGHT_CACHE_OPTIONS, GpuProgramCache, write_verdict
    from pocketdiff.runtime.sharing_trial import parity_verdict

    entry = {"sha256": "a", "_path": str(BUNDLE / "unet.tflite"), "golden": {"_path": "g/a.npz"}}
    cache = GpuProgramCache(tmp_path, "gpu-a", weight_cache=True, _perturb_trials={"a": 0.1})
    opts = cache.options_for("a", entry)
    assert opts[TRIAL_OPTION]["golden"] == "g/a.npz" and opts[TRIAL_OPTION]["perturb"] == 0.1
    write_verdict(tmp_path, cache.key("a", entry), {"name": "a", **parity_verdict({"cosine": 0.9, "psnr_db": 20.0})})
    told = []
    cache.warn = told.append
    cache.record("a")
    assert cache.trials["a"] == "output off (cosine 0.9, PSNR 20.0 dB)" and len(told) == 1 and "a's output" in told[0]
    later = GpuProgramCache(tmp_path, "gpu-a", weight_cache=True)
    opts = later.options_for("a", entry)
    assert not set(WEIGHT_CACHE_OPTIONS) & set(opts) and TRIAL_OPTION not in opts
    assert later.weight_files()["a"] == "skipped: output off (cosine 0.9, PSNR 20.0 dB)"

    # an index entry made while the trial told nothing (an error in the child): dropped and tried again
    other = tmp_path / "other"
    other.mkdir()
    first = GpuProgramCache(other, "gpu-a", weight_cache=True)
    key = first.key("b", entry)
    (other / f"{key}_mldrift_program_cache.bin").write_bytes(b"programs")
    from pocketdiff.runtime.gpu_cache import _fingerprint

    (other / "index.json").write_text(json.dumps({"b": {"key": key, "files": {
        f"{key}_mldrift_program_cache.bin": _fingerprint(other / f"{key}_mldrift_program_cache.bin")}}}))
    again = GpuProgramCache(other, "gpu-a", weight_cache=True)
    opts = again.options_for("b", entry)
    assert TRIAL_OPTION in opts and again.hits["b"] is False and not (other / f"{key}_mldrift_program_cache.bin").exists()
