"""scripts/gpu/stage.sh, the staged carry: ignored folders split into parts here, received one part per device call
into a folder that outlives the calls (STAGE_DIR), then restored at their places in the last call's repo copy."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / "scripts" / "gpu" / "stage.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("bash") is None, reason="needs git and bash")


def _sh(repo: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu/stage.sh", *args], cwd=repo, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def _files(top: Path) -> dict[str, bytes]:
    return {str(p.relative_to(top)): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}


@pytest.fixture
def here(tmp_path):
    """A small repo: the script tracked, two ignored folders to stage and a small one carried in every call."""
    repo = tmp_path / "here"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    shutil.copy(STAGE, repo / "scripts" / "gpu" / "stage.sh")
    (repo / ".gitignore").write_text("/.stage/\n.big*/\n/nested/\n/.gl/\n")
    rng = random.Random(7)
    (repo / ".big" / "sub").mkdir(parents=True)
    (repo / ".big" / "a.bin").write_bytes(rng.randbytes(5000))
    (repo / ".big" / "sub" / "b name.txt").write_text("spaces in a name\n")
    (repo / ".big" / "empty").write_bytes(b"")
    (repo / "nested" / "deep").mkdir(parents=True)
    (repo / "nested" / "deep" / "c.bin").write_bytes(rng.randbytes(3000))
    (repo / ".gl").mkdir()
    (repo / ".gl" / "x.deb").write_bytes(b"d" * 100)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "scripts", ".gitignore"], cwd=repo, check=True)
    return repo


def _there(tmp_path: Path, here: Path, carried: list[str], name: str) -> Path:
    """One call's fresh repo copy: the tracked files and the carried paths."""
    repo = tmp_path / name
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "scripts" / "gpu").mkdir(parents=True)
    shutil.copy(here / "scripts" / "gpu" / "stage.sh", repo / "scripts" / "gpu" / "stage.sh")
    for c in carried:
        shutil.copytree(here / c, repo / c)
    return repo


def test_split_receive_shuffled_restore_gives_the_same_bytes(here, tmp_path):
    r = _sh(here, "split", ".big", "nested/", "--part-mb", "0.004", "--every", ".gl", "--first", ".gl",
            "--then", "bash measure.sh")
    assert r.returncode == 0, r.stderr
    parts = sorted(p.name for p in (here / ".stage").iterdir())
    assert len(parts) >= 3 and parts[0] == "p00"
    for p in parts:
        assert (here / ".stage" / p / "part").stat().st_size <= int(0.004 * 1048576)
        manifest = (here / ".stage" / p / "manifest").read_text().splitlines()
        assert f"parts {len(parts)}" in manifest and "path .big" in manifest and "path nested" in manifest
        assert sum(line.startswith("part p") for line in manifest) == len(parts)
    # the plan: a first call, then one call per part, each with .gl, measured and under the limit
    calls = [line for line in r.stdout.splitlines() if line.startswith("call ")]
    assert len(calls) == len(parts) + 1
    assert all("under the limit" in c for c in calls)
    assert '[".stage/p00", ".gl"]' in calls[1]
    assert "stage.sh restore && bash measure.sh" in r.stdout
    # there: the parts in a shuffled order, one twice, each in a fresh repo copy, into one STAGE_DIR
    env = {"STAGE_DIR": str(tmp_path / "tmpstage")}
    order = parts[:]
    random.Random(3).shuffle(order)
    order.insert(1, order[0])
    for i, p in enumerate(order):
        there = _there(tmp_path, here, [f".stage/{p}"], "there")
        r = _sh(there, "receive", env=env)
        assert r.returncode == 0, r.stderr
        if i < len(order) - 1:
            assert "missing:" in r.stdout
            assert _sh(there, "restore", env=env).returncode == 1  # not all parts yet
    assert "extracted into" in r.stdout
    r = _sh(there, "restore", env=env)
    assert r.returncode == 0, r.stderr
    assert (there / ".big").is_symlink()
    assert _files(there / ".big") == _files(here / ".big")
    assert _files(there / "nested") == _files(here / "nested")
    assert _sh(there, "restore", env=env).returncode == 0  # again: the links replaced
    # a later call receiving a part once more changes nothing
    again = _there(tmp_path, here, [f".stage/{parts[0]}"], "again")
    r = _sh(again, "receive", env=env)
    assert r.returncode == 0 and "extracted before" in r.stdout


def test_a_corrupt_part_is_one_error_line_naming_it(here, tmp_path):
    assert _sh(here, "split", ".big", "--part-mb", "0.003").returncode == 0
    env = {"STAGE_DIR": str(tmp_path / "tmpstage")}
    there = _there(tmp_path, here, [".stage/p01"], "there")
    part = there / ".stage" / "p01" / "part"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    r = _sh(there, "receive", env=env)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "part p01 is corrupt" in lines[0]
    assert not (tmp_path / "tmpstage" / "parts" / "p01").exists()


def test_split_refuses_tracked_paths_and_calls_over_the_limit(here):
    r = _sh(here, "split", "scripts")
    assert r.returncode == 1 and "not ignored" in r.stderr
    r = _sh(here, "split", ".big", "--part-mb", "0.003", env={"STAGE_LIMIT": "5000"})
    assert r.returncode == 1 and "OVER the limit" in r.stdout
