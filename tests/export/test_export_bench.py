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

    from pocketdiff.export import delegate

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
