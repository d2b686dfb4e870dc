"""runtime/verified_files.py: a launch hashes and checks only the bundle files changed since an earlier launch checked them;
a changed file (even one with its size and modification time put back) is hashed again and refused on a
mismatch; a damaged ledger costs one warning and a full hash."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime import bundle as bundle_mod
from pocketdiff.runtime.bundle import load_manifest
from pocketdiff.runtime.verified_files import HashLedger, ledger_path

SMOKE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle_tiny"


@pytest.fixture
def bundle(tmp_path) -> Path:
    return shutil.copytree(SMOKE, tmp_path / "bundle")


@pytest.fixture
def hashed(monkeypatch) -> list:
    """The files sha256_file was asked to hash, in order."""
    seen = []
    real = bundle_mod.sha256_file

    def counting(path):
        seen.append(Path(path).name)
        return real(path)
    monkeypatch.setattr(bundle_mod, "sha256_file", counting)
    return seen


def _launch(bundle: Path, warnings: list) -> dict:
    return load_manifest(bundle, ledger=HashLedger(bundle.parent / "cache" / "verified.json", warn=warnings.append))


def test_a_second_launch_hashes_nothing_unchanged_and_a_changed_file_again(bundle, hashed):
    warnings = []
    _launch(bundle, warnings)
    first = sorted(hashed)
    assert "unet.0.tflite" in first and len(first) >= 8
    hashed.clear()
    _launch(bundle, warnings)
    assert hashed == [] and warnings == []
    # the same bytes written again: a new status-change time, so hashed again (and the ledger refreshed)
    (bundle / "unet.1.tflite").write_bytes((bundle / "unet.1.tflite").read_bytes())
    _launch(bundle, warnings)
    assert hashed == ["unet.1.tflite"]


def test_a_known_graph_skips_the_structure_check_it_passed_and_a_changed_one_does_not(bundle, hashed, monkeypatch):
    checked = []
    real = bundle_mod.check_tflite_file
    monkeypatch.setattr(bundle_mod, "check_tflite_file", lambda p: (checked.append(Path(p).name), real(p)))
    warnings = []
    _launch(bundle, warnings)
    assert "unet.0.tflite" in checked
    checked.clear()
    (bundle / "unet.0.tflite").write_bytes((bundle / "unet.0.tflite").read_bytes())
    _launch(bundle, warnings)
    assert checked == ["unet.0.tflite"]


def test_a_file_changed_with_its_size_and_times_put_back_is_refused(bundle, hashed):
    warnings = []
    _launch(bundle, warnings)
    target = bundle / "unet.2.tflite"
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as the ledger has them
    with pytest.raises(PocketdiffError, match=r"sha256 mismatch for unet.2.tflite"):
        _launch(bundle, warnings)


@pytest.mark.parametrize("damage", ["{not json", json.dumps({"version": 99, "files": {}}),
                                    json.dumps({"version": 1, "files": {"x": "y"}})])
def test_a_damaged_ledger_is_one_warning_and_a_full_hash(bundle, hashed, damage):
    ledger = bundle.parent / "cache" / "verified.json"
    ledger.parent.mkdir()
    ledger.write_text(damage)
    warnings = []
    _launch(bundle, warnings)
    assert len(warnings) == 1 and "every file is hashed again" in warnings[0]
    assert "unet.0.tflite" in hashed
    assert json.loads(ledger.read_text())["version"] == 1  # rewritten whole


def test_a_refused_bundle_leaves_the_ledger_unwritten(bundle):
    (bundle / "unet.3.tflite").write_bytes(b"x" * 64)
    warnings = []
    with pytest.raises(PocketdiffError):
        _launch(bundle, warnings)
    assert not (bundle.parent / "cache" / "verified.json").exists()


def test_an_unwritable_ledger_folder_costs_only_the_saving(bundle, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    warnings = []
    load_manifest(bundle, ledger=HashLedger(blocker / "verified.json", warn=warnings.append))
    assert len(warnings) == 1 and "not written" in warnings[0]


def test_the_ledger_lives_in_the_given_cache_folder_or_one_per_bundle(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKETDIFF_CACHE", str(tmp_path / "c"))
    assert ledger_path(tmp_path / "b", tmp_path / "g") == tmp_path / "g" / "verified.json"
    a, b = ledger_path(tmp_path / "x" / "b"), ledger_path(tmp_path / "y" / "b")
    assert a != b and a.parent == tmp_path / "c" / "verified" and a.name.startswith("b-")


def test_run_bundle_keeps_the_ledger_with_its_gpu_cache_and_none_without_one(tmp_path, monkeypatch):
    from pocketdiff.cli import build_parser
    from pocketdiff.runtime.run_bundle import hash_ledger

    monkeypatch.setenv("POCKETDIFF_CACHE", str(tmp_path / "c"))
    parse = lambda *more: build_parser().parse_args(["run-bundle", str(tmp_path / "b"), "--prompt", "x", "--output", "o", *more])
    assert hash_ledger(parse("--no-gpu-cache")) is None
    assert hash_ledger(parse("--gpu-cache", str(tmp_path / "g"))).path == tmp_path / "g" / "verified.json"
    assert hash_ledger(parse()).path.parent == tmp_path / "c" / "verified"
