"""Memory and disk options of the training loop: validation, 8-bit optimizer library errors,
CPU EMA, log rows with time / throughput / memory, the free-space check before a save."""
import json

import pytest
import torch

from pocketdiff.errors import ConfigError, PocketdiffError
from pocketdiff.train import memory
from pocketdiff.train.checkpoints import list_checkpoints
from pocketdiff.train.loop import EMA, LoopConfig, train_loop



class Toy(torch.utils.data.Dataset):
    def __init__(self, n=20):
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i]}


def collate(items):
    return {"x": torch.stack([i["x"] for i in items])}


def loss_fn(model, batch, rng):
    return ((model(batch["x"] + 0.1 * rng.randn(4)) - batch["x"]) ** 2).mean()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


@pytest.mark.parametrize("field,value,key", [
    ("optimizer", "sgd", "train.optimizer"), ("optimizer_lib", "apex", "train.optimizer_lib"),
    ("ema_device", "gpu", "train.ema_device"), ("ema_every", 0, "train.ema_every"),
    ("memory_cap_gib", -1.0, "train.memory_cap_gib"), ("memory_cap_gib", float("nan"), "train.memory_cap_gib"),
])
def test_loop_config_rejects_bad_memory_options(field, value, key):
    with pytest.raises(ConfigError, match=key):
        LoopConfig(**{field: value})


def test_missing_8bit_library_names_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_lib(name, *a, **kw):
        if name.split(".")[0] in ("bitsandbytes", "torchao"):
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_lib)
    groups = [{"params": list(make_model().parameters()), "lr": 1e-3}]
    for lib in ("bitsandbytes", "torchao"):
        with pytest.raises(PocketdiffError, match=f"optimizer_lib={lib}: {lib} cannot be imported"):
            memory.make_optimizer(groups, name="adamw8bit", lib=lib, lr=1e-3, weight_decay=0.0, fused=False)


def test_torchao_adamw8bit_is_built_when_installed():
    pytest.importorskip("torchao.optim")
    groups = [{"params": list(make_model().parameters()), "lr": 1e-3}]
    opt = memory.make_optimizer(groups, name="adamw8bit", lib="torchao", lr=1e-3, weight_decay=0.0, fused=False)
    assert type(opt).__name__ == "AdamW8bit" and type(opt).__module__.startswith("torchao")


def test_cpu_ema_every_k_steps_matches_decay_power():
    model = make_model()
    ema = EMA(model, 0.9, device="cpu", every=2)
    start = {k: v.clone() for k, v in ema.shadow.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model, 1)  # not a multiple of 2: skipped
    assert all(torch.equal(ema.shadow[k], start[k]) for k in start)
    ema.update(model, 2)
    params = dict(model.named_parameters())
    for k, v in ema.shadow.items():
        assert v.device.type == "cpu"
        assert torch.allclose(v, start[k] + (1 - 0.9 ** 2) * (params[k].detach() - start[k]), atol=1e-6)


