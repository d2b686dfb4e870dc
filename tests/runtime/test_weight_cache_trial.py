"""run-bundle --weight-cache's crash-isolating first compile (runtime/sharing_trial.py): a model whose compile with
constant sharing aborts litert-lm-api's library is tried in a child, recorded as unsupported in the cache folder and
loaded without the weight cache; later launches read the record and start no child.

The smoke bundle's text encoder (a float EMBEDDING_LOOKUP table) aborts that library (a CHECK, SIGABRT). The runner
keeps such models off sharing ahead (gpu_cache.UNSHAREABLE_OPS), so the launches here empty that table first (WRAP):
the text encoder then stands for a model whose abort nobody foresaw. Every launch is a subprocess; images are compared
with the launch without any cache, as in tests/runtime/test_weight_cache.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_weight_cache import (BUNDLE, PSNR_BAR, image, launch, launch_with, needs_library, ok, psnr,  # same folder
                               uncached_image, warnings_of)

WRAP = ("import sys\nimport pocketdiff.runtime.gpu_cache as g\ng.UNSHAREABLE_OPS.clear()\n"
        "from pocketdiff.cli import main\nsys.exit(main(sys.argv[1:]))\n")
ABORTED = "aborted (SIGABRT)"


def unforeseen(out: Path, folder: Path, *flags: str):
    """run-bundle --weight-cache into FOLDER, with no op known to abort."""
    return launch_with(WRAP, out, folder, *flags)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return uncached_image(tmp_path_factory, "trial")


def check_first_launch(proc, out: Path, folder: Path, ref) -> None:
    report = ok(proc, out)
    lines = warnings_of(proc.stderr)
    assert len(lines) == 1 and "text_encoder" in lines[0] and "SIGABRT" in lines[0], proc.stderr[-2000:]
    assert "EMBEDDING_LOOKUP" in lines[0] and "without the weight cache" in lines[0]  # the CHECK's own words
    gc = report["gpu_cache"]
    assert gc["trial_compiles"] == {"text_encoder": ABORTED, "unet": "shared", "vae_decoder": "shared"}
    assert gc["weight_cache_by_model"] == {"text_encoder": f"skipped: {ABORTED}", "unet": "made", "vae_decoder": "made"}
    index, verdicts = (json.loads((folder / f).read_text()) for f in ("index.json", "sharing.json"))
    te = verdicts[index["text_encoder"]["key"]]
    assert te["shared"] is False and te["signal"] == "SIGABRT" and te["name"] == "text_encoder"
    assert all(verdicts[index[n]["key"]]["shared"] is True for n in ("unet", "vae_decoder"))
    assert not any(f.endswith("_weight_cache.bin") for f in index["text_encoder"]["files"])  # its programs only
    assert not list(out.parent.glob("core*"))
    assert psnr(image(out), ref) >= PSNR_BAR


@needs_library
def test_an_aborting_model_is_recorded_and_loaded_without_the_weight_cache(reference, tmp_path):
    folder = tmp_path / "cache"
    first = unforeseen(tmp_path / "first", folder)
    check_first_launch(first, tmp_path / "first", folder, reference)

    again = unforeseen(tmp_path / "again", folder)  # everything cached: the record read, no child
    gc = ok(again, tmp_path / "again")["gpu_cache"]
    assert not warnings_of(again.stderr) and gc["trial_compiles"] == {}, again.stderr[-1500:]
    assert gc["weight_cache_by_model"] == {"text_encoder": f"skipped: {ABORTED}", "unet": "reused", "vae_decoder": "reused"}
    assert psnr(image(tmp_path / "again"), reference) >= PSNR_BAR

    for p in folder.glob("*_mldrift_*.bin"):  # programs gone, the verdicts kept: compiled afresh, still no child
        p.unlink()
    (folder / "index.json").unlink()
    fresh = unforeseen(tmp_path / "fresh", folder)
    gc = ok(fresh, tmp_path / "fresh")["gpu_cache"]
    assert not warnings_of(fresh.stderr) and gc["trial_compiles"] == {}, fresh.stderr[-1500:]
    assert gc["weight_cache_by_model"] == {"text_encoder": f"skipped: {ABORTED}", "unet": "made", "vae_decoder": "made"}
    assert psnr(image(tmp_path / "fresh"), reference) >= PSNR_BAR


@needs_library
def test_the_trial_runs_where_the_model_compiles_a_load_worker(reference, tmp_path):
    """--load-workers 1: the worker runs the trial (its warning on the shared stderr); the runner reads the verdict."""
    folder = tmp_path / "cache"
    check_first_launch(unforeseen(tmp_path / "w", folder, "--load-workers", "1"), tmp_path / "w", folder, reference)


# ---------------------------------------------------------------------- without a GPU: the record and the options


def test_verdicts_merge_and_a_components_older_keys_go(tmp_path):
    from pocketdiff.runtime.gpu_cache import read_verdicts, write_verdict

    write_verdict(tmp_path, "unet-old", {"name": "unet", "shared": True})
    write_verdict(tmp_path, "vae-a", {"name": "vae", "shared": False, "signal": "SIGABRT"})
    write_verdict(tmp_path, "unet-new", {"name": "unet", "shared": False, "signal": "SIGSEGV"})
    assert read_verdicts(tmp_path) == {"vae-a": {"name": "vae", "shared": False, "signal": "SIGABRT"},
                                       "unet-new": {"name": "unet", "shared": False, "signal": "SIGSEGV"}}
    (tmp_path / "sharing.json").write_text("{not json")
    assert read_verdicts(tmp_path) == {}  # unreadable: every model tried again (safe)


@pytest.mark.parametrize("verdict", [{"shared": False, "signal": "SIGABRT", "message": "x.cc:1] Only affine"},
                                     {"shared": True}, None])
def test_first_compile_keeps_or_drops_sharing_by_the_childs_verdict(tmp_path, monkeypatch, capsys, verdict):
    import pocketdiff.runtime.sharing_trial as st
    from pocketdiff.runtime.gpu_cache import WEIGHT_CACHE_OPTIONS, read_verdicts

    monkeypatch.setattr(st, "trial_compile", lambda *a: verdict)
    private = tmp_path / ".tmp-1-unet"
    private.mkdir()
    (private / "unet-k_mldrift_weight_cache.bin").write_bytes(b"half")  # what a dead child may leave
    options = {"serialization_dir": str(private), "model_cache_key": "unet-k", "serialize_program_cache": True,
               **WEIGHT_CACHE_OPTIONS}
    lib = type("Lib", (), {"which": "litert-lm", "path": Path("liblitert-lm.so")})()
    got = st.first_compile("m/unet.tflite", dict(options), {"folder": str(tmp_path), "key": "unet-k", "name": "unet"}, lib)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    if verdict is not None and verdict["shared"]:
        assert got == options and not err
        assert read_verdicts(tmp_path) == {"unet-k": {"name": "unet", "shared": True}}
    else:  # aborted, or the child told nothing (an error status): sharing unchecked is never used
        assert got == {k: v for k, v in options.items() if k not in WEIGHT_CACHE_OPTIONS}
        assert not err  # the runner's cache tells it when it reads the verdict (a worker's stderr is a log)
        assert not list(private.iterdir())
        assert read_verdicts(tmp_path) == ({} if verdict is None else {"unet-k": {"name": "unet", **verdict}})


def test_the_cache_asks_for_a_trial_only_without_a_verdict(tmp_path):
    from pocketdiff.runtime.gpu_cache import TRIAL_OPTION, WEIGHT_CACHE_OPTIONS, GpuProgramCache, write_verdict

    entries = {n: {"sha256": n, "_path": str(BUNDLE / "unet.tflite")} for n in ("a", "b", "c")}
    probe = GpuProgramCache(tmp_path, "gpu-a", weight_cache=True)
    write_verdict(tmp_path, probe.key("a", entries["a"]), {"name": "a", "shared": False, "signal": "SIGABRT"})
    write_verdict(tmp_path, probe.key("b", entries["b"]), {"name": "b", "shared": True})
    cache = GpuProgramCache(tmp_path, "gpu-a", weight_cache=True)
    a, b, c = (cache.options_for(n, entries[n]) for n in "abc")
    assert not set(WEIGHT_CACHE_OPTIONS) & set(a) and TRIAL_OPTION not in a  # recorded abort: programs only, no child
    assert set(WEIGHT_CACHE_OPTIONS) <= set(b) and TRIAL_OPTION not in b  # recorded success: shared, no child
    assert set(WEIGHT_CACHE_OPTIONS) <= set(c) and c[TRIAL_OPTION]["key"] == cache.key("c", entries["c"])
    assert cache.weight_files()["a"] == f"skipped: {ABORTED}" and cache.trials == {"c": "pending"}
    write_verdict(tmp_path, cache.key("c", entries["c"]), {"name": "c", "shared": False, "signal": "SIGSEGV", "message": "m"})
    told = []
    cache.warn = told.append
    cache.record("c")  # after its load: the verdict read, one line naming the model
    assert cache.trials["c"] == "aborted (SIGSEGV)" and cache.weight_files()["c"] == "skipped: aborted (SIGSEGV)"
    assert len(told) == 1 and told[0].startswith("gpu weight cache: c aborted") and "SIGSEGV: m" in told[0]
