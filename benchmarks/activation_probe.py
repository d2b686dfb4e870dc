#!/usr/bin/env python
"""GPU memory held by activations (intermediate tensors) on the LiteRT GPU accelerator, at SD-2.1 512 px sizes (issue 49 item 1).

The phone export's UNet chunks hold far more GPU than their int8 weights (unet.0: 665 MB for a ~110 MB file). These
small graphs, each at the 64x64-latent / 320-channel size of down_blocks.0 and with few weights, isolate where that goes.
Each is built from diffusers' own blocks through the export's rewrites (export/rewrites.py `apply_rewrites` with the
`rewrites` of configs/sd21/export_student_int8gpu.yaml: SplitAttention's query chunks, RankFourGroupNorm, clipped GEGLU,
Linear -> 1x1 conv, the shifted_1x1 lowering), converted by litert-torch (export/convert.py `to_tflite`), then stored as
the export stores int8: every conv weight int8 + DEQUANTIZE, other float constants fp16, and 1x1 filters fed their int8
tensor directly (export/int8_direct.py, `int8.gpu_weights: direct`). Weights are a small random int8 block tiled, so
the files pack to little with xz; their values do not change the memory.

  baseline             one 32->32 1x1 conv at 8x8: the fixed GPU cost of a process, an environment and a model
  chain24              24 320->320 1x1 convs at 64x64 in a row: 24 tensors of 2.6 MB (fp16); does the planner reuse buffers?
  attn_none / attn_b64 / attn_b16 / attn_b4
                       SD-2.1 self-attention (320 channels, 5 heads x 64) over 64x64 = 4096 tokens as SplitAttention,
                       unchunked (the 5 x 4096 x 4096 map, 160 MiB at fp16) and with rewrites.attention_budget_mb 64 / 16 / 4
                       (3 / 11 / 41 query chunks): flat GPU across budgets = chunk buffers not reused
  transformer_b64      the whole SD-2.1 Transformer2DModel of down_blocks.0 (GroupNorm, proj_in, self-attn, cross-attn over
                       77 x 1024 text tokens, GEGLU FF 1280, proj_out) at budget 64: what unet.0 holds per transformer
  resnet_conv3x3 / resnet_shifted1x1
                       SD-2.1 ResnetBlock2D 320->320 with the 1280 time embedding (GroupNorm, SiLU, two 3x3 convs):
                       plain 3x3 (int8 + DEQUANTIZE) vs the shifted_1x1 lowering (nine taps over slices of a padded copy)
  groupnorm            RankFourGroupNorm (fp16-safe, 32 groups) + SiLU alone at 64x64x320: GroupNorm temporaries

index.json gives per graph the arithmetic: attention-map bytes (per chunk and all chunks, fp16 and fp32) and, from the
.tflite itself, the intermediate tensors' bytes summed (every tensor its own buffer: no reuse) and the largest live set
in op order (perfect reuse), both at fp16 and fp32.

  make   (here; litert-torch): DIR/*.tflite.xz + DIR/index.json
         python benchmarks/activation_probe.py make .devprobe2
  on the GPU machine (each file alone in a fresh process, `bundle_footprint.py matrix FILE --sets ...`; ops.json in the .tgz):
         PARTS=ops PROBE_DIR=.devprobe2 PROBE_SETS=base,int8_kernels bash scripts/gpu/weight_path.sh
  summarize: python benchmarks/activation_probe.py summarize ops.json --index .devprobe2/index.json \\
                 --out benchmarks/results/activation_probe_h200.json
"""
from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "sd21" / "export_student_int8gpu.yaml"
# SD-2.1 down_blocks.0 at 512 px: 64x64 latents, 320 channels, 5 heads of 64, text 77 x 1024, time embedding 1280
HW, C, HEADS, TEXT, CROSS, TEMB = 64, 320, 5, 77, 1024, 1280
GRAPHS = ("baseline", "chain24", "attn_none", "attn_b64", "attn_b16", "attn_b4", "transformer_b64",
          "resnet_conv3x3", "resnet_shifted1x1", "groupnorm")
