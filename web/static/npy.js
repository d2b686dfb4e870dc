// Readers for the bundle's numpy files: .npy (time-embedding table) and the uncompressed
// .npz archives np.savez writes (golden vectors). Little-endian C-order arrays only.

const DTYPES = {
  '<f4': [Float32Array, 4], '<f8': [Float64Array, 8], '<i4': [Int32Array, 4], '<i8': [BigInt64Array, 8],
  '|u1': [Uint8Array, 1], '|i1': [Int8Array, 1], '<f2': [Uint16Array, 2],
};

/** An IEEE half's bits as a number (also lora.js's F16 factors). */
export function halfToFloat(h) {
  const s = h & 0x8000 ? -1 : 1;
  const e = (h >> 10) & 0x1f;
  const f = h & 0x3ff;
  if (e === 0) return s * f * 2 ** -24;
  if (e === 31) return f ? NaN : s * Infinity;
  return s * (1 + f / 1024) * 2 ** (e - 15);
}

/** {data: TypedArray (float64/int64 narrowed to float32/int32), shape: number[], dtype} */
export function parseNpy(buf, what = 'npy') {
  const u8 = new Uint8Array(buf);
  if (u8[0] !== 0x93 || String.fromCharCode(...u8.slice(1, 6)) !== 'NUMPY') throw new Error(`${what}: not a .npy file`);
  const major = u8[6];
  const dv = new DataView(buf instanceof ArrayBuffer ? buf : u8.buffer, u8.byteOffset);
  const hlen = major === 1 ? dv.getUint16(8, true) : dv.getUint32(8, true);
  const hstart = major === 1 ? 10 : 12;
  const header = new TextDecoder('latin1').decode(u8.slice(hstart, hstart + hlen));
  const descr = /'descr':\s*'([^']+)'/.exec(header)?.[1];
  if (/'fortran_order':\s*True/.test(header)) throw new Error(`${what}: Fortran-order arrays are not supported`);
  const shapeText = /'shape':\s*\(([^)]*)\)/.exec(header)?.[1] ?? '';
  const shape = shapeText.split(',').map((s) => s.trim()).filter((s) => s).map(Number);
  if (!(descr in DTYPES)) throw new Error(`${what}: dtype ${descr} is not supported`);
  const [Ctor, size] = DTYPES[descr];
  const n = shape.reduce((a, b) => a * b, 1);
  const start = hstart + hlen;
  const bytes = u8.slice(start, start + n * size); // copy: aligned
  if (bytes.length !== n * size) throw new Error(`${what}: truncated (${bytes.length} of ${n * size} bytes)`);
  let data = new Ctor(bytes.buffer);
  if (Ctor === Float64Array) data = Float32Array.from(data);
  if (Ctor === BigInt64Array) data = Int32Array.from(data, (v) => Number(v));
  if (descr === '<f2') data = Float32Array.from(data, halfToFloat);
  return { data, shape, dtype: descr };
}

/** name (without .npy) -> parsed array, read through the zip central directory. */
export function parseNpz(buf, what = 'npz') {
  const u8 = new Uint8Array(buf);
  const dv = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  let eocd = -1;
  for (let i = u8.length - 22; i >= Math.max(0, u8.length - 65557); i--) {
    if (dv.getUint32(i, true) === 0x06054b50) { eocd = i; break; }
  }
  if (eocd < 0) throw new Error(`${what}: not a zip archive`);
  let count = dv.getUint16(eocd + 10, true);
  let cdOffset = dv.getUint32(eocd + 16, true);
  if (cdOffset === 0xffffffff || count === 0xffff) { // zip64 end record
    const loc = eocd - 20;
    if (dv.getUint32(loc, true) !== 0x07064b50) throw new Error(`${what}: broken zip64 locator`);
    const rec = Number(dv.getBigUint64(loc + 8, true));
    count = Number(dv.getBigUint64(rec + 32, true));
    cdOffset = Number(dv.getBigUint64(rec + 48, true));
  }
  const out = {};
  let p = cdOffset;
  const dec = new TextDecoder();
  for (let k = 0; k < count; k++) {
    if (dv.getUint32(p, true) !== 0x02014b50) throw new Error(`${what}: broken central directory`);
    const method = dv.getUint16(p + 10, true);
    let csize = dv.getUint32(p + 20, true);
    let usize = dv.getUint32(p + 24, true);
    const nlen = dv.getUint16(p + 28, true);
    const elen = dv.getUint16(p + 30, true);
    const clen = dv.getUint16(p + 32, true);
    let local = dv.getUint32(p + 42, true);
    const name = dec.decode(u8.slice(p + 46, p + 46 + nlen));
    let e = p + 46 + nlen;
    const eend = e + elen;
    while (e + 4 <= eend) { // zip64 extra: the 0xffffffff fields, in order
      const id = dv.getUint16(e, true);
      const sz = dv.getUint16(e + 2, true);
      if (id === 0x0001) {
        let q = e + 4;
        if (usize === 0xffffffff) { usize = Number(dv.getBigUint64(q, true)); q += 8; }
        if (csize === 0xffffffff) { csize = Number(dv.getBigUint64(q, true)); q += 8; }
        if (local === 0xffffffff) { local = Number(dv.getBigUint64(q, true)); q += 8; }
      }
      e += 4 + sz;
    }
    if (method !== 0) throw new Error(`${what}: ${name} is compressed (method ${method}); export writes np.savez (stored)`);
    const lnlen = dv.getUint16(local + 26, true);
    const lelen = dv.getUint16(local + 28, true);
    const start = local + 30 + lnlen + lelen;
    const key = name.endsWith('.npy') ? name.slice(0, -4) : name;
    out[key] = parseNpy(u8.slice(start, start + csize).buffer, `${what}:${name}`);
    p += 46 + nlen + elen + clen;
  }
  return out;
}
