"""The converter's weight-storage rewrites of a .tflite, on the runtime's reader.

`TfliteWeightRewriter` is a `pocketdiff.runtime.tflite_file.TfliteModel` that can also
- `store_weights_fp16`: fp32 constants -> fp16 + DEQUANTIZE (TFLite's float16 weight format);
- `store_int8`: a float constant -> given int8 codes + per-channel scales + DEQUANTIZE. The
  int8 codes are written as given, so the file carries a quantizer's codes bit for bit.
Reading, inspecting and `save` are the runtime's (one reader for the converter and the runner).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Union

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.tflite_file import TfliteModel

WEIGHT_CONSUMERS = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "TRANSPOSE_CONV", "BATCH_MATMUL", "CONV_3D")


class TfliteWeightRewriter(TfliteModel):
    """A .tflite whose float weights can be stored as fp16 or int8 (edits between begin_edit / end_edit)."""

    def __init__(self, source: Union[str, Path, bytes]):
        super().__init__(source)
        self._pending_ops: list = []

    def _insert_dequantize(self, float_tensor: int, stored: np.ndarray, tensor_type: int, quant=None, version: int = 1) -> int:
        """Make `float_tensor` the output of DEQUANTIZE(new constant tensor holding `stored`)."""
        g = self.graph
        t = g.tensors[float_tensor]
        new = schema.TensorT()
        new.shape = list(t.shape)
        new.type = tensor_type
        new.buffer = self._new_buffer(stored)
        base = t.name.decode(errors="replace") if isinstance(t.name, bytes) else str(t.name)
        new.name = (base + ("_int8" if tensor_type == schema.TensorType.INT8 else "_fp16")).encode()
        new.quantization = quant
        new.hasRank = True
        g.tensors.append(new)
        new_index = len(g.tensors) - 1
        empty = schema.BufferT()
        self.model.buffers.append(empty)
        t.buffer = len(self.model.buffers) - 1  # the float tensor becomes an activation
        op = schema.OperatorT()
        op.opcodeIndex = self._opcode_index(schema.BuiltinOperator.DEQUANTIZE, version)
        op.inputs = [new_index]
        op.outputs = [float_tensor]
        op.builtinOptionsType = 0
        self._pending_ops.append(op)
        return new_index

    def begin_edit(self) -> None:
        self._pending_ops = []
        self._producers = None
        self._consumers = None

    def end_edit(self) -> None:
        g = self.graph
        g.operators = list(self._pending_ops) + list(g.operators)  # constants first: still topological
        self._pending_ops = []
        self._producers = None
        self._consumers = None

    def weight_tensors(self, consumers: Iterable[str] = WEIGHT_CONSUMERS, min_elements: int = 0) -> list[int]:
        """Float32 constants feeding the given op types (their weight operands)."""
        wanted = set(consumers)
        found = []
        seen = set()
        for op in self.graph.operators:
            name = self.op_name(op)
            if name not in wanted:
                continue
            for pos, t in enumerate(op.inputs):
                if t < 0 or t in seen or pos == 0 and name != "BATCH_MATMUL":
                    continue
                tensor = self.graph.tensors[t]
                if tensor.type != schema.TensorType.FLOAT32 or not self.is_constant(t):
                    continue
                n = int(np.prod([int(s) for s in tensor.shape])) if len(tensor.shape) else 1
                if n >= min_elements:
                    seen.add(t)
                    found.append(int(t))
        return found

    def store_weights_fp16(self, min_elements: int = 1, all_large_constants: bool = False, exclude: Iterable[int] = ()) -> int:
        """fp32 constants -> fp16 storage + DEQUANTIZE (TFLite's float16 weight format).

        Converts the weight operands of conv / FC / matmul ops, and with `all_large_constants`
        every other fp32 constant of at least 1024 elements. Returns how many were converted.
        """
        skip = set(int(i) for i in exclude)
        targets = [t for t in self.weight_tensors(min_elements=min_elements) if t not in skip]
        if all_large_constants:
            have = set(targets) | skip
            cons = self.consumers()
            for i, t in enumerate(self.graph.tensors):
                if i in have or t.type != schema.TensorType.FLOAT32 or not cons.get(i):
                    continue
                if int(np.prod([int(s) for s in t.shape])) >= 1024 and self.is_constant(i):
                    targets.append(i)
        self.begin_edit()
        for i in targets:
            data = self.tensor_data(i)
            self._insert_dequantize(i, data.astype(np.float16), schema.TensorType.FLOAT16, version=3)
        self.end_edit()
        return len(targets)

    def store_int8(self, tensor_index: int, codes: np.ndarray, scale: np.ndarray, axis: int = 0) -> int:
        """Replace float constant `tensor_index` by int8 `codes` (same shape) with symmetric
        per-channel `scale` along `axis`, dequantized in the graph. Call inside begin/end_edit."""
        t = self.graph.tensors[tensor_index]
        shape = [int(s) for s in t.shape]
        codes = np.asarray(codes)
        if codes.dtype != np.int8 or list(codes.shape) != shape:
            raise PocketdiffError(f"int8 codes for {self.tensor_name(tensor_index)}: got {codes.dtype}{list(codes.shape)}, tensor is {shape}")
        scale = np.asarray(scale, dtype=np.float32).reshape(-1)
        if scale.size != shape[axis]:
            raise PocketdiffError(f"int8 scales for {self.tensor_name(tensor_index)}: {scale.size} values for {shape[axis]} channels")
        q = schema.QuantizationParametersT()
        q.scale = [float(s) for s in scale]
        q.zeroPoint = [0] * scale.size
        q.quantizedDimension = int(axis)
        return self._insert_dequantize(tensor_index, codes, schema.TensorType.INT8, quant=q, version=2)
