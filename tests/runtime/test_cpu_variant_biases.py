"""The CPU variant's fp16 biases (runtime/cpu_variant.py, fp16_biases_to_float): a conv whose bias is the output of a
DEQUANTIZE of an fp16 constant (the exporter's int8 'direct' text encoder: every linear layer) is left by XNNPACK to
TFLite's own kernels; the variant folds such biases into float32 constants so that XNNPACK takes the conv. Small graphs
built here: int8 direct filter, fp16 bias, one CONV_2D (and a DEQUANTIZE read by an ADD, which stays)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ai_edge_litert")

from ai_edge_litert import schema_py_generated as schema  # noqa: E402

N, CIN, COUT = 5, 16, 8


def _tensor(g, shape, ttype, name, buffer=0, quant=None):
    t = schema.TensorT()
    t.shape, t.type, t.name, t.buffer, t.quantization = list(shape), ttype, name, buffer, quant
    g.tensors.append(t)
    return len(g.tensors) - 1


def _op(m, g, builtin, version, inputs, outputs, options=None, options_type=0):
    codes = [(c.builtinCode, c.version) for c in m.operatorCodes]
    if (builtin, version) not in codes:
        oc = schema.OperatorCodeT()
        oc.builtinCode, oc.deprecatedBuiltinCode, oc.version = builtin, min(builtin, 127), version
        m.operatorCodes.append(oc)
        codes.append((builtin, version))
    op = schema.OperatorT()
    op.opcodeIndex, op.inputs, op.outputs = codes.index((builtin, version)), list(inputs), list(outputs)
    op.builtinOptionsType, op.builtinOptions = options_type, options
    g.operators.append(op)


def _buffer(m, data: np.ndarray) -> int:
    b = schema.BufferT()
    b.data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    m.buffers.append(b)
    return len(m.buffers) - 1


def conv_graph(rng, with_add: bool = False):
    """x [N,1,1,CIN] -> CONV_2D(int8 per-channel filter read directly, bias = DEQUANTIZE(fp16)) [-> ADD(DEQUANTIZE(fp16))]
    as .tflite bytes, with the float reference's filter and bias."""
    import flatbuffers

    codes = rng.integers(-127, 128, size=(COUT, 1, 1, CIN)).astype(np.int8)
    scale = (rng.random(COUT).astype(np.float32) + 0.5) / 127
    bias16 = rng.standard_normal(COUT).astype(np.float16)
    m = schema.ModelT()
    m.version, m.operatorCodes, m.buffers = 3, [], [schema.BufferT()]
    g = schema.SubGraphT()
    g.tensors, g.operators = [], []
    q = schema.QuantizationParametersT()
    q.scale, q.zeroPoint, q.quantizedDimension = scale.tolist(), [0] * COUT, 0
    x = _tensor(g, [N, 1, 1, CIN], schema.TensorType.FLOAT32, "x")
    w = _tensor(g, [COUT, 1, 1, CIN], schema.TensorType.INT8, "w", _buffer(m, codes), q)
    b16 = _tensor(g, [COUT], schema.TensorType.FLOAT16, "b16", _buffer(m, bias16))
    b = _tensor(g, [COUT], schema.TensorType.FLOAT32, "b")
    y = _tensor(g, [N, 1, 1, COUT], schema.TensorType.FLOAT32, "y")
    _op(m, g, schema.BuiltinOperator.DEQUANTIZE, 2, [b16], [b])
    opt = schema.Conv2DOptionsT()
    opt.padding, opt.strideW, opt.strideH, opt.dilationWFactor, opt.dilationHFactor = schema.Padding.VALID, 1, 1, 1, 1
    _op(m, g, schema.BuiltinOperator.CONV_2D, 1, [x, w, b], [y], opt, schema.BuiltinOptions.Conv2DOptions)
    out, shift = y, None
    if with_add:
        shift = rng.standard_normal(COUT).astype(np.float16)
        s16 = _tensor(g, [COUT], schema.TensorType.FLOAT16, "s16", _buffer(m, shift))
        s = _tensor(g, [COUT], schema.TensorType.FLOAT32, "s")
        out = _tensor(g, [N, 1, 1, COUT], schema.TensorType.FLOAT32, "z")
        _op(m, g, schema.BuiltinOperator.DEQUANTIZE, 2, [s16], [s])
        _op(m, g, schema.BuiltinOperator.ADD, 1, [y, s], [out], schema.AddOptionsT(), schema.BuiltinOptions.AddOptions)
    g.inputs, g.outputs = [x], [out]
    m.subgraphs = [g]
    fb = flatbuffers.Builder(1024)
    fb.Finish(m.Pack(fb), file_identifier=b"TFL3")
    weight = codes.astype(np.float32).reshape(COUT, CIN) * scale[:, None]
    return bytes(fb.Output()), weight, bias16.astype(np.float32), shift


