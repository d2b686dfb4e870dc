"""pocketdiff.device: config device names, and the CUDA memory cap's call into the allocator."""
import pytest
import torch

from pocketdiff.device import cap_cuda_memory, resolve_device
from pocketdiff.errors import PocketdiffError


def test_resolve_device_names_the_key():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(PocketdiffError, match="quant.device"):
        resolve_device("gpu0", key="quant.device")


class _Props:
    total_memory = 80 * 2 ** 30


@pytest.mark.parametrize("name,index", [("cuda", 3), ("cuda:1", 1)])
def test_memory_cap_hands_the_allocator_an_index(monkeypatch, name, index):
    # torch.cuda.set_per_process_memory_fraction rejects a bare "cuda" device (seen on an H100):
    # the cap must resolve it to the current device's index first
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    fraction = cap_cuda_memory(24 * 2 ** 30, torch.device(name))
    assert calls == [(pytest.approx(0.3), index)]
    assert isinstance(calls[0][1], int) and fraction == pytest.approx(0.3)
    assert cap_cuda_memory(200 * 2 ** 30, name) == 1.0  # never above the whole card
