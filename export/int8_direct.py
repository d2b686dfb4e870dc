"""int8 weights the GPU keeps as int8: 1x1 convolutions fed their int8 filter directly.

Export stores int8 weights as an int8 constant -> DEQUANTIZE -> float filter -> CONV_2D; LiteRT's GPU accelerator
(ML Drift) folds the DEQUANTIZE at load and holds the filter as float. A CONV_2D whose filter input is itself an
int8 tensor with per-channel affine quantization and shape [O, 1, 1, I] is built as FULLY_CONNECTED_INT8 instead,
its weights uploaded as the int8 bytes (LiteRT `ml_drift_delegate/tflite/model_builder.cc`, `IsConvertibleToFC`).

`feed_int8_directly` rewrites a .tflite that way: every CONV_2D with a 1x1 filter produced by a DEQUANTIZE of an int8
constant takes that constant as its filter, and a DEQUANTIZE left without consumers is dropped. The codes and scales
are the same tensors, so they stay bit-exact. Larger kernels keep their DEQUANTIZE. The CPU's TFLite kernels run
such a CONV_2D as a "hybrid" op that quantizes the activations on the fly, so a bundle made this way is for the GPU.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

from ai_edge_litert import schema_py_generated as schema

from pocketdiff.runtime.tflite_file import TfliteModel


def _int8_1x1_source(model: TfliteModel, filter_tensor: int) -> int | None:
    """The int8 constant behind a DEQUANTIZE producing `filter_tensor`, when it is a per-channel [O, 1, 1, I]."""
    producer = model.producers().get(filter_tensor)
    if producer is None:
        return None
    op = model.graph.operators[producer]
    if model.op_name(op) != "DEQUANTIZE":
        return None
    src = int(op.inputs[0])
    t = model.graph.tensors[src]
    shape = [int(s) for s in t.shape]
    q = t.quantization
    if t.type != schema.TensorType.INT8 or len(shape) != 4 or shape[1:3] != [1, 1] or not model.is_constant(src):
        return None
    if q is None or q.scale is None or len(q.scale) not in (1, shape[0]) or int(q.quantizedDimension or 0) != 0:
        return None
    return src


def feed_int8_directly(model: TfliteModel) -> int:
    """Rewrite in place; returns how many CONV_2D now read an int8 filter directly."""
    g = model.graph
    rewired = 0
    for op in g.operators:
        if model.op_name(op) != "CONV_2D" or len(op.inputs) < 2:
            continue
        src = _int8_1x1_source(model, int(op.inputs[1]))
        if src is not None:
            inputs = list(op.inputs)
            inputs[1] = src
            op.inputs = inputs
            rewired += 1
    model._consumers = None
    cons = model.consumers()
    outputs = set(int(t) for t in g.outputs)
    g.operators = [op for op in g.operators
                   if not (model.op_name(op) == "DEQUANTIZE" and not any(cons.get(int(o)) for o in op.outputs)
                           and not outputs & {int(o) for o in op.outputs})]
    model._producers = model._consumers = None
    return rewired


def rewrite_file(src: Union[str, Path], dst: Union[str, Path]) -> int:
    """`feed_int8_directly` on a file; writes `dst` (weights kept after the flatbuffer when large, as export does)."""
    model = TfliteModel(src)
    n = feed_int8_directly(model)
    model.save(dst)
    return n


def rewrite_bundle(src: Union[str, Path], dst: Union[str, Path]) -> dict:
    """A copy of bundle `src` at `dst` whose int8 components feed their 1x1 filters directly: each rewritten file's
    sha256 and size updated in the manifest, and `int8.storage: direct` on its entry (the runtime then asks the
    accelerator for int8 FC/conv kernels). Returns component -> number of rewired convolutions."""
    import json
    import shutil

    from pocketdiff.errors import PocketdiffError
    from pocketdiff.outputs import write_json

    from .bundle import file_entry

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise PocketdiffError(f"{dst}: exists; choose a new folder")
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    done = {}
    for name, entry in manifest["components"].items():
        if entry.get("weights") != "int8" or not entry.get("path"):
            continue
        path = dst / entry["path"]
        done[name] = rewrite_file(src / entry["path"], path)
        entry.update(file_entry(dst, path))
        entry.setdefault("int8", {})["storage"] = "direct"
    write_json(dst / "manifest.json", manifest)
    return done
