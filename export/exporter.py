"""Export one component: rewrite, convert, store weights, verify on the GPU delegate.

`export_component` is the whole per-component contract of the export verb:
(a) conversion through litert-torch after the configured module swaps; (b) weight storage
fp32 / fp16 / int8 (codes carried bit for bit); (c) the LiteRT GPU delegate must accelerate
every op, else the export fails naming each rejected op, the delegate's reason and the torch
module it came from; (d) parity with PyTorch on fixed inputs at the delegate's default (fp16)
precision and at fp32, against named thresholds; (e) op histogram, TRANSPOSE count, bytes;
(f) golden input/output pairs for the bundle.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import resource
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from pocketdiff.errors import ParityError, PocketdiffError
from pocketdiff.runtime import parity as parity_lib
from pocketdiff.runtime.delegate import RejectedOp, module_from_location, run_on_delegate
from pocketdiff.runtime.tflite_file import TfliteModel

from .convert import store_weights
from .int8 import QuantizedComponent, pieces_for, split_groupwise, unexported_layers
from .int8_direct import rewrite_file
from .parity import ParityConfig
from .rewrites import RewriteConfig, apply_rewrites, attention_chunk_report

log = logging.getLogger(__name__)


@dataclasses.dataclass
class VerifyConfig:
    delegate: bool = True  # run the LiteRT GPU delegate on every export
    require_fully_accelerated: bool = True
    precisions: list[str] = dataclasses.field(default_factory=lambda: ["fp16", "fp32"])
    driver: str = "auto"  # auto | system | lavapipe
    timeout_s: float = 1800.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float32 if x.is_floating_point() else x.dtype).cpu().numpy()


def resolve_module_path(root: nn.Module, location: str) -> str:
    """The converter's location ('pkg.Wrapper/pkg.Class_attr/...;n') -> the dotted torch path
    in `root` (ModuleList hops the converter does not record are found by index and class)."""
    loc = location.split(";;")[0].split(";")[0].strip()
    segs = loc.split("/")[1:]
    path: list[str] = []
    cur = root
    for seg in segs:
        leaf = seg.rsplit(".", 1)[-1]
        if "_" not in leaf:
            break
        cls, attr = leaf.split("_", 1)
        if cur is root and not path and type(root).__name__ == cls:
            continue  # the keyword adapter's child is `root` itself
        children = dict(cur.named_children())
        if attr in children:
            path.append(attr)
            cur = children[attr]
            continue
        hop = None
        for cname, child in children.items():
            if isinstance(child, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
                sub = dict(child.named_children())
                if attr in sub and type(sub[attr]).__name__ == cls:
                    hop = (cname, sub[attr])
                    break
        if hop is None:
            path.append(f"{attr}({cls})")
            break
        path += [hop[0], attr]
        cur = hop[1]
    return ".".join(path) or module_from_location(location)


def _rejected_with_modules(run, model: TfliteModel, root: nn.Module) -> list[dict]:
    """Rejected ops with the torch modules they came from (log location, else the graph's ops of that type)."""
    out = []
    for r in run.rejected:
        locs = [r.location] if r.location else model.op_locations(r.op, limit=50)
        modules = sorted({resolve_module_path(root, loc) for loc in locs})
        out.append({"op": r.op, "reason": r.reason or "rejected", "modules": modules[:10]})
    return out


@dataclasses.dataclass
class Prepared:
    """A component after the PyTorch-side steps (reference, rewrites), ready to convert."""

    name: str
    rewritten: nn.Module
    inputs: dict[str, torch.Tensor]
    reference: np.ndarray
    report: dict
    out_path: Path
    weights: str
    quantized: Optional[QuantizedComponent]
    raw_path: Optional[Path] = None
    references: Optional[list[np.ndarray]] = None  # every output of the reference (golden output_J), output_0 first
    references_by_name: Optional[dict[str, np.ndarray]] = None  # set: parity of every output, matched by the .tflite's names (UNet chunks)


def prepare_component(
    name: str,
    graph: nn.Module,
    inputs: dict[str, torch.Tensor],
    out_path: Path,
    rewrites: RewriteConfig,
    weights: str,
    quantized: Optional[QuantizedComponent] = None,
) -> Prepared:
    """Steps 1-2: the PyTorch reference on the fixed inputs, then the module swaps on a copy,
    checked against the reference."""
    args = tuple(inputs.values())
    report: dict = {"file": out_path.name, "weights": weights, "inputs": {}, "outputs": {}}
    for k, v in inputs.items():
        report["inputs"][k] = {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
    graph = graph.eval()
    with torch.no_grad():
        reference = graph(*args)
    references = [_np(r) for r in (reference if isinstance(reference, tuple) else (reference,))]  # output_0 is checked for parity
    ref_np = references[0]
    for i, r in enumerate(references):
        report["outputs"][f"output_{i}"] = {"shape": list(r.shape), "dtype": "float32"}
    rewritten = copy.deepcopy(graph)
    t0 = time.perf_counter()
    rw = apply_rewrites(rewritten, rewrites, sample_inputs=args, component=name)
    if quantized is not None:
        rw["groupwise_split"] = len(split_groupwise(rewritten, quantized))
    with torch.no_grad():
        rewritten_out = rewritten(*args)
    if isinstance(rewritten_out, tuple):
        rewritten_out = rewritten_out[0]
    rw["attention_chunks"] = attention_chunk_report(rewritten)
    report["rewrites"] = rw
    report["rewrite_s"] = round(time.perf_counter() - t0, 3)
    report["rewrite_parity"] = parity_lib.metrics(ref_np, _np(rewritten_out))
    if not report["rewrite_parity"]["cosine"] >= 0.9999:
        raise ParityError(f"{name}: the rewritten PyTorch module drifted from the original (cosine {report['rewrite_parity']['cosine']:.6f})")
    return Prepared(name, rewritten.eval(), dict(inputs), ref_np, report, out_path, weights, quantized, references=references)


def convert_job(module: nn.Module, inputs: dict[str, torch.Tensor], raw_path: str | Path, num_threads: Optional[int] = None) -> dict:
    """Step 3a, picklable for a worker process: litert-torch conversion (fp32 constants) to
    `raw_path`; returns the `convert_info` that `finish_component` takes."""
    if num_threads:
        torch.set_num_threads(num_threads)
    seconds = _convert(module, inputs, Path(raw_path))
    return {"convert_s": round(seconds, 3), "convert_peak_rss_mb": round(peak_rss_mb(), 1)}


def finish_component(
    prep: Prepared,
    convert_info: dict,
    verify: VerifyConfig,
    parity_cfg: ParityConfig,
    float_storage: str = "fp16",
    int8_gpu: str = "dequantize",
) -> dict:
    """Steps 3b-5: weight storage, graph facts, the GPU delegate and parity."""
    name, report, ref_np, out_path, weights = prep.name, prep.report, prep.reference, prep.out_path, prep.weights
    report.update(convert_info)
    pieces = []
    if weights == "int8":
        if prep.quantized is None:
            raise PocketdiffError(f"{name}: weights=int8 but no int8 checkpoint for this component")
        pieces = pieces_for(prep.rewritten, prep.quantized)
        report["int8_layers"] = len({p.layer for p in pieces})
        report["int8_layers_outside_graph"] = unexported_layers(prep.rewritten, prep.quantized, pieces)
    info = store_weights(prep.raw_path, out_path, weights, pieces, float_storage=float_storage)
    if weights == "int8" and int8_gpu == "direct":  # 1x1 convs read their int8 filter itself (export/int8_direct.py)
        info["int8_direct"] = rewrite_file(out_path, out_path)
    report["int8_tensors"] = info["int8_tensors"]
    report["fp16_tensors"] = info["fp16_tensors"]
    report["int8_direct_convs"] = info.get("int8_direct", 0)
    report["int8_map"] = info["int8_map"]

    # graph facts
    model = TfliteModel(out_path)
    hist = model.op_histogram()
    report["ops"] = hist
    report["op_count"] = int(sum(hist.values()))
    report["transposes"] = int(hist.get("TRANSPOSE", 0))
    report["bytes"] = out_path.stat().st_size
    report["max_rank"] = model.max_rank()
    n, where = model.largest_activation()
    report["largest_activation"] = {"elements": n, "tensor": resolve_module_path(prep.rewritten, where) if where else ""}
    report["suspect_ops"] = {k: v for k, v in hist.items() if k == "BROADCAST_TO" or k.startswith("CUSTOM") or "COMPOSITE" in k}

    # the GPU delegate: full acceleration, then parity at fp16 (default) and fp32
    report["fully_accelerated"] = None
    if verify.delegate:
        feeds = {k: _np(v) for k, v in prep.inputs.items()}
        run = run_on_delegate(out_path, feeds, precisions=verify.precisions, driver=verify.driver, timeout_s=verify.timeout_s)
        report["delegate"] = {
            "driver": run.driver,
            "adapter": run.adapter,
            "compiled": run.compiled,
            "compile_s": run.compile_s,
            "latency_s": run.latency_s,
            "ops_split": run.ops_split,
            "error": run.error,
        }
        report["fully_accelerated"] = bool(run.compiled and run.fully_accelerated)
        if not report["fully_accelerated"]:
            rejected = _rejected_with_modules(run, model, prep.rewritten)
            report["rejected_ops"] = rejected
            if verify.require_fully_accelerated:
                if rejected:
                    detail = "; ".join(f"{r['op']} ({r['reason']}) from {', '.join(r['modules']) or '?'}" for r in rejected)
                else:
                    detail = run.error or "the delegate did not say which ops"
                if model.high_rank_ops(1):
                    detail += f"; tensors above rank 4 at {'; '.join(model.high_rank_ops(5))}"
                raise PocketdiffError(f"{name}: not fully accelerated on the LiteRT GPU delegate ({run.driver}): {detail}")
        report["parity"] = {}
        fails = []
        for prec in verify.precisions:
            if prec not in run.outputs:
                fails.append(f"{name}: the delegate produced no {prec} output ({run.error or 'unknown error'})")
                continue
            m = _output_parity(prep, run, prec)
            report["parity"][prec] = m
            fails += parity_lib.check(name if "output" not in m else f"{name} output {m['output']}", prec, m, parity_cfg.for_precision(prec))
        main = report["parity"].get("fp16") or next(iter(report["parity"].values()), {})
        report["cosine"] = main.get("cosine")
        report["psnr_db"] = main.get("psnr_db")
        report["max_abs"] = main.get("max_abs")
        report["parity_failures"] = fails
        if fails and parity_cfg.enforce:
            raise ParityError("; ".join(fails))
    report["reference"] = ref_np
    return report


def _output_parity(prep: Prepared, run, prec: str) -> dict:
    """Output 0 against the reference; with `references_by_name`, every output against its own, the worst
    (lowest cosine, then PSNR) returned with its name."""
    if prep.references_by_name is None:
        return parity_lib.metrics(prep.reference, run.outputs[prec][0])
    per = {n: parity_lib.metrics(prep.references_by_name[n], out) for n, out in zip(run.output_names, run.outputs[prec])}
    worst = min(per, key=lambda n: (per[n]["finite"], per[n]["cosine"], per[n]["psnr_db"]))
    return {**per[worst], "output": worst}


def export_component(
    name: str,
    graph: nn.Module,
    inputs: dict[str, torch.Tensor],
    out_path: Path,
    rewrites: RewriteConfig,
    weights: str,
    verify: VerifyConfig,
    parity_cfg: ParityConfig,
    quantized: Optional[QuantizedComponent] = None,
    float_storage: str = "fp16",
) -> dict:
    """Export `graph` (a TextEncoderGraph / UNetGraph / VaeDecoderGraph) to `out_path`, in
    this process. Returns the component's report entry; raises PocketdiffError (an op that is
    not GPU-compatible, named with its torch module) or ParityError (a named threshold)."""
    prep = prepare_component(name, graph, inputs, out_path, rewrites, weights, quantized)
    with tempfile.TemporaryDirectory(prefix=f"pocketdiff-{name}-") as tmp:
        prep.raw_path = Path(tmp) / f"{name}_fp32.tflite"
        info = convert_job(prep.rewritten, prep.inputs, prep.raw_path)
        return finish_component(prep, info, verify, parity_cfg, float_storage)


def _convert(module: nn.Module, inputs: dict[str, torch.Tensor], path: Path) -> float:
    """litert-torch with keyword sample inputs, so the signature's inputs carry our names."""
    import litert_torch

    from .convert import converter_quiet

    t0 = time.perf_counter()
    with converter_quiet():
        edge = litert_torch.convert(_Keyworded(module, list(inputs)).eval(), sample_kwargs=dict(inputs))
        edge.export(str(path))
    return time.perf_counter() - t0


class _Keyworded(nn.Module):
    def __init__(self, module: nn.Module, names: list[str]):
        super().__init__()
        self.module = module
        self.names = names

    def forward(self, **kwargs):
        return self.module(*[kwargs[n] for n in self.names])
