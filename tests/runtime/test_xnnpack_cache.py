"""XNNPACK's packed-weight cache for CPU models (runtime/xnnpack_cache.py), on the tiny smoke bundle's int8 text encoder
(its CPU variant: fp16 weights and fp32 direct filters, which XNNPACK packs at each load): made once, reused (same
inode, same mtime), keyed by the model and the LiteRT build, and each of issue 66's bad inputs (a read-only folder, a
full disk, a truncated or replaced file, a cache of another build, two launches at once): the model loads, one warning
line, the same outputs. No timings are asserted."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.runtime import xnnpack_cache as xc
from pocketdiff.runtime.loaded_model import LoadedModel

TE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle_tiny" / "text_encoder.tflite"
# The cached run maps the same packed bytes XNNPACK would pack afresh, into the same kernels: the outputs should match
# bit for bit; the tolerance only allows for a reduction order that may differ between thread schedules.
ATOL = 1e-6


@pytest.fixture(scope="module")
def entry():
    sha = hashlib.sha256(TE.read_bytes()).hexdigest()
    man = json.loads((TE.parent / "manifest.json").read_text())["components"]["text_encoder"]
    assert man["weights"] == "int8"
    return {"_path": str(TE), "sha256": sha, "weights": "int8"}


@pytest.fixture(scope="module")
def feeds(entry):
    m = LoadedModel("text_encoder", entry, "cpu")
    rng = np.random.default_rng(0)
    out = {n: rng.integers(0, 50, size=[int(s) for s in d["shape"]]).astype(np.dtype(d["dtype"]))
           for n, d in m.in_details.items()}
    m.close()
    return out


@pytest.fixture(scope="module")
def reference(entry, feeds):
    m = LoadedModel("text_encoder", entry, "cpu")  # no cache at all
    assert m.xnnpack_cache == "off"
    out = m.run_all(feeds)
    m.close()
    return out


def load(entry, feeds, folder, warnings=None, tmp=None):
    cache = xc.XnnpackWeightCache(folder, warn=(warnings.append if warnings is not None else None))
    m = LoadedModel("text_encoder", entry, "cpu", cpu_variant_dir=tmp, xnnpack_cache=cache)
    outs = m.run_all(feeds)
    m.close()
    return m.xnnpack_cache, outs


def finals(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob(f"*{xc.SUFFIX}") if not p.name.startswith(xc.PRIVATE))


def same(outs, reference):
    for a, b in zip(outs, reference):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_made_once_then_reused_with_the_same_outputs(entry, feeds, reference, tmp_path):
    folder = tmp_path / "xnnpack"
    state, outs = load(entry, feeds, folder, tmp=tmp_path / "cpu")
    assert state == "made"
    (f,) = finals(folder)
    assert f.name.startswith("text_encoder-") and f.stat().st_size > 0
    assert Path(str(f) + ".ok").is_file()
    before = f.stat()
    same(outs, reference)
    warnings: list[str] = []
    state, outs = load(entry, feeds, folder, warnings, tmp=tmp_path / "cpu")
    assert state == "reused" and warnings == []
    after = f.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert [p.name for p in folder.iterdir() if p.name.startswith(xc.PRIVATE)] == []  # no private file left
    same(outs, reference)


def test_another_model_or_litert_build_never_reads_the_file(entry, feeds, reference, tmp_path, monkeypatch):
    folder = tmp_path / "xnnpack"
    load(entry, feeds, folder)
    (first,) = finals(folder)
    monkeypatch.setattr("pocketdiff.runtime.gpu_cache.litert_version", lambda: "0.0.0-another-build")
    state, outs = load(entry, feeds, folder)
    assert state == "made"  # another key: packed afresh, the other build's file removed
    (second,) = finals(folder)
    assert second.name != first.name
    same(outs, reference)
    monkeypatch.undo()
    state, _ = load({**entry, "sha256": "0" * 64}, feeds, folder)  # a changed model file (its checked sha256)
    assert state == "made" and finals(folder)[0].name not in (first.name, second.name)


@pytest.mark.parametrize("damage", ["truncated", "replaced", "no_sidecar"])
def test_a_damaged_file_is_packed_again_with_one_warning(entry, feeds, reference, tmp_path, damage):
    folder = tmp_path / "xnnpack"
    load(entry, feeds, folder)
    (f,) = finals(folder)
    data = f.read_bytes()
    if damage == "truncated":  # cut as a killed launch or a full disk would leave it
        f.write_bytes(data[: len(data) // 2])
    elif damage == "replaced":  # same size, other bytes
        f.write_bytes(bytes(len(data)))
    else:
        Path(str(f) + ".ok").unlink()
    warnings: list[str] = []
    state, outs = load(entry, feeds, folder, warnings)
    assert state == "made" and len(warnings) == 1 and "damaged or incomplete" in warnings[0], warnings
    assert str(f) in warnings[0]
    same(outs, reference)
    assert f.read_bytes() == data  # packed again: the same bytes as the first time
    assert load(entry, feeds, folder)[0] == "reused"


def test_a_folder_that_cannot_be_written_loads_without_the_cache(entry, feeds, reference, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a folder under a regular file cannot be made (root ignores permission bits)
    warnings: list[str] = []
    state, outs = load(entry, feeds, blocker / "xnnpack", warnings)
    assert state == "off" and len(warnings) == 1 and "not writable" in warnings[0], warnings
    same(outs, reference)


def test_a_full_disk_at_keep_time_keeps_nothing_with_one_warning(entry, feeds, reference, tmp_path, monkeypatch):
    folder = tmp_path / "xnnpack"

    def full(self, private, final, fp):
        final.write_bytes(Path(private).read_bytes()[:100])  # cut where the disk filled
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(xc.XnnpackWeightCache, "_publish", full)
    warnings: list[str] = []
    state, outs = load(entry, feeds, folder, warnings)
    assert len(warnings) == 1 and "not kept" in warnings[0] and "No space left" in warnings[0], warnings
    same(outs, reference)
    assert finals(folder) == [] and [p for p in folder.iterdir() if p.name.startswith(xc.PRIVATE)] == []
    monkeypatch.undo()
    assert load(entry, feeds, folder)[0] == "made"  # the next launch packs and keeps it


def test_a_load_that_fails_with_the_cache_loads_without_it(entry, feeds, reference, tmp_path, monkeypatch):
    real = LoadedModel._load_cpu

    def failing(self, path, on_phase, threads=None, weight_cache=""):
        if weight_cache:
            Path(weight_cache).write_bytes(b"half")  # what XNNPACK may have written before failing
            raise RuntimeError("simulated XNNPACK failure")
        return real(self, path, on_phase, threads)

    monkeypatch.setattr(LoadedModel, "_load_cpu", failing)
    folder = tmp_path / "xnnpack"
    warnings: list[str] = []
    state, outs = load(entry, feeds, folder, warnings)
    assert state == "off" and len(warnings) == 1 and "loaded without" in warnings[0], warnings
    same(outs, reference)
    assert sorted(p.name for p in folder.iterdir() if p.name != xc.LOCK) == []  # the half file went


def test_orphans_of_a_killed_launch_are_removed(tmp_path):
    folder = tmp_path / "xnnpack"
    folder.mkdir()
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = folder / f"{xc.PRIVATE}{p.stdout.strip()}-abcd-text_encoder-x{xc.SUFFIX}"
    gone.write_bytes(b"partial")
    xc.XnnpackWeightCache(folder)
    assert not gone.exists()


TWO = """
import json, sys
import numpy as np
from pocketdiff.runtime import xnnpack_cache as xc
from pocketdiff.runtime.loaded_model import LoadedModel
entry, folder, feeds = json.loads(sys.argv[1]), sys.argv[2], np.load(sys.argv[3])
m = LoadedModel("text_encoder", entry, "cpu", xnnpack_cache=xc.XnnpackWeightCache(folder))
np.save(sys.argv[4], m.run_all({k: feeds[k] for k in feeds.files})[0])
print(m.xnnpack_cache)
"""


def test_two_launches_at_once_keep_one_good_file(entry, feeds, reference, tmp_path):
    folder = tmp_path / "xnnpack"
    np.savez(tmp_path / "feeds.npz", **feeds)
    procs = [subprocess.Popen([sys.executable, "-c", TWO, json.dumps(entry), str(folder), str(tmp_path / "feeds.npz"),
                               str(tmp_path / f"out{i}.npy")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] in ("made", "reused")
        assert "warning" not in err, err[-2000:]
    for i in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"out{i}.npy"), reference[0], atol=ATOL, rtol=0)
    (f,) = finals(folder)
    assert xc.XnnpackWeightCache._good(f)
    assert [p.name for p in folder.iterdir() if p.name.startswith(xc.PRIVATE)] == []
    assert load(entry, feeds, folder)[0] == "reused"


def test_the_packed_file_is_kept_after_the_first_run_and_not_for_a_model_that_never_ran(entry, feeds, tmp_path):
    folder = tmp_path / "xnnpack"
    m = LoadedModel("text_encoder", entry, "cpu", xnnpack_cache=xc.XnnpackWeightCache(folder))
    assert m.xnnpack_cache == "made" and finals(folder) == []  # loaded, not yet run: under its private name
    m.close()
    assert finals(folder) == [] and [p for p in folder.iterdir() if p.name.startswith(xc.PRIVATE)] == []
    m = LoadedModel("text_encoder", entry, "cpu", xnnpack_cache=xc.XnnpackWeightCache(folder))
    m.run_all(feeds)
    assert len(finals(folder)) == 1  # kept at the first run, before close
    m.close()
