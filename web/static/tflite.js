// What a .tflite file asks of the machine that loads it, read from its flatbuffer (TFLite schema: Model.subgraphs
// (field 2), Model.buffers (4); SubGraph.tensors (0); Tensor.shape (0), type (1), buffer (2), name (3),
// external_buffer (10); Buffer.data (0), offset (1), size (2)) without LiteRT: each tensor's element count, the
// constant ones (a buffer with data) and the largest tensor as the WebGPU delegate holds it (fp16 by default), so a
// bundle that cannot fit an adapter's limits is refused before anything compiles (limits.js).

const TYPE_BYTES = { 0: 4, 1: 2, 2: 4, 3: 1, 4: 8, 6: 1, 7: 2, 9: 1, 10: 8, 12: 8, 15: 4, 16: 2, 17: 0.5, 18: 2 };

class Table {
  constructor(view, pos) {
    this.view = view;
    this.pos = pos;
    const vt = pos - view.getInt32(pos, true);
    this.vt = vt;
    this.vtLen = view.getUint16(vt, true);
  }

  field(id) { // the field's absolute position, or 0 when absent
    const o = 4 + 2 * id;
    if (o >= this.vtLen) return 0;
    const rel = this.view.getUint16(this.vt + o, true);
    return rel ? this.pos + rel : 0;
  }

  ref(id) { // position of the table / vector / string a field points to, or 0
    const p = this.field(id);
    return p ? p + this.view.getUint32(p, true) : 0;
  }

  u32(id, dflt = 0) { const p = this.field(id); return p ? this.view.getUint32(p, true) : dflt; }
  i8(id, dflt = 0) { const p = this.field(id); return p ? this.view.getInt8(p) : dflt; }
  u64(id) { const p = this.field(id); return p ? Number(this.view.getBigUint64(p, true)) : 0; }

  vectorLength(id) { const p = this.ref(id); return p ? this.view.getUint32(p, true) : 0; }

  tables(id) {
    const p = this.ref(id);
    if (!p) return [];
    const n = this.view.getUint32(p, true);
    return Array.from({ length: n }, (_, i) => { const e = p + 4 + 4 * i; return new Table(this.view, e + this.view.getUint32(e, true)); });
  }

  ints(id) {
    const p = this.ref(id);
    if (!p) return [];
    return Array.from({ length: this.view.getUint32(p, true) }, (_, i) => this.view.getInt32(p + 4 + 4 * i, true));
  }

  string(id) {
    const p = this.ref(id);
    return p ? new TextDecoder().decode(new Uint8Array(this.view.buffer, this.view.byteOffset + p + 4, this.view.getUint32(p, true))) : '';
  }
}

/** The sizes of a .tflite file's tensors (`bytes`: ArrayBuffer or Uint8Array; `gpuBytesPerElement`: how the WebGPU
 *  delegate stores floats, 2 at its default fp16):
 *  {tensors, weightElements: elements of the constant tensors, weightFileBytes: their bytes in the file,
 *   largest: {name, subgraph, elements, gpuBytes, constant} (the tensor with the most elements; a rank-4 tensor's
 *   channels padded to 4, as the delegate's layout does), external: tensors whose data lies in an external buffer}.
 *  Throws an Error naming what is wrong when the bytes are not a TFLite flatbuffer. */
export function tfliteSizes(bytes, gpuBytesPerElement = 2) {
  const u8 = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  if (u8.byteLength < 8 || new TextDecoder().decode(u8.subarray(4, 8)) !== 'TFL3') throw new Error('not a TFLite flatbuffer (no TFL3 identifier)');
  const view = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  const model = new Table(view, view.getUint32(0, true));
  const buffers = model.tables(4).map((b) => ({ data: b.vectorLength(0), size: b.u64(2) }));
  const out = { tensors: 0, weightElements: 0, weightFileBytes: 0, largest: null, external: 0 };
  model.tables(2).forEach((sg, s) => {
    for (const t of sg.tables(0)) {
      const shape = t.ints(0);
      const elements = shape.reduce((a, d) => a * Math.max(d, 1), 1);
      const buf = buffers[t.u32(2)];
      const fileBytes = buf ? buf.data || buf.size : 0;
      const external = t.u32(10) > 0; // Tensor.external_buffer (uint): an id in Model.external_buffers, 0 for none
      const constant = fileBytes > 0 || external;
      out.tensors += 1;
      if (external) out.external += 1;
      if (constant) {
        out.weightElements += elements;
        out.weightFileBytes += fileBytes;
      }
      const padded = shape.length === 4 ? elements / Math.max(shape[3], 1) * Math.ceil(Math.max(shape[3], 1) / 4) * 4 : elements;
      // floats, and quantized constants (dequantized for the GPU), at the delegate's float width
      const asFloat = [0, 1, 10, 18].includes(t.i8(1)) || (constant && [3, 7, 9, 17].includes(t.i8(1)));
      const gpuBytes = padded * (asFloat ? gpuBytesPerElement : TYPE_BYTES[t.i8(1)] ?? 4);
      if (!out.largest || gpuBytes > out.largest.gpuBytes) out.largest = { name: t.string(3), subgraph: s, shape, elements, gpuBytes, constant };
    }
  });
  return out;
}
