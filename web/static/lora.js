// A user's LoRA fed to a bundle exported with LoRA slots (manifest `lora_slots`): the twin of runtime/lora_slots.py.
// The safetensors file is read here (its header JSON, then little-endian F32 / F16 / BF16 buffers); its keys by the
// rules of pocketdiff/lora_keys.py (diffusers / PEFT lora_A / lora_B, the older .lora.down / lora_linear_layer /
// processor spellings, kohya lora_down / lora_up / alpha); each slotted projection is fed down [in, rank] and up
// [rank, out] (scaled by scale * alpha / rank, alpha / sqrt(rank) for rsLoRA), zero-padded to the slots' rank; no
// LoRA is zeros. A file that does not fit the slots is refused in one line naming the first key at fault.

import { halfToFloat } from './npy.js';

export class LoraError extends Error {}

const ROLE_SUFFIXES = [
  ['.lora_down.weight', 'down'], ['.lora_up.weight', 'up'], ['.lora_A.weight', 'down'], ['.lora_B.weight', 'up'],
  ['.lora.down.weight', 'down'], ['.lora.up.weight', 'up'], ['.lora_linear_layer.down.weight', 'down'],
  ['.lora_linear_layer.up.weight', 'up'], ['_lora.down.weight', 'down'], ['_lora.up.weight', 'up'], ['.alpha', 'alpha'],
];

/** The slot's graph inputs of one UNet module (pocketdiff/lora_keys.py slot_input_names). */
export function slotInputNames(module) {
  const stem = `lora_${module.replaceAll('.', '_')}`;
  return [`${stem}_down`, `${stem}_up`];
}

/** name -> {data: Float32Array, shape} and the metadata of a safetensors file's bytes (LoraError when it is none). */
export function readSafetensors(bytes, where) {
  const u8 = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  if (u8.length < 10) throw new LoraError(`${where}: not a valid safetensors file (truncated)`);
  const view = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  const n = Number(view.getBigUint64(0, true));
  if (u8[0] === 0x80 || (u8[0] === 0x50 && u8[1] === 0x4b)) throw new LoraError(`${where}: a pickle / torch archive, not safetensors; it is never unpickled`);
  if (!(n >= 2 && 8 + n <= u8.length && u8[8] === 0x7b)) throw new LoraError(`${where}: not a valid safetensors file (corrupt or truncated header)`);
  let header;
  try { header = JSON.parse(new TextDecoder().decode(u8.subarray(8, 8 + n))); } catch { header = null; }
  if (!header || typeof header !== 'object') throw new LoraError(`${where}: not a valid safetensors file (corrupt header)`);
  const body = 8 + n, meta = header.__metadata__ || {}, tensors = {};
  for (const [name, info] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const [start, end] = info.data_offsets || [], shape = info.shape || [], count = shape.reduce((a, b) => a * b, 1);
    const size = { F32: 4, F16: 2, BF16: 2 }[info.dtype];
    if (!size) throw new LoraError(`${where}: tensor ${JSON.stringify(name)} is ${info.dtype}; a LoRA's factors are F32, F16 or BF16`);
    if (!(start >= 0 && end - start === count * size && body + end <= u8.length)) {
      throw new LoraError(`${where}: not a valid safetensors file (tensor ${JSON.stringify(name)}: its bytes are not in the file: truncated?)`);
    }
    const data = new Float32Array(count);
    for (let i = 0; i < count; i++) {
      const at = body + start + i * size;
      data[i] = info.dtype === 'F32' ? view.getFloat32(at, true)
        : info.dtype === 'F16' ? halfToFloat(view.getUint16(at, true)) : new Float32Array(new Uint32Array([view.getUint16(at, true) << 16]).buffer)[0];
    }
    tensors[name] = { data, shape };
  }
  if (!Object.keys(tensors).length) throw new LoraError(`${where}: holds no tensors (not a LoRA)`);
  return { tensors, meta };
}

function keyRole(k) {
  for (const [suffix, role] of ROLE_SUFFIXES) if (k.endsWith(suffix)) return [k.slice(0, -suffix.length), role];
  return [k, ''];
}

/** [component, module] a key's base names (kohya: underscores, resolved by the caller against the slots). */
function keyTarget(base, key, where) {
  for (const [prefix, comp] of [['lora_unet_', 'unet'], ['lora_te1_', 'text_encoder'], ['lora_te_', 'text_encoder']]) {
    if (base.startsWith(prefix)) return [comp, base.slice(prefix.length), true];
  }
  if (base.startsWith('lora_')) throw new LoraError(`${where}: key ${JSON.stringify(key)}: unknown kohya prefix (lora_unet_ / lora_te_ expected)`);
  let name = base.replace(/^base_model\.model\./, ''), comp = 'unet';
  for (const c of ['unet', 'text_encoder_2', 'text_encoder']) if (name.startsWith(`${c}.`)) { comp = c; name = name.slice(c.length + 1); break; }
  if (comp === 'unet' && name.startsWith('text_model.')) comp = 'text_encoder';
  name = name.replace(/\.processor\.(to_[qkv])$/, '.$1').replace(/\.processor\.to_out$/, '.to_out.0');
  return [comp, name, false];
}

