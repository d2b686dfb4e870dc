"""benchmarks/activation_probe.py at a reduced size (8x8 latents, 32 channels): the probe graphs convert through the
export's rewrites and int8 storage, carry the op kinds they are meant to isolate, run on the CPU, and summarize."""
from __future__ import annotations

import json

import pytest
from script_module import load_script  # tests/script_module.py

SMALL = {"hw": 8, "c": 32, "heads": 2}
# 2 heads x 64 x 64 keys x 2 bytes = 256 B per query row: 0.004 MB -> 16 rows -> 4 chunks
BUDGETS = {"none": None, "b64": 0.004, "b16": 0.002, "b4": 0.001}


@pytest.fixture(scope="module")
def probe():
    return load_script("benchmarks/activation_probe.py", "activation_probe_bench")


@pytest.fixture(scope="module")
def made(probe, tmp_path_factory):
    folder = tmp_path_factory.mktemp("activation_probe")
    index = probe.make(folder, names=("attn_b64", "resnet_shifted1x1"), budget_mb=BUDGETS, **SMALL)
    return folder, index


def test_chunked_attention_is_the_exports_split_attention(probe, made):
    folder, index = made
    e = index["attn_b64.tflite.xz"]
    ops = e["tensors"]["op_kinds"]
    chunks = e["attention"]["chunks"]
    assert chunks == 4 and e["rewrites"]["attention_chunks"] == [4]
    assert ops["BATCH_MATMUL"] == 2 * chunks and ops["SOFTMAX"] == chunks
    assert ops["CONV_2D"] == 4 and e["int8_direct_convs"] == 4  # q, k, v, out: 1x1 convs on their int8 filters
    assert e["attention"]["map_all_chunks_fp16_mb"] == pytest.approx(2 * 64 * 64 * 2 / 2**20, abs=0.05)
    assert e["packed"] < e["bytes"] and (folder / "attn_b64.tflite.xz").exists()
    assert probe.run_cpu(folder / "attn_b64.tflite.xz")["finite"]


def test_shifted_resnet_has_no_3x3_filters(probe, made):
    folder, index = made
    e = index["resnet_shifted1x1.tflite.xz"]
    ops = e["tensors"]["op_kinds"]
    assert e["rewrites"]["conv_lowering"]["kernels"] == {"3x3": 2}
    assert ops["CONV_2D"] == 2 * 9 + 1 and e["int8_direct_convs"] == 19  # nine taps per conv + time_emb_proj
    assert ops["PAD"] == 2
    t = e["tensors"]
    assert 0 < t["largest_elements"] < t["peak_live_elements"] < t["sum_elements"]
    assert t["largest_elements"] == 32 * 10 * 10  # the padded copy of an 8x8x32 input
    assert probe.run_cpu(folder / "resnet_shifted1x1.tflite.xz")["outputs"] == [[1, 32, 8, 8]]


def test_summarize_rows(probe, made, tmp_path):
    folder, _ = made
    phases = lambda steady: [{"phase": "compiled", "gpu_mb": steady + 10}, {"phase": "steady_run", "gpu_mb": steady}]
    rows = [{"model": "baseline.tflite", "set": "base", "gpu_peak_mb": 30.0, "phases": phases(20.0)},
            {"model": "attn_b64.tflite", "set": "base", "gpu_peak_mb": 300.0, "phases": phases(200.0)}]
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps({"rows": rows}))
    out = probe.summarize(ops, folder / "index.json")["rows"]
    attn = next(r for r in out if r["graph"] == "attn_b64")
    assert attn["attention_budget_mb"] == BUDGETS["b64"] and attn["attention_chunks"] == 4
    assert (attn["gpu_peak_mb"], attn["gpu_steady_mb"], attn["gpu_steady_over_baseline_mb"]) == (300.0, 200.0, 180.0)
    assert attn["expected"]["tensors"]["intermediate_tensors"] > 0
