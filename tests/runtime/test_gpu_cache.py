"""The GPU program cache folder (runtime/gpu_cache.py): hits, and the bad cases: a cache from another
model/driver/version, corrupt or missing files, an unreadable index, an unwritable folder -- each one
warning line and a rebuild (or no cache), never a crash or a wrong image."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.runtime.gpu_cache import GpuProgramCache, bundle_cache_folder

BUNDLE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle"
ENTRY = {"sha256": "ab" * 32}


def _cache(folder, identity="gpu-a", warnings=None):
    return GpuProgramCache(folder, identity, warn=(warnings if warnings is not None else []).append)


def _compile(cache: GpuProgramCache, name: str, payload: bytes = b"programs") -> Path:
    """What the accelerator does at a load: write its programs where the options say."""
    opts = cache.options_for(name, ENTRY)
    path = Path(opts["serialization_dir"]) / f"{opts['model_cache_key']}_mldrift_program_cache.bin"
    if not path.exists():
        path.write_bytes(payload)
    return path


def _accelerator_writes(cache: GpuProgramCache, name: str, payload: bytes = b"programs") -> Path:
    path = _compile(cache, name, payload)
    cache.record(name)
    return cache.folder / path.name


def test_second_launch_hits_and_keys_depend_on_model_and_identity(tmp_path):
    first = _cache(tmp_path)
    _accelerator_writes(first, "unet")
    assert first.hits == {"unet": False}
    warnings = []
    second = _cache(tmp_path, warnings=warnings)
    opts = second.options_for("unet", ENTRY)
    assert second.hits == {"unet": True} and not warnings
    assert opts["serialize_program_cache"] is True and opts["model_cache_key"].startswith("unet-")
    assert second.key("unet", ENTRY) != second.key("unet", {"sha256": "cd" * 32}) != _cache(tmp_path, "gpu-b").key("unet", ENTRY)


@pytest.mark.parametrize("damage,expect", [
    ("other_driver", "another model, driver or LiteRT version"),
    ("flip_byte", "corrupt or missing"),
    ("delete_file", "corrupt or missing"),
    ("bad_index", "unreadable"),
])
def test_bad_cache_warns_once_and_rebuilds(tmp_path, damage, expect):
    path = _accelerator_writes(_cache(tmp_path), "unet")
    identity = "gpu-a"
    if damage == "other_driver":
        identity = "gpu-b"
    elif damage == "flip_byte":
        path.write_bytes(b"programz")
    elif damage == "delete_file":
        path.unlink()
    else:
        (tmp_path / "index.json").write_text("{not json")
    warnings = []
    cache = _cache(tmp_path, identity, warnings)
    cache.options_for("unet", ENTRY)
    assert len(warnings) == 1 and expect in warnings[0], warnings
    assert cache.hits == {"unet": False}
    assert not list(tmp_path.glob("*_mldrift_*"))  # the stale or damaged files are gone before the rebuild
    fresh = _accelerator_writes(cache, "unet")  # the rebuild is recorded, and hits next time
    again = []
    c2 = _cache(tmp_path, identity, again)
    c2.options_for("unet", ENTRY)
    assert fresh.exists() and c2.hits == {"unet": True} and not again


def test_unwritable_folder_runs_without_a_cache(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    warnings = []
    cache = _cache(blocker / "sub", warnings=warnings)
    assert not cache.enabled and len(warnings) == 1 and "not writable" in warnings[0]
    assert cache.options_for("unet", ENTRY) == {}


def test_default_folder_is_per_bundle(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("POCKETDIFF_CACHE", raising=False)
    a = bundle_cache_folder(BUNDLE, {"unet": {"sha256": "1"}})
    b = bundle_cache_folder(BUNDLE, {"unet": {"sha256": "2"}})
    assert a.parent == tmp_path / "pocketdiff" / "gpu" and a != b and a.name.startswith("smoke_bundle-")


def test_run_bundle_with_a_corrupted_cache_gives_the_same_image(tmp_path, capsys):
    """Through the runner on the real delegate: cold, warm (hits), then a corrupted program file: one
    warning, a rebuild, and the same image as before."""
    from pocketdiff.runtime.run_bundle import generate

    folder = tmp_path / "programs"
    cold, s_cold = generate(BUNDLE, "a red circle", seed=1, gpu_cache=folder)
    warm, s_warm = generate(BUNDLE, "a red circle", seed=1, gpu_cache=folder)
    assert not any(s_cold["memory"]["gpu_cache"]["hits"].values()) and all(s_warm["memory"]["gpu_cache"]["hits"].values())
    victim = next(folder.glob("unet-*_mldrift_program_cache.bin"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    rebuilt, s_rebuilt = generate(BUNDLE, "a red circle", seed=1, gpu_cache=folder)
    err = capsys.readouterr().err
    assert err.count("gpu cache") == 1 and "unet's cached programs are corrupt" in err
    assert s_rebuilt["memory"]["gpu_cache"]["hits"] == {"text_encoder": True, "unet": False, "vae_decoder": True}
    assert np.abs(cold - warm).max() < 1e-6 and np.abs(cold - rebuilt).max() < 1e-6
    index = json.loads((folder / "index.json").read_text())
    assert set(index) == {"text_encoder", "unet", "vae_decoder"}


def test_a_component_loaded_again_in_one_launch_reads_its_files_once(tmp_path, monkeypatch):
    """A streamed UNet chunk loads once per step: its cache files are fingerprinted once per launch, not per load."""
    import pocketdiff.runtime.gpu_cache as gpu_cache

    reads = []
    real = gpu_cache._fingerprint
    monkeypatch.setattr(gpu_cache, "_fingerprint", lambda path: reads.append(path.name) or real(path))
    cold = _cache(tmp_path)
    _accelerator_writes(cold, "unet.0")  # compiled and recorded: one read
    for _ in range(3):
        cold.options_for("unet.0", ENTRY)
        cold.record("unet.0")
    assert len(reads) == 1 and cold.hits == {"unet.0": False}
    warm = _cache(tmp_path)
    opts = [warm.options_for("unet.0", ENTRY) for _ in range(4)]
    assert len(reads) == 2 and warm.hits == {"unet.0": True}  # verified once
    assert all(o == opts[0] for o in opts)
    # another model under the same name is still caught: its key differs, so it is checked afresh
    other = {"sha256": "cd" * 32}
    warm.options_for("unet.0", other)
    assert warm.hits == {"unet.0": False}


def test_launches_compiling_at_once_leave_a_consistent_cache(tmp_path):
    """Two launches compile the same component at once (each writes its own bytes), and a third read the index
    before the second finished: every later launch hits without a warning, and the index names the file there."""
    a, b = _cache(tmp_path), _cache(tmp_path)
    pa, pb = _compile(a, "unet", b"programs-a"), _compile(b, "unet", b"programs-b")
    assert pa.parent != pb.parent != tmp_path  # each compiles into its own private folder
    a.record("unet")
    warnings = []
    early = _cache(tmp_path, warnings=warnings)  # its index holds a's entry
    b.record("unet")  # b's file replaces a's, with its entry
    early.options_for("unet", ENTRY)
    late = _cache(tmp_path, warnings=warnings)
    late.options_for("unet", ENTRY)
    assert early.hits == late.hits == {"unet": True} and not warnings
    files = list(tmp_path.glob("unet-*_mldrift_program_cache.bin"))
    assert len(files) == 1 and files[0].read_bytes() == b"programs-b"
    assert not list(tmp_path.glob(".tmp-*"))  # private folders gone once recorded


def test_entries_of_launches_recording_at_once_are_merged(tmp_path):
    a, b = _cache(tmp_path), _cache(tmp_path)
    _compile(a, "text_encoder"), _compile(b, "unet")
    a.record("text_encoder")
    b.record("unet")  # b read the index before a wrote its entry: merged, not overwritten
    assert set(json.loads((tmp_path / "index.json").read_text())) == {"text_encoder", "unet"}


def test_a_private_folder_left_by_a_killed_launch_is_removed(tmp_path):
    orphan = tmp_path / ".tmp-999999999-dead-unet"
    orphan.mkdir(parents=True)
    (orphan / "x_mldrift_program_cache.bin").write_bytes(b"half")
    _cache(tmp_path)
    assert not orphan.exists()


def test_three_run_bundles_at_once_then_a_fourth_reads_the_cache_without_a_warning(tmp_path):
    """Issue 49's bad input: launches sharing one cache folder at once (the real delegate, three processes)."""
    import subprocess
    import sys

    folder = tmp_path / "programs"
    cmd = lambda i: [sys.executable, "-m", "pocketdiff.cli", "run-bundle", str(BUNDLE), "--prompt", "a red circle",
                     "--seed", "1", "--gpu-cache", str(folder), "--output", str(tmp_path / f"img{i}")]
    procs = [subprocess.Popen(cmd(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-800:] for o in outs]
    fourth = subprocess.run(cmd(3), capture_output=True, text=True, timeout=600)
    assert fourth.returncode == 0, fourth.stderr[-800:]
    assert "gpu cache" not in fourth.stderr, fourth.stderr[-800:]
    report = json.loads((tmp_path / "img3" / "report.json").read_text())
    assert all(report["memory"]["gpu_cache"]["hits"].values()), report["memory"]["gpu_cache"]
    images = [np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(next((tmp_path / f"img{i}").glob("*.png")))) for i in range(4)]
    assert all(np.array_equal(images[0], im) for im in images[1:])
