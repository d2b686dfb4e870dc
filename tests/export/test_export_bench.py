"""benchmarks/export_sd21.py helpers: tiled synthetic weights (compressible, int8-exact, rows
uncorrelated) and the delegate stage's bookkeeping (a crash or a spent budget is recorded)."""
from __future__ import annotations

import importlib.util
import json
import lzma
from pathlib import Path

import numpy as np
import pytest
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("export_sd21_bench", ROOT / "benchmarks" / "export_sd21.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _net():
    return nn.Sequential(nn.Conv2d(32, 48, 3, padding=1), nn.Linear(320, 640), nn.Conv2d(640, 64, 1))


def test_tiled_weights_are_windows_of_one_block(bench):
    net = _net()
    info = bench.fill_tiled(net, seed=3, init="default")
    block = bench.tile_block(3)
    assert info["tensors"] == 3 and abs(info["block_std"] - block.std()) < 1e-6
    for m in (net[0], net[1], net[2]):
        w = m.weight.detach().numpy()
        file_layout = w.transpose(0, 2, 3, 1) if w.ndim == 4 else w  # conv weights are OHWI in the .tflite
        flat = file_layout.reshape(-1)
        scale = np.abs(flat).max() / 127
        codes = np.round(flat / scale)
        assert np.allclose(codes * scale, flat, rtol=1e-6, atol=0), "values on the int8 grid times one scale"
        # one window of the periodic block stream
        start = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(np.concatenate([block, block[:8]]), 8)[: len(block)] == codes[:8], axis=1))[0])
        assert np.array_equal(codes, bench.tiled_values(block, codes.size, start))
        # per-channel RTN int8 reproduces exactly those codes (every row holds a +-127)
        rows = codes.reshape(w.shape[0], -1)
        assert np.all(np.abs(rows).max(axis=1) == 127)
        # the std of PyTorch's default init
        target = 1.0 / np.sqrt(3.0 * w[0].size)
        assert abs(w.std() / target - 1) < 0.05
        # rows are distinct shifts: no two rows alike, weakly correlated
        c = np.corrcoef(rows)
        assert np.abs(c[~np.eye(len(c), dtype=bool)]).max() < 0.5


def test_tiled_weights_compress(bench):
    lin = nn.Linear(1024, 1024)
    bench.fill_tiled(lin, seed=0, init="normal002")
    raw = lin.weight.detach().numpy().astype(np.float16).tobytes()
    assert float(lin.bias.detach().abs().max()) == 0.0
    packed = lzma.compress(raw, preset=1)
    assert len(packed) * 8 < len(raw)


def _fake_workdir(bench, tmp: Path) -> Path:
    arrays = {"sample": np.ones((1, 4, 8, 8), np.float32), "timestep": np.full((1,), 501.0, np.float32),
              "temb": np.ones((1, 32), np.float32), "encoder_hidden_states": np.ones((1, 77, 16), np.float32),
              "reference": np.ones((1, 4, 8, 8), np.float32)}
    for k, v in arrays.items():
        np.save(tmp / f"{k}.npy", v)
    variants = {}
    for v in ("ours_fp16_rs", "litert_fp32"):
        (tmp / f"{v}.tflite").write_bytes(b"x" * 10)
        variants[v] = {"file": f"{v}.tflite", "bytes": 10, "convert_s": 1.0, "convert_peak_rss_mb": 10.0, "transposes": 0,
                       "time_input": "time_embedding" if v.startswith("ours") else "timestep"}
    variants["ours_fp16_rs"]["feeds"] = {"names": ["sample", "timestep", "encoder_hidden_states"], "arrays": ["sample", "temb", "encoder_hidden_states"]}
    (tmp / "manifest.json").write_text(json.dumps({"key": "k", "params": 5, "variants": variants}))
    return tmp


