"""train/ema.py: the host shadow's asynchronous update gives the same numbers as an in-line one,
and nothing reads the shadow before the update in flight has landed."""
import time

import pytest
import torch

from pocketdiff.train.ema import EMA


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _drift(model, k):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.1 * (k + 1) * (i + 1))


def test_host_update_sees_the_parameters_of_its_step():
    """The lerp may run after the next optimizer step has changed the parameters: it must still
    use the values of the step it was asked about (compare with an in-line recomputation)."""
    model = _model()
    ema = EMA(model, 0.8, device="cpu", every=2)
    ref_model = _model()
    ref = {n: p.detach().clone().float() for n, p in ref_model.named_parameters()}
    for step in range(1, 9):
        _drift(model, step)
        _drift(ref_model, step)
        ema.update(model, step)  # returns at once; the lerp runs in a thread
        if step % 2 == 0:
            for n, p in ref_model.named_parameters():
                ref[n].lerp_(p.detach(), 1 - 0.8 ** 2)
        _drift(model, 100)  # the next "optimizer step"
        _drift(ref_model, 100)
    for n, v in ema.shadow.items():
        torch.testing.assert_close(v, ref[n])


def test_staging_buffers_are_reused_and_copy_to_waits(monkeypatch):
    m = _model()
    ema = EMA(m, 0.5, device="cpu")
    ema.update(m, None)
    ptrs = {n: t.data_ptr() for n, t in ema._staging.items()}
    _drift(m, 1)
    before = {n: v.clone() for n, v in ema.shadow.items()}
    lerp = torch._foreach_lerp_

    def slow_lerp(*args):  # the host update is still running when copy_to is called
        time.sleep(0.3)
        lerp(*args)

    monkeypatch.setattr(torch, "_foreach_lerp_", slow_lerp)
    ema.update(m, None)
    assert {n: t.data_ptr() for n, t in ema._staging.items()} == ptrs
    target = _model(seed=1)
    ema.copy_to(target)  # must wait for the lerp, not copy the shadow of the step before
    params = dict(m.named_parameters())
    for n, p in target.named_parameters():
        torch.testing.assert_close(p, before[n] + 0.5 * (params[n].detach() - before[n]))
    for (n, p), (_, q) in zip(target.named_parameters(), m.named_parameters()):
        assert not torch.equal(p, q) and torch.equal(p, ema.shadow[n])


def test_an_error_in_the_host_update_reaches_the_training_thread(monkeypatch):
    m = _model()
    ema = EMA(m, 0.5, device="cpu")

    def boom(*a, **k):
        raise RuntimeError("lerp failed")

    monkeypatch.setattr(torch, "_foreach_lerp_", boom)
    ema.update(m, None)
    with pytest.raises(RuntimeError, match="lerp failed"):
        ema.wait()
    ema.wait()  # raised once, then clear
