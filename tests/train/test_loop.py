"""The shared training loop: determinism, resume bit-exactness, checkpoint rotation, NaN stop."""
import dataclasses
import json
import math
import time

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from pocketdiff.errors import PocketdiffError
from pocketdiff.train.checkpoints import list_checkpoints, resolve_resume
from pocketdiff.train.loop import (BatchPlan, BatchRandom, LoopConfig, SharedDeadline, StepReads, batch_to_device, read_step,
                                   step_generator, train_loop)


class Toy(torch.utils.data.Dataset):
    def __init__(self, n=20):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i]}


def collate(items):
    return {"x": torch.stack([i["x"] for i in items])}


def loss_fn(model, batch, rng: BatchRandom):
    noise = rng.randn(4)
    return ((model(batch["x"] + 0.1 * noise) - batch["x"]) ** 2).mean()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def run(tmp, steps, resume=None, model=None, **kw):
    cfg = LoopConfig(**{"max_steps": steps, "batch_size": 4, "grad_accum": 2, "lr": 1e-2, "ema_decay": 0.9, "checkpoint_every": 2,
                        "checkpoints_total_limit": 2, "log_every": 1, **kw})
    model = model or make_model()
    res = train_loop(cfg, model=model, loss_fn=loss_fn, dataset=Toy(), collate=collate, ckpt_dir=tmp / "ckpt",
                     seed=3, resume=resume)
    return model, res


def test_resume_mid_run_is_bit_exact(tmp_path):
    full, full_res = run(tmp_path / "a", 8)
    run(tmp_path / "b", 5)  # "killed" after step 5: checkpoints at 2 and 4 (limit 2) + final 5
    resumed, res = run(tmp_path / "b", 8, resume="latest")  # a fresh process would rebuild the model
    for (n, p), (_, q) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(p, q), n
    assert full_res.ema.shadow.keys() == res.ema.shadow.keys()
    assert all(torch.equal(full_res.ema.shadow[k], res.ema.shadow[k]) for k in full_res.ema.shadow)
    assert res.losses == full_res.losses


def test_resume_from_an_older_checkpoint_replays_exactly(tmp_path):
    full, _ = run(tmp_path / "a", 6)
    run(tmp_path / "b", 6)
    resumed, _ = run(tmp_path / "b", 6, resume=str(tmp_path / "b" / "ckpt" / "checkpoint-4"))
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))


def test_rotation_keeps_the_newest(tmp_path):
    run(tmp_path, 8)
    names = [p.name for p in list_checkpoints(tmp_path / "ckpt")]
    assert names == ["checkpoint-6", "checkpoint-8"]
    assert set(load_file(str(tmp_path / "ckpt" / "checkpoint-8" / "model.safetensors"))) == set(make_model().state_dict())


def test_torn_checkpoint_is_never_latest(tmp_path):
    run(tmp_path, 4)
    torn = tmp_path / "ckpt" / ".tmp-checkpoint-6"
    torn.mkdir()
    (tmp_path / "ckpt" / "checkpoint-9").mkdir()  # no trainer_state.json: incomplete
    assert resolve_resume(tmp_path / "ckpt", "latest").name == "checkpoint-4"


def test_batch_plan_deterministic_and_covers_epoch():
    a, b = BatchPlan(10, 3, seed=1), BatchPlan(10, 3, seed=1)
    assert [a.indices(m) for m in range(6)] == [b.indices(m) for m in range(6)]
    epoch0 = sum((a.indices(m) for m in range(3)), [])
    assert len(set(epoch0)) == 9


def test_randomness_independent_of_world_size():
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    full = BatchRandom(g1, 4).randn(3)
    halves = BatchRandom(g2, 4, rank=1, world=2).randn(3)
    assert torch.equal(full[1::2], halves)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the step's draws are made on the GPU")
def test_cuda_draws_on_device_and_independent_of_world_size():
    full = BatchRandom(step_generator(5, 3, "cuda"), 4, device="cuda")
    half = BatchRandom(step_generator(5, 3, "cuda"), 4, rank=1, world=2, device="cuda")
    assert full.draw_on.type == "cuda"
    for draw in (lambda r: r.randn(3, 2), lambda r: r.rand(), lambda r: r.randint(0, 1000)):
        a, b = draw(full), draw(half)
        assert a.is_cuda and b.is_contiguous()
        assert torch.equal(a[1::2], b)
    batch = {"x": torch.arange(6.0), "text": ["a", "b"]}
    moved = batch_to_device(batch, "cuda")
    assert moved["x"].is_cuda and torch.equal(moved["x"].cpu(), batch["x"]) and moved["text"] == ["a", "b"]
    assert batch_to_device(batch, "cpu") is batch