BUDGETS_MB = {"none": None, "b64": 64.0, "b16": 16.0, "b4": 4.0}
CHAIN = 24
MB = 2**20


def _rewrite_config(**overrides):
    """The phone export's rewrites (configs/sd21/export_student_int8gpu.yaml), with `overrides`."""
    import yaml

    from pocketdiff.export.rewrites import RewriteConfig

    section = dict(yaml.safe_load(CONFIG.read_text()).get("rewrites") or {})
    section.update(overrides)
    return RewriteConfig(**section)


def _graph(name: str, hw: int, c: int, heads: int, budget_mb: dict):
    """(torch module after the export's rewrites, sample inputs, rewrite report) for graph `name`."""
    import torch
    from torch import nn

    from pocketdiff.export.rewrites import apply_rewrites

    torch.manual_seed(0)
    x = torch.randn(1, c, hw, hw)
    if name == "baseline":
        return nn.Conv2d(32, 32, 1).eval(), (torch.randn(1, 32, 8, 8),), {}
    if name == "chain24":
        model = nn.Sequential(*[nn.Conv2d(c, c, 1) for _ in range(CHAIN)]).eval()
        return model, (x,), {}
    if name == "groupnorm":
        class Norm(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.GroupNorm(32, c, eps=1e-5)

            def forward(self, h):
                return nn.functional.silu(self.norm(h))

        model, inputs, cfg = Norm().eval(), (x,), _rewrite_config(conv_lowering="none")
    elif name.startswith("attn_"):
        from diffusers.models.attention_processor import Attention

        class SelfAttention(nn.Module):  # BasicTransformerBlock.attn1 of down_blocks.0: tokens in, tokens out
            def __init__(self):
                super().__init__()
                self.attn1 = Attention(query_dim=c, heads=heads, dim_head=c // heads, bias=False, out_bias=True)

            def forward(self, h):
                return self.attn1(h)

        model, inputs = SelfAttention().eval(), (torch.randn(1, hw * hw, c),)
        cfg = _rewrite_config(attention_budget_mb=budget_mb[name.split("_", 1)[1]], conv_lowering="none")
    elif name.startswith("transformer_"):
        from diffusers.models.transformers.transformer_2d import Transformer2DModel

        class Block(nn.Module):  # down_blocks.0.attentions.0 of SD-2.1 (use_linear_projection)
            def __init__(self):
                super().__init__()
                self.t = Transformer2DModel(num_attention_heads=heads, attention_head_dim=c // heads, in_channels=c,
                                            num_layers=1, cross_attention_dim=CROSS, norm_num_groups=32,
                                            use_linear_projection=True)

            def forward(self, h, ctx):
                return self.t(h, encoder_hidden_states=ctx, return_dict=False)[0]

        model, inputs = Block().eval(), (x, torch.randn(1, TEXT, CROSS))
        cfg = _rewrite_config(attention_budget_mb=budget_mb[name.split("_", 1)[1]], conv_lowering="none")
    elif name.startswith("resnet_"):
        from diffusers.models.resnet import ResnetBlock2D

        class Resnet(nn.Module):  # down_blocks.0.resnets.0 of SD-2.1
            def __init__(self):
                super().__init__()
                self.r = ResnetBlock2D(in_channels=c, out_channels=c, temb_channels=TEMB, groups=32, eps=1e-5)

            def forward(self, h, temb):
                return self.r(h, temb)

        model, inputs = Resnet().eval(), (x, torch.randn(1, TEMB))
        cfg = _rewrite_config(conv_lowering="shifted_1x1" if name.endswith("shifted1x1") else "none")
    else:
        raise ValueError(f"unknown graph {name!r}; choose from {', '.join(GRAPHS)}")
    report = apply_rewrites(model, cfg, sample_inputs=inputs, component="unet")
    from pocketdiff.export.rewrites import SplitAttention

    with torch.no_grad():
        model(*inputs)  # SplitAttention records its chunks
    report["attention_chunks"] = [m.last_chunks for m in model.modules() if isinstance(m, SplitAttention)]
    return model.eval(), inputs, report


def _tiled(shape, rng) -> np.ndarray:
    block = rng.integers(-127, 128, size=4096, dtype=np.int64).astype(np.int8)
    return np.resize(block, int(np.prod(shape))).reshape(shape)


def _store_like_export(raw: Path, dst: Path) -> dict:
    """The export's int8 storage (export/convert.py `store_weights` with weights: int8, then export/int8_direct.py):
    conv / FC / matmul weights int8 (tiled codes) + DEQUANTIZE, the other float constants fp16, 1x1 filters direct."""
    from pocketdiff.export.int8_direct import rewrite_file
    from pocketdiff.export.tflite_file import TfliteWeightRewriter

    m = TfliteWeightRewriter(raw)
    rng = np.random.default_rng(0)
    m.begin_edit()
    n_int8 = weights = 0
    for t in m.weight_tensors(min_elements=1024):
        shape = [int(s) for s in m.graph.tensors[t].shape]
        m.store_int8(t, _tiled(shape, rng), np.full(shape[0], 0.01 / 127, np.float32))
        n_int8 += 1
        weights += int(np.prod(shape))
    m.end_edit()
    deq_out = {int(op.outputs[0]) for op in m.graph.operators if m.op_name(op) == "DEQUANTIZE"}
    n_fp16 = m.store_weights_fp16(exclude=deq_out)
    m.save(dst)
    direct = rewrite_file(dst, dst)
    return {"int8_tensors": n_int8, "int8_weights": weights, "fp16_tensors": n_fp16, "int8_direct_convs": direct}


def tensor_arithmetic(path: Path) -> dict:
    """From the .tflite: the intermediate tensors (not constants, not the float outputs of a constant's DEQUANTIZE),
    their bytes summed (each its own buffer) and the largest set alive at once in op order (a tensor lives from its
    producer to its last consumer; graph inputs from the start, outputs to the end), at fp16 and at fp32."""
    from pocketdiff.runtime.tflite_file import TfliteModel

    m = TfliteModel(path)
    g = m.graph
    const = {i for i in range(len(g.tensors)) if m.is_constant(i)}
    for op in g.operators:  # folded weights: DEQUANTIZE of a constant
        if m.op_name(op) == "DEQUANTIZE" and int(op.inputs[0]) in const:
            const |= {int(o) for o in op.outputs}
    n_ops = len(g.operators)
    first, last = {}, {}
    for t in g.inputs:
        first[int(t)] = -1
    for i, op in enumerate(g.operators):
        for t in op.outputs:
            if int(t) not in const:
                first.setdefault(int(t), i)
                last[int(t)] = max(last.get(int(t), i), i)
        for t in op.inputs:
            if t >= 0 and int(t) not in const:
                last[int(t)] = i
    for t in g.outputs:
        last[int(t)] = n_ops
    elems = {t: int(np.prod([int(s) for s in g.tensors[t].shape])) if len(g.tensors[t].shape) else 1 for t in first}
    delta = np.zeros(n_ops + 3, np.int64)
    for t, f in first.items():
        delta[f + 1] += elems[t]
        delta[last.get(t, f) + 2] -= elems[t]
    live = int(np.cumsum(delta).max())
    total = sum(elems.values())
    big = max(elems.values())
    return {"ops": n_ops, "op_kinds": m.op_histogram(), "intermediate_tensors": len(elems),
            "sum_elements": total, "peak_live_elements": live, "largest_elements": big,
            "sum_fp16_mb": round(total * 2 / MB, 1), "sum_fp32_mb": round(total * 4 / MB, 1),
            "peak_live_fp16_mb": round(live * 2 / MB, 1), "peak_live_fp32_mb": round(live * 4 / MB, 1),
            "largest_fp16_mb": round(big * 2 / MB, 2)}


def attention_arithmetic(name: str, hw: int, c: int, heads: int, budget_mb: dict) -> dict | None:
    """The attention maps a graph makes (export/rewrites.py `attention_chunks`): per chunk and over all chunks, scores
    and softmax each that size (so 2x when neither is reused), at fp16 and fp32."""
    from pocketdiff.export.rewrites import attention_chunks

    if not (name.startswith("attn_") or name.startswith("transformer_")):
        return None
    budget = budget_mb[name.split("_", 1)[1]]
    L = hw * hw
    n = attention_chunks(heads, L, L, None if budget is None else budget * MB, 2)
    rows = -(-L // n)
    per_chunk = heads * rows * L * 2
    full = heads * L * L * 2
    out = {"budget_mb": budget, "tokens": L, "heads": heads, "chunks": n, "rows_per_chunk": rows,
           "map_per_chunk_fp16_mb": round(per_chunk / MB, 1), "map_all_chunks_fp16_mb": round(full / MB, 1),
           "scores_plus_softmax_one_chunk_fp16_mb": round(2 * per_chunk / MB, 1),
           "scores_plus_softmax_all_chunks_fp16_mb": round(2 * full / MB, 1),
           "scores_plus_softmax_all_chunks_fp32_mb": round(4 * full / MB, 1)}
    if name.startswith("transformer_"):  # cross-attention over the 77 text tokens: small
        out["cross_map_fp16_mb"] = round(heads * L * TEXT * 2 / MB, 2)
    return out


def make(folder: Path, names=GRAPHS, hw: int = HW, c: int = C, heads: int = HEADS, budget_mb: dict | None = None,
         pack: bool = True) -> dict:
    """Convert each graph, store its weights as the export does, write DIR/NAME.tflite.xz (or DIR/NAME.tflite with
    `pack` false) and DIR/index.json. `hw`, `c`, `heads`, `budget_mb` shrink it (tests)."""
    import torch

    from pocketdiff.export.convert import to_tflite

    budget_mb = dict(BUDGETS_MB if budget_mb is None else budget_mb)
    folder.mkdir(parents=True, exist_ok=True)
    index_path = folder / "index.json"
    made = json.loads(index_path.read_text()) if index_path.exists() else {}
    for name in names:
        model, inputs, report = _graph(name, hw, c, heads, budget_mb)
        raw = folder / f"_{name}_fp32.tflite"
        out = folder / f"{name}.tflite"
        seconds = to_tflite(model, inputs, raw)
        storage = _store_like_export(raw, out)
        raw.unlink()
        with torch.no_grad():
            ref = model(*inputs)
        entry = {"bytes": out.stat().st_size, "convert_s": round(seconds, 1), "size": {"hw": hw, "channels": c, "heads": heads},
                 "inputs": [list(t.shape) for t in inputs], "output": list(ref.shape), "rewrites": report, **storage,
                 "attention": attention_arithmetic(name, hw, c, heads, budget_mb), "tensors": tensor_arithmetic(out)}
        if pack:
            xz = folder / f"{name}.tflite.xz"
            with lzma.open(xz, "wb", preset=6) as f:
                f.write(out.read_bytes())
            out.unlink()
            entry["packed"] = xz.stat().st_size
        made[f"{name}.tflite" + (".xz" if pack else "")] = entry
        print(name, json.dumps({k: entry.get(k) for k in ("bytes", "packed", "convert_s", "int8_weights", "int8_direct_convs")}),
              json.dumps({k: v for k, v in entry["tensors"].items() if k != "op_kinds"}), flush=True)
        index_path.write_text(json.dumps(made, indent=1))
    return made


def run_cpu(path: Path) -> dict:
    """One run on TFLite's CPU interpreter (a check that the graph converts and runs), through the runtime's CPU
    variant of an int8 file (runtime/cpu_variant.py: int8 filters as float, as `run-bundle --accelerator cpu`)."""
    import tempfile

    from ai_edge_litert.interpreter import Interpreter

    from pocketdiff.runtime.cpu_variant import fp16_variant

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src.tflite", Path(tmp) / "cpu.tflite"
        src.write_bytes(lzma.open(path).read() if path.suffix == ".xz" else path.read_bytes())
        fp16_variant(src, dst)
        data = dst.read_bytes()
    it = Interpreter(model_content=data, num_threads=1)
    it.allocate_tensors()
    rng = np.random.default_rng(0)
    for d in it.get_input_details():
        it.set_tensor(d["index"], (rng.standard_normal(d["shape"]) * 0.5).astype(d["dtype"]))
    it.invoke()
    outs = [it.get_tensor(d["index"]) for d in it.get_output_details()]
    return {"model": path.name, "outputs": [list(o.shape) for o in outs], "finite": all(bool(np.isfinite(o).all()) for o in outs)}


def _name(model: str) -> str:
    return model.replace(".tflite", "").replace(".xz", "")


def _phase_mb(row: dict, phase: str):
    for p in row.get("phases") or []:
        if p.get("phase") == phase:
            return p.get("gpu_mb")
    return None


def summarize(ops: Path, index: Path | None) -> dict:
    """ops.json (bundle_footprint.py `matrix` rows of each probe file) -> one row per graph and option set: GPU peak,
    compiled, first-run and steady MB, the steady GPU over the baseline graph's (same set), and the arithmetic."""
    rows = json.loads(ops.read_text())["rows"]
    idx = {_name(k): v for k, v in json.loads(index.read_text()).items()} if index and index.exists() else {}
    base = {r.get("set"): _phase_mb(r, "steady_run") for r in rows if _name(r.get("model", "")) == "baseline"}
    out = []
    for r in rows:
        name = _name(r.get("model", ""))
        kind = name.split("_", 1)
        info = idx.get(name, {})
        att = info.get("attention") or attention_arithmetic(name, HW, C, HEADS, BUDGETS_MB)
        steady = _phase_mb(r, "steady_run")
        b = base.get(r.get("set"))
        out.append({
            "graph": name, "set": r.get("set"), "options": r.get("options"),
            "attention_budget_mb": None if att is None else att["budget_mb"],
            "attention_chunks": None if att is None else att["chunks"],
            "lowering": "shifted_1x1" if name.endswith("shifted1x1") else ("none" if kind[0] == "resnet" else None),
            "gpu_peak_mb": r.get("gpu_peak_mb"), "gpu_compiled_mb": _phase_mb(r, "compiled"),
            "gpu_first_run_mb": _phase_mb(r, "first_run"), "gpu_steady_mb": steady,
            "gpu_steady_over_baseline_mb": None if steady is None or b is None else round(steady - b, 1),
            "host_peak_mb": r.get("host_peak_mb"), "load_s": r.get("load_s"), "steady_run_s": r.get("steady_run_s"),
            "fully_accelerated": r.get("fully_accelerated"), "finite": r.get("finite"), "error": r.get("error"),
            "file_mb": r.get("file_mb"), "int8_weights": info.get("int8_weights"),
            "expected": {"attention": att, "tensors": {k: v for k, v in (info.get("tensors") or {}).items() if k != "op_kinds"} or None},
        })
    return {"what": __doc__.split("\n\n")[0], "sizes": {"hw": HW, "channels": C, "heads": HEADS, "text": TEXT, "cross": CROSS},
            "reading": "gpu_steady_over_baseline_mb against expected.tensors: near peak_live_* = buffers reused; near "
                       "sum_* = every intermediate its own buffer; attn_* flat across budgets = chunk maps not reused",
            "rows": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("folder")
    mk.add_argument("--only", default=None, help=f"comma list of graphs (default all: {','.join(GRAPHS)})")
    mk.add_argument("--check", action="store_true", help="then run each file once on the CPU interpreter")
    ck = sub.add_parser("check", help="run each DIR/*.tflite.xz once on the CPU interpreter")
    ck.add_argument("folder")
    sm = sub.add_parser("summarize")
    sm.add_argument("ops")
    sm.add_argument("--index", default=".devprobe2/index.json")
    sm.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "make":
        names = GRAPHS if a.only is None else tuple(a.only.split(","))
        make(Path(a.folder), names)
        if a.check:
            for n in names:
                print(json.dumps(run_cpu(Path(a.folder) / f"{n}.tflite.xz")), flush=True)
    elif a.cmd == "check":
        for p in sorted(Path(a.folder).glob("*.tflite.xz")):
            print(json.dumps(run_cpu(p)), flush=True)
    else:
        Path(a.out).write_text(json.dumps(summarize(Path(a.ops), Path(a.index)), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
