"""A CPU variant of an int8-weight .tflite: the same graph with fp16 weight storage.

XNNPACK has no fast path for weight-only int8 (DEQUANTIZE of per-channel int8 constants in
front of each conv): the SD-2.1-size int8 UNet took > 49 s per step on the CPU where its fp16
file takes 0.9 s. fp16 storage + DEQUANTIZE is TFLite's float16 weight format, which XNNPACK
folds at load. `fp16_variant` rewrites every int8 constant feeding a DEQUANTIZE into fp16
(codes x per-channel scale, the values the GPU graph computes), so `run-bundle --accelerator
cpu` / `verify-bundle --accelerator cpu` of an int8 bundle run at fp16-file speed. The bundle
is not touched: the variant is written to a temporary file at load. int8 filters read by a CONV_2D
directly (export `int8.gpu_weights: direct`) become float32 filters (codes x scale), not the CPU's hybrid
int8 kernel, which would quantize the activations and differ from the GPU. fp16 biases read through a DEQUANTIZE
become float32 constants: XNNPACK leaves a conv with such a bias to TFLite's own kernels (`fp16_biases_to_float`).
"""
from __future__ import annotations

import numpy as np

from pocketdiff.errors import PocketdiffError


def _dequantized(model, i: int) -> np.ndarray:
    """Codes x per-channel scale of INT8 constant `i` (symmetric only), float32."""
    t = model.graph.tensors[i]
    q = t.quantization
    if q is None or q.scale is None or len(q.scale) == 0:
        raise PocketdiffError(f"{model.tensor_name(i)}: int8 constant without scales")
    zp = np.asarray(q.zeroPoint if q.zeroPoint is not None else [0], dtype=np.float32)
    if np.any(zp != 0):
        raise PocketdiffError(f"{model.tensor_name(i)}: asymmetric int8 (zero points) is not supported")
    codes = model.tensor_data(i).astype(np.float32)
    scale = np.asarray(q.scale, dtype=np.float32)
    if scale.size > 1:
        shape = [1] * codes.ndim
        shape[int(q.quantizedDimension or 0)] = scale.size
        scale = scale.reshape(shape)
    return codes * scale


def dequantize_int8_to_fp16(model) -> int:
    """In a `TfliteModel`: every INT8 constant read by a DEQUANTIZE becomes an fp16 constant
    holding codes x scale. Returns how many tensors changed."""
    from ai_edge_litert import schema_py_generated as schema

    g = model.graph
    deq = model._opcode_index(schema.BuiltinOperator.DEQUANTIZE, 3)  # fp16 -> fp32 needs version 3
    n = 0
    for op in g.operators:
        if model.op_name(op) != "DEQUANTIZE":
            continue
        i = int(op.inputs[0])
        t = g.tensors[i]
        if t.type != schema.TensorType.INT8 or not model.is_constant(i):
            continue
        t.buffer = model._new_buffer(_dequantized(model, i).astype(np.float16))
        t.type = schema.TensorType.FLOAT16
        t.quantization = None
        op.opcodeIndex = deq
        n += 1
    return n


def direct_int8_filters_to_float(model) -> int:
    """In a `TfliteModel`: every INT8 constant filter read by a CONV_2D itself (export `int8.gpu_weights: direct`,
    which the CPU's TFLite kernels would run as a hybrid op quantizing the activations on the fly) becomes a float32
    constant holding codes x scale: the values the GPU computes with. Returns how many tensors changed."""
    from ai_edge_litert import schema_py_generated as schema

    g = model.graph
    n = 0
    for op in g.operators:
        if model.op_name(op) != "CONV_2D" or len(op.inputs) < 2:
            continue
        i = int(op.inputs[1])
        t = g.tensors[i]
        if t.type != schema.TensorType.INT8 or not model.is_constant(i):
            continue
        t.buffer = model._new_buffer(_dequantized(model, i))
        t.type = schema.TensorType.FLOAT32
        t.quantization = None
        n += 1
    return n


BIAS_SLOTS = {"CONV_2D": 2, "DEPTHWISE_CONV_2D": 2, "FULLY_CONNECTED": 2}


def fp16_biases_to_float(model) -> int:
    """In a `TfliteModel`: every DEQUANTIZE of an FLOAT16 constant whose output is read only as the bias of a
    CONV_2D / DEPTHWISE_CONV_2D / FULLY_CONNECTED becomes a float32 constant (the same values: fp16 -> fp32 is exact)
    and the DEQUANTIZE is removed. XNNPACK (ai-edge-litert 2.3.0) takes no conv whose bias is such a DEQUANTIZE's
    output: the SD-2.1-size text encoder's CPU variant ran all its 1x1 convs (the linear layers: ~all its FLOPs) on
    TFLite's own kernels, between 29-33 XNNPACK partitions per chunk. Returns how many biases changed."""
    from ai_edge_litert import schema_py_generated as schema

    g = model.graph
    consumers = model.consumers()
    graph_outputs = {int(t) for t in g.outputs}
    drop = set()
    for k, op in enumerate(g.operators):
        if model.op_name(op) != "DEQUANTIZE" or len(op.inputs) != 1 or len(op.outputs) != 1:
            continue
        i, o = int(op.inputs[0]), int(op.outputs[0])
        if g.tensors[i].type != schema.TensorType.FLOAT16 or not model.is_constant(i) or o in graph_outputs:
            continue
        readers = [g.operators[r] for r in consumers.get(o, [])]
        if not readers or not all(BIAS_SLOTS.get(model.op_name(r)) == list(r.inputs).index(o)
                                  and list(r.inputs).count(o) == 1 for r in readers):
            continue
        t = g.tensors[o]
        t.buffer = model._new_buffer(model.tensor_data(i).astype(np.float32))
        t.type = schema.TensorType.FLOAT32
        t.quantization = None
        drop.add(k)
    model.remove_operators(drop)
    return len(drop)


def fp16_variant(src, dst) -> int:
    """Write the fp16-storage variant of `src` to `dst`; returns the tensors converted."""
    from .tflite_file import TfliteModel

    m = TfliteModel(src)
    n = dequantize_int8_to_fp16(m) + direct_int8_filters_to_float(m) + fp16_biases_to_float(m)
    m.save(dst)
    return n


VARIANT_VERSION = 2  # bump when fp16_variant writes another graph: the kept files of earlier versions are then not read
# 2: fp16 biases behind DEQUANTIZE folded to float32 (fp16_biases_to_float): XNNPACK then takes the convs


def kept_variant(src, sha256: str, folder) -> tuple[str, bool]:
    """The CPU variant of `src` (whose checked sha256 is `sha256`) kept in `folder` between launches: made once (written
    to a private file, then renamed, so a killed launch leaves no half file under the final name), read as it is later.
    Its name holds the source's sha256 and VARIANT_VERSION: another file or converter never reads it. A kept file that is
    not a whole .tflite (cut by a full disk, overwritten) is made again, with one warning line. Returns (path, whether
    it was made now)."""
    import os
    import sys
    from pathlib import Path

    from .tflite_file import check_tflite_file

    folder = Path(folder)
    path = folder / f"{sha256}.v{VARIANT_VERSION}.tflite"
    if path.is_file():
        try:
            check_tflite_file(path)
            return str(path), False
        except PocketdiffError as e:
            print(f"warning: CPU variant: {e}; made again", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-{os.getpid()}-{path.name}"
    try:
        fp16_variant(src, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return str(path), True