function metadataAlpha(meta, module, rank) {
  let fields = {};
  try { fields = meta.lora_adapter_metadata ? JSON.parse(meta.lora_adapter_metadata) : {}; } catch { fields = {}; }
  const patterns = fields['unet.alpha_pattern'] || {};
  for (const [p, v] of Object.entries(patterns)) if (new RegExp(`^(.*\\.)?(${p})$`).test(module)) return { alpha: Number(v), rs: !!fields['unet.use_rslora'] };
  return { alpha: Number(fields['unet.lora_alpha'] ?? rank), rs: !!fields['unet.use_rslora'] };
}

/** The slots of a manifest: {rank, shapes: module -> [in, out]} (null: the bundle has none). */
export function loraSlots(man) {
  const block = man.lora_slots;
  if (!block || typeof block !== 'object') return null;
  const declared = {};
  for (const e of Object.values(man.components || {})) for (const i of e.inputs || []) declared[i.name] = i.shape;
  const shapes = {};
  for (const m of block.targets) { // a chunked UNet: each chunk declares its slots' inputs (runtime/BUNDLE.md)
    const [d, u] = slotInputNames(m);
    if (!declared[d] || !declared[u]) throw new LoraError(`manifest: lora_slots names ${m}, whose inputs ${d} / ${u} no component declares`);
    shapes[m] = [declared[d][0], declared[u][1]];
  }
  return { rank: block.rank, shapes };
}

/** Every lora_factors input of the manifest: zeros, or (`lora`: {bytes, scale, name}) the file's factors. */
export function loraFeeds(man, lora) {
  const slots = loraSlots(man);
  if (!slots) {
    if (lora) throw new LoraError(`lora ${lora.name || ''}: the bundle has no LoRA slots (export it with lora_slots: {rank: 4, targets: [attn]})`);
    return {};
  }
  const R = slots.rank, feeds = {};
  for (const [m, [nIn, nOut]] of Object.entries(slots.shapes)) {
    const [d, u] = slotInputNames(m);
    feeds[d] = { data: new Float32Array(nIn * R), shape: [nIn, R] };
    feeds[u] = { data: new Float32Array(R * nOut), shape: [R, nOut] };
  }
  if (!lora) return feeds;
  const where = `lora ${lora.name || ''}`.trim(), scale = Number(lora.scale ?? 1);
  if (!Number.isFinite(scale)) throw new LoraError(`${where}: scale ${lora.scale} is not a finite number`);
  const { tensors, meta } = readSafetensors(lora.bytes, where);
  const groups = {};
  for (const k of Object.keys(tensors).sort()) {
    const [base, role] = keyRole(k);
    if (!role) throw new LoraError(`${where}: key ${JSON.stringify(k)} is not a LoRA factor (lora_down / lora_up / lora_A / lora_B / alpha)`);
    (groups[base] ??= {})[role] = k;
  }
  const underscored = Object.fromEntries(Object.keys(slots.shapes).map((m) => [m.replaceAll('.', '_'), m]));
  for (const [base, roles] of Object.entries(groups)) {
    const key = roles.down ?? roles.up;
    if (!roles.down || !roles.up) throw new LoraError(`${where}: key ${JSON.stringify(key)} has no ${roles.down ? 'up' : 'down'} factor beside it`);
    const [comp, name, kohya] = keyTarget(base, key, where);
    if (comp !== 'unet') throw new LoraError(`${where}: key ${JSON.stringify(key)} adapts the ${comp}; the bundle's slots take the UNet's attention projections only`);
    const m = kohya ? (underscored[name] ?? name) : name;
    if (!slots.shapes[m]) throw new LoraError(`${where}: key ${JSON.stringify(key)} names unet.${m}, which has no LoRA slot in this bundle (a LoRA for another base?)`);
    fillLayer(feeds, slots, m, roles, tensors, meta, scale, where);
  }
  return feeds;
}

function fillLayer(feeds, slots, m, roles, tensors, meta, scale, where) {
  const down = tensors[roles.down], up = tensors[roles.up], [nIn, nOut] = slots.shapes[m], R = slots.rank;
  const flat = (t) => (t.shape.length === 2 ? t.shape : t.shape.length === 4 && t.shape[2] === 1 && t.shape[3] === 1 ? t.shape.slice(0, 2) : null);
  const ds = flat(down), us = flat(up), key = JSON.stringify(roles.down);
  if (!ds || !us || ds[0] !== us[1]) throw new LoraError(`${where}: key ${key}: down ${JSON.stringify(down.shape)} and up ${JSON.stringify(up.shape)} are not LoRA factors of one rank`);
  const r = ds[0];
  if (ds[1] !== nIn || us[0] !== nOut) throw new LoraError(`${where}: key ${key}: down ${JSON.stringify(ds)} x up ${JSON.stringify(us)} does not fit the slot of unet.${m} (${nIn} -> ${nOut}): a LoRA for another base?`);
  if (r > R) throw new LoraError(`${where}: key ${key} has rank ${r}, over the bundle's slots' rank ${R}`);
  let { alpha, rs } = metadataAlpha(meta, m, r);
  if (roles.alpha) alpha = tensors[roles.alpha].data[0];
  const mult = scale * alpha / (rs ? Math.sqrt(r) : r);
  const [d, u] = slotInputNames(m), D = feeds[d].data, U = feeds[u].data;
  for (let i = 0; i < nIn; i++) for (let j = 0; j < r; j++) D[i * R + j] = down.data[j * nIn + i]; // down.T
  for (let j = 0; j < r; j++) for (let o = 0; o < nOut; o++) U[j * nOut + o] = up.data[o * r + j] * mult; // up.T scaled
}
