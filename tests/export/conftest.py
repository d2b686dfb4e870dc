"""Shared fixtures of the export tests: the LiteRT GPU delegate runs for real (Mesa lavapipe
unpacked by scripts/setup_vulkan.sh on machines without a GPU driver)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def gpu_delegate():
    """The Vulkan driver the delegate will use; sets up lavapipe when missing."""
    from pocketdiff.export.delegate import delegate_available

    ok, why = delegate_available()
    if not ok:
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_vulkan.sh")], check=False, capture_output=True, timeout=900)
        ok, why = delegate_available()
    if not ok:
        pytest.fail(f"no Vulkan driver for the LiteRT GPU delegate: {why}")
    return why