def _run(path, x):
    """The output, and whether XNNPACK made it (a DELEGATE node of the interpreter's plan writes the graph output)."""
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=str(path), num_threads=1)
    it.allocate_tensors()
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    out = it.get_output_details()[0]["index"]
    by_xnnpack = any(o["op_name"] == "DELEGATE" and out in o["outputs"] for o in it._get_ops_details())
    return it.get_tensor(out), by_xnnpack


def _ops(path):
    from pocketdiff.runtime.tflite_file import TfliteModel

    m = TfliteModel(path)
    return [m.op_name(op) for op in m.graph.operators]


def test_the_fp16_bias_is_folded_and_xnnpack_takes_the_conv(tmp_path):
    from pocketdiff.runtime.cpu_variant import dequantize_int8_to_fp16, direct_int8_filters_to_float, fp16_variant
    from pocketdiff.runtime.tflite_file import TfliteModel

    rng = np.random.default_rng(0)
    raw, weight, bias, _ = conv_graph(rng)
    (tmp_path / "int8.tflite").write_bytes(raw)
    before = TfliteModel(raw)  # the variant without the bias folding (VARIANT_VERSION 1's graph)
    dequantize_int8_to_fp16(before)
    direct_int8_filters_to_float(before)
    before.save(tmp_path / "before.tflite")
    assert fp16_variant(tmp_path / "int8.tflite", tmp_path / "after.tflite") == 2  # the filter and the bias
    assert _ops(tmp_path / "after.tflite") == ["CONV_2D"]

    x = rng.standard_normal((N, 1, 1, CIN)).astype(np.float32)
    ref = (x.reshape(N, CIN) @ weight.T + bias).reshape(N, 1, 1, COUT)
    y_before, xnn_before = _run(tmp_path / "before.tflite", x)
    y_after, xnn_after = _run(tmp_path / "after.tflite", x)
    assert not xnn_before, "XNNPACK took the conv with a DEQUANTIZE'd fp16 bias: the folding may no longer be needed"
    assert xnn_after
    np.testing.assert_allclose(y_after, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y_after, y_before, rtol=1e-4, atol=1e-4)


def test_a_dequantize_read_by_another_op_stays(tmp_path):
    from pocketdiff.runtime.cpu_variant import direct_int8_filters_to_float, fp16_biases_to_float
    from pocketdiff.runtime.tflite_file import TfliteModel

    rng = np.random.default_rng(1)
    raw, weight, bias, shift = conv_graph(rng, with_add=True)
    m = TfliteModel(raw)
    assert fp16_biases_to_float(m) == 1  # the conv's bias only; the ADD's operand stays fp16 + DEQUANTIZE
    m.save(tmp_path / "v.tflite")
    assert _ops(tmp_path / "v.tflite") == ["CONV_2D", "DEQUANTIZE", "ADD"]
    b = next(t for t in TfliteModel(tmp_path / "v.tflite").graph.tensors if t.name.decode() == "b")
    assert b.type == schema.TensorType.FLOAT32 and b.buffer > 0

    x = rng.standard_normal((N, 1, 1, CIN)).astype(np.float32)
    m2 = TfliteModel(tmp_path / "v.tflite")  # the filter as float (codes x scale), as fp16_variant writes it
    direct_int8_filters_to_float(m2)
    m2.save(tmp_path / "v2.tflite")
    y, _ = _run(tmp_path / "v2.tflite", x)
    ref = (x.reshape(N, CIN) @ weight.T + bias + shift.astype(np.float32)).reshape(N, 1, 1, COUT)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
