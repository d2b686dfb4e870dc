// A small PNG reader for the user's picture and mask (image_input.js): 8-bit and lower bit depths, every colour type,
// not interlaced; the page and the Node runner both read a PNG through it, so their pixels are the file's own bytes
// (a browser's canvas may colour-manage or premultiply them) and equal to what PIL reads for run-bundle. The inflate
// is given: the page's DecompressionStream, Node's zlib (node_runner.mjs). Plain module (no DOM, no LiteRT).
import { BundleError } from './stages.js';

const SIGNATURE = [137, 80, 78, 71, 13, 10, 26, 10];
const CHANNELS = { 0: 1, 2: 3, 3: 1, 4: 2, 6: 4 }; // colour type -> samples per pixel

/** Whether `bytes` (Uint8Array) start like a PNG file. */
export function isPng(bytes) {
  return bytes.length >= 8 && SIGNATURE.every((b, i) => bytes[i] === b);
}

/** The chunks of a PNG: {ihdr, palette, data: [IDAT payloads]}; `what` names the file in errors. */
function readChunks(bytes, what) {
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = { ihdr: null, palette: null, data: [] };
  let p = 8;
  while (p + 12 <= bytes.length) {
    const len = dv.getUint32(p), type = String.fromCharCode(...bytes.subarray(p + 4, p + 8));
    const body = bytes.subarray(p + 8, p + 8 + len);
    if (body.length !== len) throw new BundleError(`${what}: a truncated PNG (chunk ${type})`);
    if (type === 'IHDR') out.ihdr = body;
    else if (type === 'PLTE') out.palette = body;
    else if (type === 'IDAT') out.data.push(body);
    else if (type === 'IEND') return out;
    p += 12 + len;
  }
  throw new BundleError(`${what}: a truncated PNG (no IEND chunk)`);
}

/** The header's fields, refused in one line where this reader cannot read them. */
function header(ihdr, what) {
  if (!ihdr || ihdr.length !== 13) throw new BundleError(`${what}: not a PNG this page reads (no IHDR chunk)`);
  const dv = new DataView(ihdr.buffer, ihdr.byteOffset, 13);
  const h = { width: dv.getUint32(0), height: dv.getUint32(4), depth: ihdr[8], colour: ihdr[9], interlace: ihdr[12] };
  if (!(h.colour in CHANNELS) || ![1, 2, 4, 8, 16].includes(h.depth)) throw new BundleError(`${what}: PNG colour type ${h.colour} at ${h.depth} bits is not a valid PNG`);
  if (h.depth === 16) throw new BundleError(`${what}: a 16-bit PNG; save it with 8 bits per channel`);
  if (h.interlace) throw new BundleError(`${what}: an interlaced PNG; save it without interlacing`);
  if (!h.width || !h.height) throw new BundleError(`${what}: a PNG of ${h.width}x${h.height} px`);
  return h;
}

function paeth(a, b, c) {
  const p = a + b - c, pa = Math.abs(p - a), pb = Math.abs(p - b), pc = Math.abs(p - c);
  return pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
}

/** The filtered scanlines undone in place: rows of `stride` bytes, `bpp` bytes per pixel (at least 1). */
function unfilter(raw, height, stride, bpp, what) {
  const out = new Uint8Array(height * stride);
  for (let y = 0; y < height; y++) {
    const f = raw[y * (stride + 1)], src = y * (stride + 1) + 1, row = y * stride, up = row - stride;
    for (let i = 0; i < stride; i++) {
      const a = i >= bpp ? out[row + i - bpp] : 0, b = y ? out[up + i] : 0, c = y && i >= bpp ? out[up + i - bpp] : 0;
      const v = raw[src + i];
      if (f === 0) out[row + i] = v;
      else if (f === 1) out[row + i] = v + a;
      else if (f === 2) out[row + i] = v + b;
      else if (f === 3) out[row + i] = v + ((a + b) >> 1);
      else if (f === 4) out[row + i] = v + paeth(a, b, c);
      else throw new BundleError(`${what}: PNG row ${y} has filter type ${f}`);
    }
  }
  return out;
}

/** Sample j of a row at `depth` bits, scaled to 8 bits (a palette index is left as it is). */
function sample(rows, row, j, depth, scale) {
  if (depth === 8) return rows[row + j];
  const perByte = 8 / depth, byte = rows[row + Math.floor(j / perByte)];
  const v = (byte >> (8 - depth * (1 + (j % perByte)))) & ((1 << depth) - 1);
  return scale ? Math.round((v * 255) / ((1 << depth) - 1)) : v;
}

/** A PNG (Uint8Array) -> {width, height, rgba: Uint8Array (alpha 255 where the file has none)}. `inflate(bytes)`:
 *  zlib's inflate (sync or async). */
export async function decodePng(bytes, inflate, what = 'image') {
  if (!isPng(bytes)) throw new BundleError(`${what}: not a PNG file`);
  const chunks = readChunks(bytes, what);
  const h = header(chunks.ihdr, what);
  const ch = CHANNELS[h.colour], stride = Math.ceil((h.width * ch * h.depth) / 8), bpp = Math.max(1, (ch * h.depth) >> 3);
  const joined = new Uint8Array(chunks.data.reduce((a, d) => a + d.length, 0));
  chunks.data.reduce((at, d) => (joined.set(d, at), at + d.length), 0);
  let raw;
  try {
    raw = new Uint8Array(await inflate(joined));
  } catch (e) {
    throw new BundleError(`${what}: its PNG data do not inflate (${e.message})`);
  }
  if (raw.length < h.height * (stride + 1)) throw new BundleError(`${what}: a truncated PNG (${raw.length} of ${h.height * (stride + 1)} bytes)`);
  const rows = unfilter(raw, h.height, stride, bpp, what);
  const rgba = new Uint8Array(h.width * h.height * 4);
  const pal = chunks.palette;
  if (h.colour === 3 && !pal) throw new BundleError(`${what}: a palette PNG without a PLTE chunk`);
  for (let y = 0; y < h.height; y++) {
    for (let x = 0; x < h.width; x++) {
      const o = (y * h.width + x) * 4, s = (k) => sample(rows, y * stride, x * ch + k, h.depth, h.colour !== 3);
      let px;
      if (h.colour === 0) px = [s(0), s(0), s(0), 255];
      else if (h.colour === 2) px = [s(0), s(1), s(2), 255];
      else if (h.colour === 3) { const i = s(0); px = [pal[3 * i] ?? 0, pal[3 * i + 1] ?? 0, pal[3 * i + 2] ?? 0, 255]; }
      else if (h.colour === 4) px = [s(0), s(0), s(0), s(1)];
      else px = [s(0), s(1), s(2), s(3)];
      rgba.set(px, o);
    }
  }
  return { width: h.width, height: h.height, rgba };
}