def test_shared_deadline_votes_past_the_limit():
    acc = Accelerator(cpu=True)
    assert not SharedDeadline(acc, 0, started=0.0).poll()  # 0: no limit
    assert SharedDeadline(acc, 5, started=time.time() - 10).poll()
    assert not SharedDeadline(acc, 3600, started=time.time()).poll()


def test_time_limit_stops_with_a_checkpoint_and_resumes(tmp_path):
    _, res = run(tmp_path, 8, max_time_s=1e-6)
    assert res.stopped_early and res.steps == 1
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["checkpoint-1"]
    _, res = run(tmp_path, 3, resume="latest")
    assert res.steps == 3 and not res.stopped_early


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    model = make_model()
    calls = {"n": 0}

    def bad_loss(m, batch, rng):
        calls["n"] += 1
        loss = loss_fn(m, batch, rng)
        return loss * float("nan") if calls["n"] > 6 else loss  # steps 0-2 fine (2 micro-batches each)

    cfg = LoopConfig(max_steps=8, batch_size=4, grad_accum=2, lr=1e-2, checkpoint_every=2, log_every=1)
    with pytest.raises(PocketdiffError, match="non-finite loss at step 3"):
        train_loop(cfg, model=model, loss_fn=bad_loss, dataset=Toy(), collate=collate, ckpt_dir=tmp_path / "ckpt", seed=0)
    latest = resolve_resume(tmp_path / "ckpt", "latest")
    assert latest.name == "checkpoint-2"
    assert all(torch.isfinite(v).all() for v in load_file(str(latest / "model.safetensors")).values())


