import os
import subprocess
import sys

import pytest

from pocketdiff.cli import VERBS, main

EXPECTED = ["train-teacher", "distill", "calibrate", "prune", "evaluate", "export", "run-bundle", "verify-bundle", "demo",
            "train-clip"]


def test_help_lists_every_verb():
    out = subprocess.run([sys.executable, "-m", "pocketdiff", "--help"], capture_output=True, text=True, check=True).stdout
    for verb in EXPECTED:
        assert verb in out
    assert list(VERBS)[: len(EXPECTED)] == EXPECTED


def test_help_is_current():
    out = subprocess.run([sys.executable, "-m", "pocketdiff", "--help"], capture_output=True, text=True, check=True).stdout
    assert "consistency" in " ".join(out.split())
    assert "not implemented" not in out and "not landed" not in open(main.__code__.co_filename).read()


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


TWO_PROCESS_STAGE = '''
import dataclasses, os, sys, types
from accelerate import PartialState
from pocketdiff import cli

@dataclasses.dataclass
class Config:
    seed: int = 0

def run(cfg, out, resume=None):
    (out / f"ran-by-{os.environ['RANK']}-of-{PartialState().num_processes}").write_text("x")
    return {}

sys.modules["fake_stage_module"] = types.SimpleNamespace(Config=Config, run=run)
cli.VERBS["prune"] = "fake_stage_module"
sys.exit(cli.main(["prune", "--output", sys.argv[1]]))
'''


def _launch_two(script, out, port):
    """Both ranks of an `accelerate launch --cpu --num_processes 2` (its environment, without the launcher)."""
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, ACCELERATE_USE_CPU="True", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), str(out)], env=env, stderr=subprocess.PIPE, text=True))
    return [(p.wait(timeout=300), p.stderr.read()) for p in procs]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_share_one_output_folder_and_a_refusal(tmp_path):
    """Under `accelerate launch` the main process prepares the folder; every process runs the
    stage in it. A folder the main process refuses stops every process before the stage runs."""
    script = tmp_path / "stage.py"
    script.write_text(TWO_PROCESS_STAGE)
    out = tmp_path / "out"
    results = _launch_two(script, out, _free_port())
    assert [code for code, _ in results] == [0, 0], results
    assert sorted(p.name for p in out.iterdir()) == [".pocketdiff-output.json", "config.yaml", "ran-by-0-of-2", "ran-by-1-of-2", "report.json"]

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("mine")
    results = _launch_two(script, kept, _free_port())
    assert [code for code, _ in results] == [2, 2], results
    assert all("not empty" in err.strip().splitlines()[-1] for _, err in results), results
    assert [p.name for p in kept.iterdir()] == ["mine.txt"]
