"""Read and inspect .tflite flatbuffers (the LiteRT schema from ai_edge_litert); write one back.

- `check_tflite_file`, `sha256_file`: is a bundle's file complete, and is it the one the
  manifest names.
- `TfliteModel`: op histogram, tensors and constant data (inline buffers, and the
  offset/size buffers that models over 2 GB keep after the flatbuffer), op -> torch module
  locations, the largest activation, tensors above rank 4, int8 weights.
- `save`: packs the model again; buffers are 64-byte aligned, inline below ~1.8 GB of
  constants, else after the flatbuffer with offset/size (the >2 GB convention). The runtime
  writes one file itself: the CPU's fp16-storage variant of an int8 file (cpu_variant.py).

The converter's weight-storage rewrites (fp16 / int8 + DEQUANTIZE) build on this class in
pocketdiff.export.tflite_file.
"""
from __future__ import annotations

import collections
import mmap
from pathlib import Path
from typing import Optional, Union

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

from pocketdiff.errors import PocketdiffError
from pocketdiff.outputs import sha256_file  # noqa: F401  (the core's; bundle checks import it from here)

OP_NAMES = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
TYPE_NAMES = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
NP_TYPES = {
    schema.TensorType.FLOAT32: np.float32,
    schema.TensorType.FLOAT16: np.float16,
    schema.TensorType.INT32: np.int32,
    schema.TensorType.INT64: np.int64,
    schema.TensorType.INT8: np.int8,
    schema.TensorType.UINT8: np.uint8,
    schema.TensorType.INT16: np.int16,
    schema.TensorType.BOOL: np.bool_,
}
ALIGN = 64
INLINE_LIMIT = 1_800_000_000
TFLITE_IDENTIFIER = b"TFL3"


def check_tflite_file(path: Union[str, Path]) -> None:
    """Raise PocketdiffError when `path` is not a complete .tflite (truncated, corrupted)."""
    path = Path(path)
    size = path.stat().st_size
    if size < 16:
        raise PocketdiffError(f"{path}: truncated .tflite ({size} bytes)")
    with open(path, "rb") as f:
        head = f.read(8)
        if head[4:8] != TFLITE_IDENTIFIER:
            raise PocketdiffError(f"{path}: not a .tflite file (no TFL3 identifier)")
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as raw:
                _check_structure(raw, path)
        except PocketdiffError:
            raise
        except Exception as e:  # flatbuffers raises plain errors on garbage offsets
            raise PocketdiffError(f"{path}: truncated or corrupted .tflite ({type(e).__name__}: {e})") from None


def _check_structure(raw, path: Path) -> None:
    """Structural checks (tensor and buffer indices in range, buffer data inside the file), read through the
    flatbuffer's accessors: no object tree of the whole model (run-bundle's start-up: an SD-2.1 bundle's
    files ~2.4 s with the object tree, the same checks in a fraction)."""
    model = schema.Model.GetRootAsModel(raw, 0)
    g = model.Subgraphs(0)
    nt, nb = g.TensorsLength(), model.BuffersLength()
    for i in range(g.OperatorsLength()):
        op = g.Operators(i)
        for ids in (op.InputsAsNumpy(), op.OutputsAsNumpy()):  # 0 when the vector is absent
            if isinstance(ids, np.ndarray) and ids.size and int(ids.max()) >= nt:
                raise PocketdiffError(f"{path}: corrupted .tflite (tensor index {int(ids.max())} out of range)")
    for i in range(nt):
        if g.Tensors(i).Buffer() >= nb:
            raise PocketdiffError(f"{path}: corrupted .tflite (buffer index {g.Tensors(i).Buffer()} out of range)")
    for i in range(model.OperatorCodesLength()):  # small tables, written last by the converter: a cut file ends in them
        oc = model.OperatorCodes(i)
        oc.BuiltinCode(), oc.DeprecatedBuiltinCode(), oc.Version(), oc.CustomCode()
    for i in range(model.SignatureDefsLength()):
        sig = model.SignatureDefs(i)
        for t in [sig.Inputs(j) for j in range(sig.InputsLength())] + [sig.Outputs(j) for j in range(sig.OutputsLength())]:
            t.Name(), t.TensorIndex()
    for i in range(model.MetadataLength()):
        model.Metadata(i).Name(), model.Metadata(i).Buffer()
    size = len(raw)
    for i in range(nb):
        b = model.Buffers(i)
        offset, n = b.Offset(), b.Size()
        if offset > 1 and offset + n > size:
            raise PocketdiffError(f"{path}: truncated .tflite (a weight buffer ends at {offset + n}, file has {size} bytes)")
        if b.DataLength():
            b.DataAsNumpy()  # inline data: a view of the file, refused when it runs past the end


