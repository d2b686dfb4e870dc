"""Fixtures shared by every test folder."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """torch on one CPU thread for a whole module (its module-scoped models included), restored
    after. Tiny models run fastest single-threaded; on a shared 2-core box, multi-threaded CPU
    kernels under oversubscription are 10-100x slower. Use: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def gpu_delegate():
    """The Vulkan driver the LiteRT GPU delegate will use (the delegate runs for real: Mesa
    lavapipe unpacked by scripts/setup_vulkan.sh on machines without a GPU driver); sets up
    lavapipe when missing."""
    import subprocess
    from pathlib import Path

    from pocketdiff.runtime.delegate import delegate_available

    ok, why = delegate_available()
    if not ok:
        root = Path(__file__).resolve().parents[1]
        subprocess.run(["bash", str(root / "scripts" / "setup_vulkan.sh")], check=False, capture_output=True, timeout=900)
        ok, why = delegate_available()
    if not ok:
        pytest.fail(f"no Vulkan driver for the LiteRT GPU delegate: {why}")
    return why