class _NanGradient(torch.autograd.Function):
    """Identity forward, NaN gradient: a finite loss whose update would poison the weights."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def test_nan_gradients_stop_before_the_step_is_saved_or_logged(tmp_path):
    # the stop policy reads the loss and the gradient norm once the step is queued (after the
    # optimizer): the poisoned step must still never reach a checkpoint or a log row
    model, calls = make_model(), {"n": 0}

    def loss(m, batch, rng):
        calls["n"] += 1
        value = loss_fn(m, batch, rng)
        return _NanGradient.apply(value) if calls["n"] == 4 else value

    cfg = LoopConfig(max_steps=6, batch_size=4, lr=1e-2, checkpoint_every=1, log_every=1)
    with pytest.raises(PocketdiffError, match="non-finite gradients at step 3"):
        train_loop(cfg, model=model, loss_fn=loss, dataset=Toy(), collate=collate, ckpt_dir=tmp_path / "ckpt", seed=0,
                   log_path=tmp_path / "logs.jsonl")
    latest = resolve_resume(tmp_path / "ckpt", "latest")
    assert latest.name == "checkpoint-3"
    assert all(torch.isfinite(v).all() for v in load_file(str(latest / "model.safetensors")).values())
    logged = [json.loads(line)["step"] for line in (tmp_path / "logs.jsonl").read_text().splitlines() if "loss" in json.loads(line)]
    assert logged == [1, 2, 3]


def test_read_step_reads_loss_and_gradient_finiteness_together():
    assert read_step(torch.tensor(1.5), torch.tensor(2.0)) == (1.5, None)
    assert read_step(torch.tensor(1.5), torch.tensor(float("inf"))) == (1.5, "gradients")
    loss, bad = read_step(torch.tensor(float("nan")), None)
    assert bad == "loss" and loss != loss


def test_a_step_read_one_step_late_still_never_reaches_a_checkpoint_or_log_row(tmp_path):
    # between recorded steps the loop reads step s while step s+1 is queued: a NaN at an unrecorded
    # step stops the run one step later, before the next checkpoint or log row
    model, calls = make_model(), {"n": 0}

    def loss(m, batch, rng):
        calls["n"] += 1
        value = loss_fn(m, batch, rng)
        return value * float("nan") if calls["n"] == 5 else value  # step 4: neither logged nor saved

    cfg = LoopConfig(max_steps=12, batch_size=4, lr=1e-2, checkpoint_every=4, log_every=4)
    with pytest.raises(PocketdiffError, match="non-finite loss at step 4"):
        train_loop(cfg, model=model, loss_fn=loss, dataset=Toy(), collate=collate, ckpt_dir=tmp_path / "ckpt", seed=0,
                   log_path=tmp_path / "logs.jsonl")
    assert calls["n"] == 6  # found while step 5 was queued, not later
    assert resolve_resume(tmp_path / "ckpt", "latest").name == "checkpoint-4"
    logged = [json.loads(line)["step"] for line in (tmp_path / "logs.jsonl").read_text().splitlines() if "loss" in json.loads(line)]
    assert logged == [4]


def test_step_reads_keep_the_newest_in_flight():
    reads = StepReads()
    reads.push(0, torch.tensor(1.0), torch.tensor(2.0))
    reads.push(1, torch.tensor(float("nan")), None)
    assert reads.settle(keep=1) == [(0, 1.0, None)]
    ((step, loss, bad),) = reads.settle(keep=0)
    assert (step, bad) == (1, "loss") and loss != loss
    assert reads.settle() == []


def test_profile_steps_write_a_trace_of_steady_steps(tmp_path):
    cfg = LoopConfig(max_steps=7, batch_size=4, lr=1e-2, checkpoint_every=100, profile_steps=2)
    train_loop(cfg, model=make_model(), loss_fn=loss_fn, dataset=Toy(), collate=collate, ckpt_dir=tmp_path / "ckpt", seed=0, desc="p")
    import gzip

    trace = json.loads(gzip.decompress((tmp_path / "profile" / "p-rank0.json.gz").read_bytes()))
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#3", "ProfilerStep#4"}  # after 2 warm-up steps and the phase-timed one
    assert "Self CPU" in (tmp_path / "profile" / "p-rank0.txt").read_text()
    with pytest.raises(PocketdiffError, match="train.profile_steps"):
        LoopConfig(profile_steps=-1)


def test_nan_skip_policy_skips(tmp_path):
    cfg = LoopConfig(max_steps=3, batch_size=4, lr=1e-2, nan_policy="skip", log_every=1)
    res = train_loop(cfg, model=make_model(), loss_fn=lambda m, b, r: loss_fn(m, b, r) * float("nan"), dataset=Toy(),
                     collate=collate, ckpt_dir=tmp_path / "c", seed=0)
    assert res.skipped_steps == 3


def test_a_skipped_last_step_keeps_the_last_finite_loss(tmp_path):
    calls = {"n": 0}

    def loss(m, b, r):
        calls["n"] += 1
        return loss_fn(m, b, r) * (float("nan") if calls["n"] == 3 else 1.0)

    cfg = LoopConfig(max_steps=3, batch_size=4, lr=1e-2, nan_policy="skip", log_every=1)
    res = train_loop(cfg, model=make_model(), loss_fn=loss, dataset=Toy(), collate=collate, ckpt_dir=tmp_path / "c", seed=0)
    assert res.skipped_steps == 1 and math.isfinite(res.final_loss)


def test_config_validation_names_field():
    with pytest.raises(PocketdiffError, match="train.mixed_precision"):
        LoopConfig(mixed_precision="fp8")
    with pytest.raises(PocketdiffError, match="train.batch_size"):
        dataclasses.replace(LoopConfig(), batch_size=0)


TWO_LOOPS_ON_TWO_PROCESSES = '''
import os, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[2])
from test_loop import Toy, collate, loss_fn, make_model
from pocketdiff.train.loop import LoopConfig, make_accelerator, train_loop, use_ema_weights

out = Path(sys.argv[1]) / os.environ["RANK"]
cfg = LoopConfig(max_steps=2, batch_size=4, lr=1e-2, checkpoint_every=1, tensorboard=True, ddp_comm_hook="fp16", ema_decay=0.5)
acc = make_accelerator(cfg, out)
for phase in ("first", "second"):  # as train-teacher (VAE, then UNet) and distill (rounds) share one
    model = make_model()
    res = train_loop(cfg, model=model, loss_fn=loss_fn, dataset=Toy(), collate=collate,
                     ckpt_dir=out / phase, seed=0, accelerator=acc, desc=phase)
    trained = torch.cat([p.detach().flatten() for p in model.parameters()])
    ema = None if res.ema is None else torch.cat([res.ema.shadow[n].flatten() for n, _ in model.named_parameters()])
    use_ema_weights(res, model)  # the main process's shadow, broadcast
    final = torch.cat([p.detach().flatten() for p in model.parameters()])
    print(phase, "ema held", res.ema is not None, "moved", not torch.equal(final, trained),
          "is shadow", ema is None or torch.equal(final, ema), "sum %.8e" % float(final.double().sum()))
ddp = acc.prepare(make_model())
print("world", acc.num_processes, torch.distributed.is_initialized(), type(ddp).__name__, ddp._get_ddp_logging_data().get("comm_hook"),
      "bucket_view", ddp.gradient_as_bucket_view)
'''


def test_loops_sharing_an_accelerator_keep_the_process_group(tmp_path):
    """With tensorboard on, a loop ends only its own trackers: the process group that the next
    loop of the same run (and its DDP) needs stays up. `train.ddp_comm_hook` reaches DDP (fp16
    here: accelerate's bf16 hook needs NCCL). Only the main process keeps an EMA, and
    `use_ema_weights` leaves its weights on both."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "two_loops.py"
    script.write_text(TWO_LOOPS_ON_TWO_PROCESSES)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, ACCELERATE_USE_CPU="True", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), str(Path(__file__).parent)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()[-3000:]) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    assert all("world 2 True DistributedDataParallel fp16_compress_hook bucket_view True" in stdout for _, stdout, _ in results), results
    # the EMA lives on the main process only; use_ema_weights gives every process its weights
    for phase in ("first", "second"):
        rows = [next(line for line in stdout.splitlines() if line.startswith(phase + " ")) for _, stdout, _ in results]
        assert "ema held True" in rows[0] and "ema held False" in rows[1], rows
        assert all("moved True" in r and "is shadow True" in r for r in rows), rows
        assert rows[0].split("sum ")[1] == rows[1].split("sum ")[1], rows


