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
