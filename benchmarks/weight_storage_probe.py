#!/usr/bin/env python
"""GPU bytes per weight by op kind and storage, measured on the LiteRT GPU accelerator (issues 48/49).

Three graphs of the same 14.7 M weights at 32x32 activations: four 640->640 3x3 convolutions (`conv3x3`), the same
convolutions lowered to nine accumulated 1x1 convolutions over shifted inputs (`shifted1x1`), and 36 plain 640->640
1x1 convolutions (`conv1x1`: what the exported Linear layers are). Each in three weight storages:
`fp16` (fp16 constants + DEQUANTIZE), `int8_dequant` (int8 codes + per-channel scales + DEQUANTIZE: today's export)
and `int8_direct` (the 1x1 convolutions' filters ARE the int8 tensors, no DEQUANTIZE: LiteRT's ML Drift builds such a
CONV_2D as FULLY_CONNECTED_INT8 and keeps its weights as int8; 3x3 filters stay int8_dequant). Weights are a small
random block tiled, so the files pack to a few MB with xz; their values do not change the memory.

  make   (here; litert-torch): the nine .tflite files into DIR, xz-packed beside (DIR/*.tflite.xz)
         python benchmarks/weight_storage_probe.py make .devprobe
  on the GPU machine (one line; ops.json in the .tgz under $OUT):
         PARTS=ops bash scripts/gpu/weight_path.sh
  then on the GPU machine each file alone in a fresh process (`bundle_footprint.py matrix FILE --sets base`),
  e.g. PARTS=ops bash scripts/gpu/weight_path.sh (it unpacks .xz), and
  summarize: python benchmarks/weight_storage_probe.py summarize ops.json --out benchmarks/results/weight_storage_probe_h200.json
"""
from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path

import numpy as np

C, HW, N3 = 640, 32, 4  # channels, spatial size, 3x3 convs (N3 * 9 * C * C weights)
N1 = N3 * 9  # 1x1 convs of the same weight count
STORAGES = ("fp16", "int8_dequant", "int8_direct")


def _modules():
    import torch
    from torch import nn

    class Conv3x3(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(nn.Conv2d(C, C, 3, padding=1) for _ in range(N3))

        def forward(self, x):
            for c in self.convs:
                x = torch.tanh(c(x))
            return x

    class Shifted1x1(nn.Module):
        """Each 3x3 conv lowered as export does it (`rewrites.conv_lowering: shifted_1x1`, export/conv_lowering.py):
        nine 1x1 convs over the padded input's shifted windows, summed."""

        def __init__(self):
            super().__init__()
            from pocketdiff.export.conv_lowering import ShiftedConv2d

            self.taps = nn.ModuleList(ShiftedConv2d(nn.Conv2d(C, C, 3, padding=1), f"convs.{i}") for i in range(N3))

        def forward(self, x):
            for low in self.taps:
                x = torch.tanh(low(x))
            return x

    class Conv1x1(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(nn.Conv2d(C, C, 1) for _ in range(N1))

        def forward(self, x):
            for c in self.convs:
                x = torch.tanh(c(x))
            return x

    return {"conv3x3": Conv3x3, "shifted1x1": Shifted1x1, "conv1x1": Conv1x1}


def _tiled(shape, rng) -> np.ndarray:
    block = rng.integers(-127, 128, size=4096, dtype=np.int64).astype(np.int8)
    n = int(np.prod(shape))
    return np.resize(block, n).reshape(shape)


def _store(src: bytes, storage: str) -> tuple[bytes, dict]:
    from ai_edge_litert import schema_py_generated as schema

    from pocketdiff.export.tflite_file import TfliteWeightRewriter

    m = TfliteWeightRewriter(src)
    rng = np.random.default_rng(0)
    counts = {"fp16": 0, "int8_dequant": 0, "int8_direct": 0}
    m.begin_edit()
    for t in m.weight_tensors(consumers=("CONV_2D",), min_elements=1024):
        shape = [int(s) for s in m.graph.tensors[t].shape]  # OHWI
        scale = np.full(shape[0], 0.01 / 127, np.float32)
        codes = _tiled(shape, rng)
        if storage == "fp16":
            m._insert_dequantize(t, (codes.astype(np.float32) * scale[0]).astype(np.float16), schema.TensorType.FLOAT16, version=3)
            counts["fp16"] += 1
        elif storage == "int8_direct" and shape[1] == shape[2] == 1:
            _int8_inline(m, t, codes, scale)
            counts["int8_direct"] += 1
        else:
            m.store_int8(t, codes, scale)
            counts["int8_dequant"] += 1
    m.end_edit()
    tmp = Path(f"/tmp/_weight_storage_probe_{storage}.tflite")
    m.save(tmp, external=False)
    data = tmp.read_bytes()
    tmp.unlink()
    return data, counts


def _int8_inline(m, t: int, codes: np.ndarray, scale: np.ndarray) -> None:
    """The conv's filter tensor itself becomes int8 with per-output-channel scales (no DEQUANTIZE)."""
    from ai_edge_litert import schema_py_generated as schema

    tensor = m.graph.tensors[t]
    tensor.type = schema.TensorType.INT8
    tensor.buffer = m._new_buffer(codes)
    q = schema.QuantizationParametersT()
    q.scale = [float(s) for s in scale]
    q.zeroPoint = [0] * scale.size
    q.quantizedDimension = 0
    tensor.quantization = q


def make(folder: Path) -> dict:
    import litert_torch
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, cls in _modules().items():
        torch.manual_seed(0)
        model = cls().eval()
        raw = folder / f"_{name}_fp32.tflite"
        litert_torch.convert(model, (torch.randn(1, C, HW, HW),)).export(str(raw))
        for storage in STORAGES:
            data, counts = _store(raw.read_bytes(), storage)
            out = folder / f"{name}_{storage}.tflite.xz"
            with lzma.open(out, "wb", preset=6) as f:
                f.write(data)
            made[out.name] = {"bytes": len(data), "packed": out.stat().st_size, "weights": counts}
            print(out.name, made[out.name], flush=True)
        raw.unlink()
    (folder / "index.json").write_text(json.dumps(made, indent=1))
    return made


def summarize(ops: Path) -> dict:
    rows = json.loads(ops.read_text())["rows"]
    params = N3 * 9 * C * C
    out = []
    for r in rows:
        name = r["model"].replace(".tflite", "")
        kind, storage = name.split("_", 1)
        out.append({"graph": kind, "storage": storage, "weights": params, "gpu_peak_mb": r.get("gpu_peak_mb"),
                    "host_peak_mb": r.get("host_peak_mb"), "load_s": r.get("load_s"), "steady_run_s": r.get("steady_run_s"),
                    "fully_accelerated": r.get("fully_accelerated"), "finite": r.get("finite"), "error": r.get("error")})
    return {"what": __doc__.split("\n\n")[0], "weights_per_graph": params, "rows": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("folder")
    sm = sub.add_parser("summarize")
    sm.add_argument("ops")
    sm.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "make":
        make(Path(a.folder))
    else:
        Path(a.out).write_text(json.dumps(summarize(Path(a.ops)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