def test_delegate_stage_records_crashes_and_goes_on(bench, tmp_path, monkeypatch):
    import argparse

    from pocketdiff.runtime import delegate

    work = _fake_workdir(bench, tmp_path)
    calls = []

    def fake_run(path, inputs, precisions, accelerator, **kw):
        calls.append((Path(path).stem, accelerator, precisions[0], inputs))
        if Path(path).stem == "litert_fp32" and precisions[0] == "fp16":
            return bench._failed_run(accelerator, "delegate process crashed (signal 11)")
        out = np.ones((1, 4, 8, 8), np.float32)
        return delegate.DelegateRun(accelerator, "lavapipe", True, True, [], None, {precisions[0]: [out]}, [], [], {precisions[0]: 0.1},
                                    {precisions[0]: 0.01}, "", "", "")

    monkeypatch.setattr(delegate, "run_on_delegate", fake_run)
    monkeypatch.setattr(delegate, "delegate_available", lambda driver=None: (True, "lavapipe"))
    args = argparse.Namespace(append=False, skip_gpu=False, skip_f32=False, skip_cpu=False, timeout=10.0, budget_s=None,
                              repeats=1, warmup=0, cpu_threads=1)
    out = tmp_path / "r.json"
    bench.stage_delegate(args, work, None, out)
    r = json.loads(out.read_text())
    assert [c[1:3] for c in calls] == [("gpu", "fp16")] * 2 + [("gpu", "fp32")] * 2 + [("cpu", "fp32")] * 2  # fp16 first, for all
    ours_feed = next(c[3] for c in calls if c[0] == "ours_fp16_rs")
    assert isinstance(ours_feed, dict) and ours_feed["timestep"].shape == (1, 32)  # the time embedding under the signature's name
    assert isinstance(next(c[3] for c in calls if c[0] == "litert_fp32"), list)
    s = r["summary"]
    assert s["ours_fp16_rs"]["fp16_ok"] is True and s["ours_fp16_rs"]["fp16_cosine"] == pytest.approx(1.0)
    assert "signal 11" in s["litert_fp32"]["gpu_errors"]["fp16"] and s["litert_fp32"]["fp32_cosine"] == pytest.approx(1.0)

    # a spent budget skips what is left, and says so
    calls.clear()
    args.budget_s = 1.0
    bench.stage_delegate(args, work, ["ours_fp16_rs"], out)
    r = json.loads(out.read_text())
    assert calls == [] and r["variants"]["ours_fp16_rs"]["skipped"]


class _Step(nn.Module):
    """A UNet-step-shaped graph: sample, time embedding and text states in, one tensor out."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.t = nn.Linear(32, 4)
        self.c = nn.Linear(16, 4)

    def forward(self, sample, timestep, encoder_hidden_states):
        bias = self.t(timestep) + self.c(encoder_hidden_states).mean(1)
        return self.conv(sample) + bias[:, :, None, None]


def test_delegate_stage_on_the_real_delegate(bench, gpu_delegate, tmp_path):
    """The same bookkeeping with the real LiteRT GPU delegate: a converted file is fed under its
    signature's names and measured; a file the delegate cannot load is recorded, not fatal."""
    import argparse

    import torch

    from pocketdiff.export.exporter import VerifyConfig, export_component
    from pocketdiff.export.parity import ParityConfig
    from pocketdiff.export.rewrites import RewriteConfig

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    arrays = {"sample": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.full((1,), 501.0),
              "temb": torch.randn(1, 32, generator=g), "encoder_hidden_states": torch.randn(1, 77, 16, generator=g)}
    step = _Step().eval()
    with torch.no_grad():
        arrays["reference"] = step(arrays["sample"], arrays["temb"], arrays["encoder_hidden_states"])
    for k, v in arrays.items():
        np.save(tmp_path / f"{k}.npy", v.numpy())
    inputs = {"sample": arrays["sample"], "timestep": arrays["temb"], "encoder_hidden_states": arrays["encoder_hidden_states"]}
    export_component("unet", step, inputs, tmp_path / "ours_fp16.tflite", RewriteConfig(), "fp16", VerifyConfig(delegate=False),
                     ParityConfig(enforce=False))
    (tmp_path / "litert_fp32.tflite").write_bytes(b"\0" * 64)  # not a model: the delegate run fails
    variants = {
        "ours_fp16": {"file": "ours_fp16.tflite", "bytes": (tmp_path / "ours_fp16.tflite").stat().st_size, "time_input": "time_embedding",
                      "feeds": {"names": ["sample", "timestep", "encoder_hidden_states"], "arrays": ["sample", "temb", "encoder_hidden_states"]}},
        "litert_fp32": {"file": "litert_fp32.tflite", "bytes": 64, "time_input": "timestep"},
    }
    (tmp_path / "manifest.json").write_text(json.dumps({"key": "k", "params": 5, "variants": variants}))
    args = argparse.Namespace(append=False, skip_gpu=False, skip_f32=False, skip_cpu=False, timeout=120.0, budget_s=None,
                              repeats=1, warmup=0, cpu_threads=1)
    out = tmp_path / "r.json"
    bench.stage_delegate(args, tmp_path, None, out)
    r = json.loads(out.read_text())
    assert r["delegate_driver"] == gpu_delegate
    ours = r["summary"]["ours_fp16"]
    assert ours["fully_accelerated"] is True and ours["fp16_ok"] is True
    assert ours["fp16_cosine"] > 0.999 and ours["fp32_cosine"] > 0.99999 and ours["cpu_cosine"] > 0.99999
    bad = r["variants"]["litert_fp32"]
    assert bad["gpu"]["compiled"] is False and bad["gpu"]["errors"]["fp16"] and bad["cpu"]["error"]
    assert r["summary"]["litert_fp32"]["gpu_errors"]["fp16"]
