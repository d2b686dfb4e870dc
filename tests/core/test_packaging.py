"""Packaging: pyproject states ranges, scripts/constraints.txt pins, and installing the wheel keeps
the torch a user already has (issue 20).

The install test is offline and takes seconds: it builds pocketdiff's wheel, makes a fresh venv
whose site-packages holds this venv's packages (symlinked) except that its torch is another
version inside pyproject's range (its real METADATA, version changed), then asks pip's resolver
what `pip install pocketdiff[all]` would do (`--dry-run --report`, `--no-index`, no pip config).
Installing a real second torch (a 190 MB CPU wheel, or 550 MB + CUDA libraries) would make it a
minutes-long network test for the same resolver decision.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements() -> list[Requirement]:
    proj = _pyproject()["project"]
    reqs = [Requirement(r) for r in proj["dependencies"]]
    for extra, items in proj["optional-dependencies"].items():
        reqs += [Requirement(r) for r in items if not r.startswith("pocketdiff")]
    return reqs


def _constraints() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt: {line!r} is not an exact pin"
            pins[_norm(req.name)] = Version(spec.version)
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_pyproject_states_ranges_and_constraints_pin_inside_them():
    pins = _constraints()
    for req in _requirements():
        ops = {s.operator for s in req.specifier}
        assert not ops & {"==", "===", "~="}, f"pyproject pins {req}: state a range (exact versions go in scripts/constraints.txt)"
        assert ">=" in ops, f"pyproject: {req} needs a lower bound"
        name = _norm(req.name)
        assert name in pins, f"scripts/constraints.txt has no pin for {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"constraints pin {name}=={pins[name]} is outside pyproject's {req}"


def _lower_bound(name: str) -> Version:
    (req,) = [r for r in _requirements() if _norm(r.name) == name]
    return Version(next(s.version for s in req.specifier if s.operator == ">="))


def _pip_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no machine-wide find-links, indexes or constraints
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _venv_with_torch(tmp: Path, torch_version: Version) -> Path:
    """A fresh venv seeing this venv's packages, but with torch at `torch_version` (pip reads metadata)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    torch_dist = None
    for entry in ours.iterdir():
        name = entry.name
        if re.match(r"torch-[^-]+\.dist-info$", name):
            torch_dist = entry
            continue
        if name.endswith(".pth") or name.startswith(("pocketdiff", "__editable__", "pip", "_distutils_hack")):
            continue  # no startup hooks; pocketdiff is what we install; pip runs from here
        (site / name).symlink_to(entry)
    assert torch_dist is not None, "this venv has no torch dist-info"
    other = site / f"torch-{torch_version}.dist-info"
    other.mkdir()
    meta = (torch_dist / "METADATA").read_text()
    (other / "METADATA").write_text(re.sub(r"(?m)^Version: .*$", f"Version: {torch_version}", meta, count=1))
    (other / "INSTALLER").write_text("pip\n")
    (other / "RECORD").write_text("")
    return python


def _dry_run(python: Path, tmp: Path, wheels: Path, target: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp / f"report-{len(list(tmp.glob('report-*')))}.json"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet",
                        "--report", str(report), "--no-index", "--find-links", str(wheels), target],
                       capture_output=True, text=True, env=_pip_env(), timeout=600)
    return r, (json.loads(report.read_text()) if report.is_file() else {})


def test_installing_the_wheel_keeps_a_different_torch_in_range(tmp_path):
    import torch

    ours = Version(torch.__version__.split("+")[0])
    other = _lower_bound("torch")
    assert other != ours, "pick another version: the test needs a torch other than this venv's"
    wheels = tmp_path / "wheels"
    b = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                        "-w", str(wheels), str(ROOT)], capture_output=True, text=True, env=_pip_env(), timeout=600)
    assert b.returncode == 0, b.stderr[-2000:]
    (wheel,) = wheels.glob("pocketdiff-*.whl")
    python = _venv_with_torch(tmp_path, other)

    # control: the venv really holds another torch (the old exact pin would not be satisfied)
    r, _ = _dry_run(python, tmp_path, wheels, f"torch=={ours}")
    assert r.returncode != 0 and "torch" in r.stderr, r.stderr[-2000:]

    r, report = _dry_run(python, tmp_path, wheels, f"{wheel}[all]")
    assert r.returncode == 0, r.stderr[-3000:]
    installs = {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    assert "pocketdiff" in installs, installs
    assert "torch" not in installs, f"installing the wheel would replace torch {other} with {installs.get('torch')}"