def test_lr_scale_gives_a_prefix_its_own_learning_rate(tmp_path):
    from pocketdiff.train.loop import param_groups

    model = make_model()
    groups = param_groups(model, 1e-3, {"2": 10.0})
    assert [g["lr"] for g in groups] == [1e-3, 1e-2]
    assert {id(p) for p in groups[1]["params"]} == {id(model[2].weight), id(model[2].bias)}
    (only,) = param_groups(model, 1e-3, {"9": 10.0})  # no match: one group
    assert only["lr"] == 1e-3 and [id(p) for p in only["params"]] == [id(p) for p in model.parameters()]
    with pytest.raises(PocketdiffError, match="must be > 0"):
        param_groups(model, 1e-3, {"2": 0.0})

    # Adam moves each weight by about lr per step: the scaled layer moves about 10x as far
    cfg = LoopConfig(max_steps=3, batch_size=4, lr=1e-4, checkpoint_every=100, log_every=100)
    moved = {}
    for scale in (1.0, 10.0):
        model = make_model()
        before = model[2].weight.detach().clone()
        train_loop(cfg, model=model, loss_fn=loss_fn, dataset=Toy(), collate=collate, ckpt_dir=tmp_path / f"c{scale}",
                   seed=3, lr_scale={"2": scale})
        moved[scale] = float((model[2].weight.detach() - before).abs().max())
    assert 8.0 < moved[10.0] / moved[1.0] < 12.0


def test_fused_adamw_only_on_cuda_for_parameters_in_the_default_layout():
    from pocketdiff.train.loop import use_fused_adamw

    for k in (3, 1):  # a 1x1 conv's channels_last weight still passes is_contiguous()
        conv = torch.nn.Conv2d(4, 8, k)
        assert use_fused_adamw(list(conv.parameters()), "cuda")
        assert not use_fused_adamw(list(conv.parameters()), "cpu")
        conv.to(memory_format=torch.channels_last)  # speed.channels_last without compile
        assert not use_fused_adamw(list(conv.parameters()), "cuda")


def test_phase_clock_synchronises_at_every_mark(monkeypatch):
    """The first steps' phase breakdown (logged on GPUs) waits for the device at each mark."""
    from time import perf_counter

    from pocketdiff.train.loop import PhaseClock

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(1))
    clock = PhaseClock(perf_counter())
    for name in ("forward_backward_s", "optimizer_s", "ema_s"):
        clock.mark(name)
    assert list(clock.seconds) == ["forward_backward_s", "optimizer_s", "ema_s"] and len(calls) == 3
    assert all(v >= 0 for v in clock.seconds.values())


def test_an_ema_too_slow_for_the_run_is_named(tmp_path, capsys):
    run(tmp_path / "slow", 3, ema_decay=0.999)
    assert "train.ema_decay=0.999 over train.max_steps=3 leaves 100% of the starting weights" in capsys.readouterr().out
    run(tmp_path / "fit", 3, ema_decay=0.1)
    assert "ema_decay" not in capsys.readouterr().out