def test_log_rows_carry_time_throughput_and_memory(tmp_path):
    cfg = LoopConfig(max_steps=6, batch_size=4, lr=1e-2, checkpoint_every=3, log_every=3, ema_decay=0.5, ema_device="cpu")
    res = train_loop(cfg, model=make_model(), loss_fn=loss_fn, dataset=Toy(), collate=collate, ckpt_dir=tmp_path / "ckpt",
                     seed=0, log_path=tmp_path / "logs.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "logs.jsonl").read_text().splitlines()]
    assert rows[0]["event"] == "first_step" and rows[0]["first_step_s"] >= 0 and rows[0]["compiled"] is False
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [3, 6]
    for r in steps:
        assert r["wall_s"] > 0 and r["samples_per_s"] > 0 and "peak_gpu_mem_gib" in r
    t = res.timing
    assert t["steps_run"] == 6 and t["warmup_steps"] == 2 and t["steady_steps"] == 4 and t["steady_samples_per_s"] > 0
    assert t["first_step_s"] is not None and t["warmup_s"] >= t["first_step_s"]
    phases = [r for r in rows if r.get("event") == "step_phases"]  # the first three steps, phase by phase
    assert [r["step"] for r in phases] == [1, 2, 3]
    for r in phases:
        assert set(r) >= {"forward_backward_s", "optimizer_s", "ema_s", "step_s"}
        assert r["forward_backward_s"] + r["optimizer_s"] + r["ema_s"] <= r["step_s"] + 2e-3  # rounded to ms each


def test_gradient_checkpointing_needs_a_model_that_has_it(tmp_path):
    cfg = LoopConfig(max_steps=1, batch_size=4, gradient_checkpointing=True)
    with pytest.raises(PocketdiffError, match="train.gradient_checkpointing: Sequential"):
        train_loop(cfg, model=make_model(), loss_fn=loss_fn, dataset=Toy(), collate=collate, ckpt_dir=tmp_path / "c", seed=0)


def test_full_disk_fails_before_the_save_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    cfg = LoopConfig(max_steps=6, batch_size=4, lr=1e-2, checkpoint_every=2, checkpoints_total_limit=1, log_every=1)
    train_loop(cfg, model=make_model(), loss_fn=loss_fn, dataset=Toy(), collate=collate, ckpt_dir=ckpt, seed=0,
               resume=None)
    assert [p.name for p in list_checkpoints(ckpt)] == ["checkpoint-6"]
    monkeypatch.setattr(memory, "free_bytes", lambda path: 10)
    longer = LoopConfig(max_steps=8, batch_size=4, lr=1e-2, checkpoint_every=2, checkpoints_total_limit=1, log_every=1)
    with pytest.raises(PocketdiffError, match=r"not enough free disk for checkpoint-8 .* needs \d+ bytes .* "
                                              r"last good checkpoint kept in .*checkpoint-6"):
        train_loop(longer, model=make_model(), loss_fn=loss_fn, dataset=Toy(), collate=collate, ckpt_dir=ckpt, seed=0,
                   resume="latest")
    assert [p.name for p in list_checkpoints(ckpt)] == ["checkpoint-6"]
    monkeypatch.undo()
    model = make_model()
    train_loop(longer, model=model, loss_fn=loss_fn, dataset=Toy(), collate=collate, ckpt_dir=ckpt, seed=0, resume="latest")
    assert [p.name for p in list_checkpoints(ckpt)] == ["checkpoint-8"]


def test_tensor_bytes_counts_8bit_state_by_its_inner_tensors():
    assert memory.tensor_bytes({"a": torch.zeros(10), "b": [torch.zeros(4, dtype=torch.uint8)]}) == 44


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes' 8-bit kernels need a GPU")
def test_queued_bitsandbytes_adamw8bit_matches_the_stock_step():
    """The sync-free step updates parameters and states exactly as bitsandbytes' own step (with
    8-bit block-wise states for the large tensor, 32-bit for the small ones)."""
    import copy

    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 8)).cuda()
    queued, start = copy.deepcopy(ref), copy.deepcopy(ref)
    opts = [bnb.optim.AdamW8bit(ref.parameters(), lr=1e-2, weight_decay=0.01),
            memory.make_optimizer([{"params": list(queued.parameters())}], name="adamw8bit", lib="bitsandbytes",
                                  lr=1e-2, weight_decay=0.01, fused=False)]
    assert type(opts[1]).__name__ == "QueuedAdamW8bit"
    for step in range(4):
        x = torch.randn(32, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for model, opt in zip((ref, queued), opts):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a, b, s in zip(ref.parameters(), queued.parameters(), start.parameters()):
        assert torch.equal(a, b) and not torch.equal(a, s)
    for pa, pb in zip(ref.parameters(), queued.parameters()):
        sa, sb = opts[0].state[pa], opts[1].state[pb]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))
