"""scripts/gpu/gpu_tag.sh: the short GPU name the GPU scripts put in result file names (web_node.sh, lora_bundle.sh,
lora_openmoji.sh, sdxl_openmoji.sh). nvidia-smi is a shell stub on PATH printing a given device name."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def tag(tmp_path: Path, name: str | None, *default: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.unlink(missing_ok=True)
    if name is not None:
        smi.write_text(f"#!/bin/sh\necho '{name}'\n")
        smi.chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    p = subprocess.run(["bash", "-c", f"source scripts/gpu/gpu_tag.sh; gpu_tag {' '.join(default)}"], cwd=ROOT,
                       env={**os.environ, "PATH": path}, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_gpu_tag_names_the_card_not_its_memory(tmp_path):
    assert tag(tmp_path, "NVIDIA H100 80GB HBM3") == "h100"  # HBM3's H is not taken
    assert tag(tmp_path, "NVIDIA H200") == "h200"


def test_gpu_tag_falls_back_to_the_default(tmp_path):
    assert tag(tmp_path, "NVIDIA A100-SXM4-80GB") == "gpu"
    assert tag(tmp_path, "NVIDIA A100-SXM4-80GB", "cpu") == "cpu"
    assert tag(tmp_path, None, "cpu") == "cpu"  # no nvidia-smi at all
