import subprocess
import sys

import pytest

from pocketdiff.cli import VERBS, main

EXPECTED = ["train-teacher", "distill", "calibrate", "prune", "evaluate", "export", "run-bundle", "demo", "train-clip"]


def test_help_lists_every_verb():
    out = subprocess.run([sys.executable, "-m", "pocketdiff", "--help"], capture_output=True, text=True, check=True).stdout
    for verb in EXPECTED:
        assert verb in out
    assert list(VERBS)[: len(EXPECTED)] == EXPECTED


def test_a_verb_whose_issue_has_not_landed_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(VERBS, "prune", None)
    assert main(["prune", "--output", str(tmp_path / "o")]) == 2
    assert "not implemented yet" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_missing_config_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pocketdiff", "train-teacher", "--config", str(tmp_path / "nope.yaml"),
                        "--output", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope.yaml" in lines[0] and "Traceback" not in r.stderr


def test_existing_output_is_not_overwritten(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    keep = out / "precious.txt"
    keep.write_text("mine")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 1\n")
    r = subprocess.run([sys.executable, "-m", "pocketdiff", "train-teacher", "--config", str(cfg), "--output", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--overwrite" in r.stderr
    assert keep.read_text() == "mine"


def test_bad_input_found_while_running_leaves_no_folder(tmp_path, monkeypatch):
    import dataclasses
    import types

    from pocketdiff.errors import PocketdiffError

    @dataclasses.dataclass
    class Config:
        seed: int = 0

    def run(cfg, out, resume=None):
        (out / "partial.txt").write_text("half")
        raise PocketdiffError("weights contain NaN")

    module = types.SimpleNamespace(Config=Config, run=run)
    monkeypatch.setitem(VERBS, "prune", "fake_stage_module")
    monkeypatch.setitem(sys.modules, "fake_stage_module", module)
    assert main(["prune", "--output", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "old"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert main(["prune", "--output", str(existing)]) == 2  # non-empty: refused before running
    assert (existing / "keep.txt").read_text() == "mine"
