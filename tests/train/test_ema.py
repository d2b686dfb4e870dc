"""train/ema.py: a host shadow matches the in-line lerp; on a GPU it is streamed through in chunks
on a side stream, sees the parameters of its own step, and nothing reads it before it has landed."""
import pytest
import torch

from pocketdiff.train.ema import EMA, plan_chunks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the streamed host update needs a CUDA device")


def _model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)


def _drift(model, k):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.1 * (k + 1) * (i + 1))


def test_chunks_cover_every_tensor_once_in_order():
    sizes = [5, 3, 9, 1, 1, 20, 2]
    spans = plan_chunks(sizes, chunk=8)
    assert [m for _, _, ms in spans for m in ms] == list(range(len(sizes)))
    assert spans[0][0] == 0 and spans[-1][1] == sum(sizes)
    for (s0, e0, ms), (s1, _, _) in zip(spans, spans[1:]):
        assert e0 == s1 and e0 - s0 == sum(sizes[i] for i in ms)
    assert all(e - s <= 8 or len(ms) == 1 for s, e, ms in spans)  # only a tensor over the limit stands alone
    assert [ms for _, _, ms in spans] == [[0, 1], [2], [3, 4], [5], [6]]
    assert plan_chunks([], 8) == []


def _run_steps(model, ref_model, ema, steps=8, every=2, decay=0.8):
    """Drift both models per step; after each step the "optimizer" changes the parameters again
    (after the fence), so an update must use the values of the step it was asked about."""
    ref = {n: p.detach().clone().float().cpu() for n, p in ref_model.named_parameters()}
    for step in range(1, steps + 1):
        _drift(model, step)
        _drift(ref_model, step)
        ema.update(model, step)
        if step % every == 0:
            for n, p in ref_model.named_parameters():
                ref[n].lerp_(p.detach().cpu(), 1 - decay ** every)
        ema.fence()
        _drift(model, 100)  # the next optimizer step
        _drift(ref_model, 100)
    return ref


def test_host_shadow_of_host_parameters_matches_the_reference():
    model = _model()
    ema = EMA(model, 0.8, device="cpu", every=2)
    ref = _run_steps(model, _model(), ema)
    for n, v in ema.shadow.items():
        torch.testing.assert_close(v, ref[n])


@cuda
def test_streamed_update_matches_the_reference_and_stays_in_pinned_host_memory():
    model = _model(device="cuda")
    ema = EMA(model, 0.8, device="cpu", every=2, chunk_mb=64 * 4 / 2**20)  # 64 floats a chunk: several chunks
    assert len(ema._chunks) > 1
    ref = _run_steps(model, _model(device="cuda"), ema)
    for n, v in ema.shadow.items():
        assert v.device.type == "cpu" and v.is_pinned()
        torch.testing.assert_close(v, ref[n])
    assert ema._scratch.numel() <= max(64, max(p.numel() for p in model.parameters()))


@cuda
def test_copy_to_and_loading_wait_for_the_streamed_update():
    m = _model(device="cuda")
    ema = EMA(m, 0.5, device="cpu")
    before = {n: v.clone() for n, v in ema.shadow.items()}
    _drift(m, 1)
    ema.update(m, None)
    target = _model(seed=1, device="cuda")
    ema.copy_to(target)  # waits for the update in flight
    for n, p in target.named_parameters():
        torch.testing.assert_close(p.cpu(), before[n] + 0.5 * (dict(m.named_parameters())[n].detach().cpu() - before[n]))
    flat = ema._flat.data_ptr()
    ema.shadow = {n: torch.zeros_like(v) for n, v in ema.shadow.items()}  # a checkpoint's shadow: into the pinned block
    assert ema._flat.data_ptr() == flat and all(v.is_pinned() and not v.any() for v in ema.shadow.values())
    ema.update(m, None)
    for n, p in m.named_parameters():
        torch.testing.assert_close(ema.shadow[n], 0.5 * p.detach().cpu())