class TfliteModel:
    """A .tflite held as the schema's object API (`self.model`, a ModelT)."""

    def __init__(self, source: Union[str, Path, bytes]):
        if isinstance(source, (str, Path)):
            self.path: Optional[Path] = Path(source)
            f = open(self.path, "rb")
            try:
                self._raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            finally:
                f.close()
        else:
            self.path = None
            self._raw = source
        if len(self._raw) < 8 or bytes(self._raw[4:8]) != TFLITE_IDENTIFIER:
            raise PocketdiffError(f"{self.path or 'buffer'}: not a .tflite flatbuffer")
        self.model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(self._raw, 0))
        self._producers: Optional[dict[int, int]] = None
        self._consumers: Optional[dict[int, list[int]]] = None

    # ---------------------------------------------------------------- structure
    @property
    def graph(self):
        return self.model.subgraphs[0]

    def op_name(self, op) -> str:
        oc = self.model.operatorCodes[op.opcodeIndex]
        code = max(int(oc.builtinCode), int(oc.deprecatedBuiltinCode))
        if code == schema.BuiltinOperator.CUSTOM:
            return f"CUSTOM:{oc.customCode.decode() if isinstance(oc.customCode, bytes) else oc.customCode}"
        return OP_NAMES.get(code, str(code))

    def op_histogram(self) -> dict[str, int]:
        counts = collections.Counter(self.op_name(op) for sg in self.model.subgraphs for op in (sg.operators or []))
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def tensor_name(self, index: int) -> str:
        name = self.graph.tensors[index].name
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def producers(self) -> dict[int, int]:
        if self._producers is None:
            self._producers = {o: i for i, op in enumerate(self.graph.operators) for o in op.outputs}
        return self._producers

    def consumers(self) -> dict[int, list[int]]:
        if self._consumers is None:
            cons: dict[int, list[int]] = collections.defaultdict(list)
            for i, op in enumerate(self.graph.operators):
                for t in op.inputs:
                    if t >= 0:
                        cons[int(t)].append(i)
            self._consumers = cons
        return self._consumers

    # ---------------------------------------------------------------- data
    def buffer_bytes(self, buffer_index: int) -> Optional[np.ndarray]:
        b = self.model.buffers[buffer_index]
        if b.data is not None and len(b.data):
            return np.asarray(b.data, dtype=np.uint8)
        if b.offset > 1 and b.size > 0:
            return np.frombuffer(self._raw, dtype=np.uint8, count=int(b.size), offset=int(b.offset))
        return None

    def tensor_data(self, index: int) -> Optional[np.ndarray]:
        t = self.graph.tensors[index]
        raw = self.buffer_bytes(t.buffer)
        if raw is None:
            return None
        dtype = NP_TYPES.get(t.type)
        if dtype is None:
            return None
        shape = [int(s) for s in (t.shape if t.shape is not None else [])]
        return raw.view(dtype).reshape(shape)

    def is_constant(self, index: int) -> bool:
        return self.buffer_bytes(self.graph.tensors[index].buffer) is not None

    # ---------------------------------------------------------------- analysis
    def op_locations(self, op_type: str, limit: int = 20) -> list[str]:
        """Output tensor names (the converter's torch module stacks) of ops of `op_type`."""
        out = []
        for op in self.graph.operators:
            if self.op_name(op) == op_type and op.outputs is not None and len(op.outputs):
                out.append(self.tensor_name(op.outputs[0]))
                if len(out) >= limit:
                    break
        return out

    def max_rank(self) -> int:
        return max((len(t.shape) for t in self.graph.tensors if t.shape is not None), default=0)

    def high_rank_ops(self, limit: int = 20) -> list[str]:
        out = []
        for op in self.graph.operators:
            if any(t >= 0 and self.graph.tensors[t].shape is not None and len(self.graph.tensors[t].shape) > 4 for t in list(op.inputs) + list(op.outputs)):
                out.append(f"{self.op_name(op)} @ {self.tensor_name(op.outputs[0])}")
                if len(out) >= limit:
                    break
        return out

    def largest_activation(self) -> tuple[int, str]:
        """(elements, tensor name) of the largest non-constant tensor."""
        best = (0, "")
        for i, t in enumerate(self.graph.tensors):
            if t.shape is None or self.is_constant(i):
                continue
            n = int(np.prod([int(s) for s in t.shape])) if len(t.shape) else 1
            if n > best[0]:
                best = (n, self.tensor_name(i))
        return best

    def constant_bytes(self) -> int:
        total = 0
        for i in range(len(self.model.buffers)):
            raw = self.buffer_bytes(i)
            total += 0 if raw is None else int(raw.size)
        return total

    def int8_weights(self) -> dict[str, dict]:
        """Every INT8 constant: tensor name -> {codes, scale, zero_point, axis, consumer}."""
        out = {}
        cons = self.consumers()
        for i, t in enumerate(self.graph.tensors):
            if t.type != schema.TensorType.INT8:
                continue
            data = self.tensor_data(i)
            if data is None:
                continue
            q = t.quantization
            consumer = ""
            if cons.get(i):
                consumer = self.op_name(self.graph.operators[cons[i][0]])
            out[self.tensor_name(i)] = {
                "codes": np.array(data),
                "scale": np.asarray(q.scale if q is not None and q.scale is not None else [], dtype=np.float32),
                "zero_point": np.asarray(q.zeroPoint if q is not None and q.zeroPoint is not None else [], dtype=np.int64),
                "axis": int(q.quantizedDimension) if q is not None else 0,
                "consumer": consumer,
            }
        return out

    # ---------------------------------------------------------------- rewriting
    def _opcode_index(self, builtin: int, version: int) -> int:
        for i, oc in enumerate(self.model.operatorCodes):
            if max(int(oc.builtinCode), int(oc.deprecatedBuiltinCode)) == builtin and oc.version == version:
                return i
        oc = schema.OperatorCodeT()
        oc.builtinCode = builtin
        oc.deprecatedBuiltinCode = min(builtin, 127)
        oc.version = version
        self.model.operatorCodes.append(oc)
        return len(self.model.operatorCodes) - 1

    def _new_buffer(self, data: np.ndarray) -> int:
        b = schema.BufferT()
        b.data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self.model.buffers.append(b)
        return len(self.model.buffers) - 1

    def remove_operators(self, indices) -> None:
        """Drop the graph's operators at `indices` (their outputs now read as constants or not at all); the producer /
        consumer maps are rebuilt on next use."""
        drop = set(indices)
        self.graph.operators = [op for k, op in enumerate(self.graph.operators) if k not in drop]
        self._producers = self._consumers = None

    # ---------------------------------------------------------------- writing
    def save(self, path: Union[str, Path], external: Optional[bool] = None) -> Path:
        """Pack and write atomically. `external`: keep weights after the flatbuffer (offset/size)."""
        path = Path(path)
        used = {int(t.buffer) for sg in self.model.subgraphs for t in sg.tensors}
        used |= {int(md.buffer) for md in (self.model.metadata or [])}
        # orphaned buffers (weights replaced by int8/fp16 copies) are written empty
        datas: list[Optional[np.ndarray]] = [
            self.buffer_bytes(i) if i in used else None for i in range(len(self.model.buffers))
        ]
        total = sum(0 if d is None else int(d.size) for d in datas)
        if external is None:
            external = total > INLINE_LIMIT
        buffers = self.model.buffers
        packed_bufs = []
        for d in datas:
            b = _AlignedBufferT()
            if d is not None and d.size:
                if external:
                    b.offset, b.size = 1, 1  # placeholders; fixed-width fields keep the layout
                    b.payload = d
                else:
                    b.data = d
            packed_bufs.append(b)
        self.model.buffers = packed_bufs
        try:
            head = _pack(self.model, 1024 + (0 if external else total + ALIGN * len(datas)))
            if external:
                offset = _align(len(head))
                for b in packed_bufs:
                    if b.payload is not None:
                        b.offset, b.size = offset, int(b.payload.size)
                        offset = _align(offset + int(b.payload.size))
                head2 = _pack(self.model, 1024)
                if len(head2) != len(head):
                    raise PocketdiffError("internal error: flatbuffer size changed between passes")
                head = head2
            tmp = path.with_name(f".{path.name}.tmp")
            with open(tmp, "wb") as f:
                f.write(head)
                if external:
                    pos = len(head)
                    for b in packed_bufs:
                        if b.payload is None:
                            continue
                        f.write(b"\0" * (b.offset - pos))
                        f.write(memoryview(np.ascontiguousarray(b.payload)))
                        pos = b.offset + int(b.payload.size)
                    # the runtime maps whole pages; pad the tail to the alignment
                    f.write(b"\0" * (_align(pos) - pos))
            tmp.replace(path)
        finally:
            self.model.buffers = buffers
        return path


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _AlignedBufferT(schema.BufferT):
    """BufferT whose data vector starts on an ALIGN-byte boundary (as TFLite's own writer does)."""

    def __init__(self):
        super().__init__()
        self.payload: Optional[np.ndarray] = None

    def Pack(self, builder):
        data = None
        if self.data is not None:
            raw = np.ascontiguousarray(self.data).reshape(-1).view(np.uint8)
            builder.StartVector(1, raw.size, ALIGN)
            builder.head = builder.head - raw.size
            builder.Bytes[builder.head : builder.head + raw.size] = memoryview(raw)
            builder.vectorNumElems = raw.size
            data = builder.EndVector()
        schema.BufferStart(builder)
        if data is not None:
            schema.BufferAddData(builder, data)
        if self.offset:
            builder.PrependUint64Slot(1, int(self.offset), 0)
        if self.size:
            builder.PrependUint64Slot(2, int(self.size), 0)
        return schema.BufferEnd(builder)


def _pack(model, size_hint: int) -> bytes:
    builder = flatbuffers.Builder(max(1024, min(size_hint, 2**31 - 1)))
    root = model.Pack(builder)
    builder.Finish(root, file_identifier=TFLITE_IDENTIFIER)
    return bytes(builder.Output())
