// GPU memory given back per model (issue 50). LiteRT.js 2.5.3 lets a model compile into its own Environment
// (`loadAndCompile(bytes, {accelerator: 'webgpu', environment})`, `Environment.create({webGpuDevice})`), so a
// compiled model gets a WebGPU device destroyed when it is released (pipeline.js Component; models alive at the
// same time share one, see openModelGpu):
// whatever LiteRT.js or the WebGPU implementation still held for it (buffers awaiting garbage collection, pooled
// heaps) goes with the device, as run-bundle gives each model its own LiteRT environment. The ledger counts the
// bytes of every buffer and texture created on a tracked device until it is destroyed (or its device is): live and
// peak bytes in all, and per model, the same on any WebGPU (a browser, Dawn's Node bindings).
// LiteRT.js 2.5.3's wasm (emdawnwebgpu) never lets go of some WebGPU objects it was handed: its table of JS objects
// (Module.WebGPU.Internals.jsObjects) keeps every device and queue it imported and every compute pipeline and
// pipeline layout it created, after the model and its Environment are deleted (measured on the tiny smoke bundle
// streamed: 15 devices, 1,182 pipelines held at the end), so no destroyed device's JS object could ever be collected.
// A destroyed device's entries are dropped from that table (dropWasmRefs): the device, its queue and what it made
// can then be collected (a browser's GPU process frees them then; the Node runner collects at once, `collect`).
import { Environment, getGlobalLiteRt } from '@litertjs/core';

// what LiteRT.js's own default device asks of the adapter (its createDefaultWebGpuDevice)
const FEATURES = ['shader-f16', 'subgroups'];
const LIMITS = ['maxBufferSize', 'maxStorageBufferBindingSize', 'maxStorageBuffersPerShaderStage', 'maxTextureDimension2D'];
const TEXEL_BYTES = { r8: 1, r16: 2, rg8: 2, r32: 4, rg16: 4, rgba8: 4, bgra8: 4, rg32: 8, rgba16: 8, rgba32: 16 };
const MB = 1024 * 1024;
// Dawn's Vulkan backend sub-allocates resources under 4 MiB from power-of-two buddy blocks aligned to the device's
// bufferImageGranularity (its own comment: often 64 KiB on NVIDIA); larger ones get memory of their own
const SUBALLOC_MAX = 4 * MB;
const GRANULE = 64 * 1024;

/** What one resource of `bytes` would take under that scheme: an estimate, to set beside the GPU's own figure. */
export function roundedBytes(bytes) {
  if (bytes >= SUBALLOC_MAX) return bytes;
  let block = GRANULE;
  while (block < bytes) block *= 2;
  return block;
}

function textureBytes(desc) {
  const size = Array.isArray(desc.size) ? desc.size : [desc.size.width, desc.size.height ?? 1, desc.size.depthOrArrayLayers ?? 1];
  const key = Object.keys(TEXEL_BYTES).find((k) => String(desc.format).startsWith(k) && /^(uint|sint|float|unorm|snorm)/.test(String(desc.format).slice(k.length)));
  return size.reduce((a, d) => a * (d ?? 1), 1) * (key ? TEXEL_BYTES[key] : 16); // an unknown format counted at the widest
}

/** Bytes of WebGPU buffers and textures alive on the tracked devices: now, at the peak, and per owner (a model). */
export class GpuLedger {
  constructor() {
    this.live = 0;
    this.peak = 0;
    this.count = 0; // buffers and textures alive
    this.rounded = 0; // their bytes as roundedBytes() would allocate them
    this.owners = {}; // name -> {live, peak, devices}
  }

  /** Counts what `device` creates from now on as `owner`'s (`models`: the models on it, an array the caller may
   *  extend); returns a function that uncounts all of it still alive (call it when the device is destroyed). */
  track(device, owner, models = [owner]) {
    const mine = new Set();
    const o = (this.owners[owner] ??= { live: 0, peak: 0, models });
    const add = (n) => {
      this.live += n; o.live += n;
      this.peak = Math.max(this.peak, this.live); o.peak = Math.max(o.peak, o.live);
    };
    const count = (entry, sign) => { this.count += sign; this.rounded += sign * roundedBytes(entry.bytes); };
    const wrap = (obj, bytes) => {
      const entry = { bytes };
      mine.add(entry);
      add(bytes);
      count(entry, 1);
      const destroy = obj.destroy.bind(obj);
      obj.destroy = () => { if (mine.delete(entry)) { add(-entry.bytes); count(entry, -1); } return destroy(); };
      return obj;
    };
    const createBuffer = device.createBuffer.bind(device);
    const createTexture = device.createTexture.bind(device);
    device.createBuffer = (desc) => wrap(createBuffer(desc), Number(desc.size));
    device.createTexture = (desc) => wrap(createTexture(desc), textureBytes(desc));
    this.countUploads(device.queue, o);
    o.pipelines = 0; // compute pipelines made on the device (a driver may hold memory per pipeline, outside the ledger)
    for (const m of ['createComputePipeline', 'createComputePipelineAsync']) {
      if (typeof device[m] !== 'function') continue;
      const make = device[m].bind(device);
      device[m] = (desc) => { o.pipelines += 1; return make(desc); };
    }
    return () => {
      for (const entry of mine) { add(-entry.bytes); count(entry, -1); }
      mine.clear();
    };
  }

  /** Bytes handed to `queue`'s writeBuffer and writeTexture, added to owner `o`'s `uploaded`: the weights go up through
   *  writeTexture (LiteRT.js 2.5.3), each write staged by the WebGPU implementation in memory of its own, which no
   *  buffer or texture above counts, until the GPU has copied it. */
  countUploads(queue, o) {
    o.uploaded = 0;
    if (!queue) return;
    const dataBytes = (data, offset = 0, size = undefined) => Number(size ?? (data.byteLength - offset * (data.BYTES_PER_ELEMENT ?? 1)));
    const writeBuffer = queue.writeBuffer.bind(queue);
    const writeTexture = queue.writeTexture.bind(queue);
    queue.writeBuffer = (buffer, at, data, offset, size) => {
      o.uploaded += dataBytes(data, offset, size === undefined ? undefined : size * (data.BYTES_PER_ELEMENT ?? 1));
      return writeBuffer(buffer, at, data, offset, size);
    };
    queue.writeTexture = (dest, data, layout, size) => {
      o.uploaded += Math.max(0, data.byteLength - (layout?.offset ?? 0));
      return writeTexture(dest, data, layout, size);
    };
  }

  summary() {
    const mb = (n) => Number((n / MB).toFixed(2));
    return {
      live_mb: mb(this.live), peak_mb: mb(this.peak), live_count: this.count, live_rounded_mb: mb(this.rounded),
      per_device: Object.entries(this.owners).map(([k, v]) => ({
        device: k, models: [...v.models], peak_mb: mb(v.peak), live_mb: mb(v.live), uploaded_mb: mb(v.uploaded ?? 0), pipelines: v.pipelines ?? 0,
      })),
    };
  }
}

let config = null; // set by useModelDevices; null: every model on LiteRT.js's default environment
let current = null; // the device of the models alive now: {device, environment, users, names, untrack, made}
let devices = 0;
// devices made, destroyed and collected (their JS objects garbage-collected, where FinalizationRegistry exists: it
// tells a task after the collection), and the entries of LiteRT.js's wasm object table dropped for destroyed devices
export const deviceCounts = { created: 0, destroyed: 0, collected: 0, wasm_refs_dropped: 0 };
const collected = typeof FinalizationRegistry === 'function' ? new FinalizationRegistry(() => { deviceCounts.collected += 1; }) : null;
// the device methods whose results LiteRT.js's wasm may keep in its object table
const MAKERS = ['createBuffer', 'createTexture', 'createShaderModule', 'createBindGroupLayout', 'createBindGroup', 'createPipelineLayout',
  'createComputePipeline', 'createComputePipelineAsync', 'createCommandEncoder', 'createQuerySet', 'createSampler'];

/** A WeakSet of `device`, its queue and everything its makers return from now on. */
function remember(device) {
  const made = new WeakSet([device, device.queue]);
  for (const m of MAKERS) {
    if (typeof device[m] !== 'function') continue;
    const make = device[m].bind(device);
    device[m] = m.endsWith('Async') ? async (desc) => { const o = await make(desc); made.add(o); return o; }
      : (desc) => { const o = make(desc); made.add(o); return o; };
  }
  return made;
}

/** Drops the entries of LiteRT.js's wasm object table that are in `made` (a destroyed device's): the number dropped.
 *  Safe once the device is destroyed and its Environment deleted: nothing runs on them any more, and the wasm's own
 *  release of an entry (emwgpuDelete) deletes a key that is already gone. */
function dropWasmRefs(made) {
  let table = null;
  try {
    table = getGlobalLiteRt().liteRtWasm?.WebGPU?.Internals?.jsObjects;
  } catch { /* LiteRT.js not loaded: nothing held */ }
  if (!table) return 0;
  let n = 0;
  for (const key of Object.keys(table)) {
    if (made.has(table[key])) {
      delete table[key];
      n += 1;
    }
  }
  deviceCounts.wasm_refs_dropped += n;
  return n;
}

/** Models compiled from now on for WebGPU get a device that is destroyed when the last of them is released
 *  (perModel true) or share LiteRT.js's default one; `ledger` (a GpuLedger, optional) counts their memory;
 *  `onEvent(kind, name)` (optional) hears each model's open, compiled and close (modelEvent; the Node runner samples
 *  memory there); `collect()` (optional: the Node runner's forced garbage collection) runs after each device is
 *  destroyed, once the caller has dropped its references. `sharedDevice`: the default device, tracked as 'shared'
 *  when perModel is false. */
export function useModelDevices({ perModel = true, ledger = null, onEvent = null, collect = null, sharedDevice = null,
  settleUploads = true } = {}) {
  config = { perModel, ledger, onEvent, collect, settleUploads };
  if (!perModel && ledger && sharedDevice) ledger.track(sharedDevice, 'shared');
}

/** After model `name` compiled on `gpu` (openModelGpu's): with useModelDevices's settleUploads (the default), waits
 *  until the GPU has done the work queued so far (the weights' uploads), then submits nothing once more and waits
 *  again: Dawn lets a finished write's staging memory go only at a later submission (benchmarks/webgpu_memory_probe.mjs:
 *  1x the bytes written, kept until then). So the staging goes before the next model compiles (Dawn on an H200, the
 *  SD-2.1 student's UNet chunks resident: GPU peak 16.3 -> 13.6 GB with the first wait alone), and reports an
 *  `uploads_done` event. */
export async function settleUploads(name, gpu) {
  const device = gpu?.device ?? null;
  if (!config?.settleUploads || !device) return;
  await device.queue.onSubmittedWorkDone();
  device.queue.submit([]);
  await device.queue.onSubmittedWorkDone();
  modelEvent('uploads_done', name);
}

/** Tells useModelDevices's onEvent that model `name` reached `kind` (open, compiled, close): pipeline.js Component. */
export function modelEvent(kind, name) {
  config?.onEvent?.(kind, name);
}

async function newDevice(name) {
  const adapter = await navigator.gpu.requestAdapter({ powerPreference: 'high-performance' }); // an adapter serves one device
  if (!adapter) throw new Error(`${name}: WebGPU found no adapter for the model's device`);
  const requiredLimits = Object.fromEntries(LIMITS.map((k) => [k, adapter.limits[k]]));
  const device = await adapter.requestDevice({ requiredFeatures: FEATURES.filter((f) => adapter.features.has(f)), requiredLimits });
  const names = [name];
  devices += 1;
  deviceCounts.created += 1;
  collected?.register(device, null);
  const made = remember(device);
  const untrack = config.ledger ? config.ledger.track(device, `device ${devices}`, names) : () => {};
  return { device, environment: await Environment.create({ webGpuDevice: device }), users: 0, names, untrack, made };
}

/** The last model on `mine` is released: its Environment deleted, its device destroyed (which frees every buffer
 *  and texture of it, whoever still held them), LiteRT.js's wasm made to let go of it, and then config.collect, after
 *  the caller has dropped its references: a task later, or before the next device is made if that comes first. */
function destroyDevice(mine) {
  try {
    mine.environment.delete();
  } finally {
    mine.device.destroy();
    deviceCounts.destroyed += 1;
    mine.untrack();
    dropWasmRefs(mine.made);
    mine.environment = mine.device = mine.made = null;
    if (config.collect) {
      uncollected = true;
      setTimeout(collectNow, 0);
    }
  }
}

let uncollected = false; // a device destroyed since config.collect last ran

function collectNow() {
  if (!uncollected) return;
  uncollected = false;
  config.collect();
}

/** The WebGPU device for model `name` in a LiteRT.js Environment: {environment, device, close()}; null when models
 *  share the default environment (useModelDevices not called, or perModel false). LiteRT.js 2.5.3's WebGPU delegate
 *  holds one device at a time (it binds the first device it is given until every model on it is deleted; a model
 *  compiled meanwhile for another device gets buffers of both: "Buffer is associated with [Device], and cannot be
 *  used with [Device]"), so models alive at the same time share a device, and a model opened when none is alive
 *  gets a new one: text encoder, each streamed UNet chunk, decoder each on their own; a resident UNet's chunks and
 *  the decoder that joins them, one. */
export async function openModelGpu(name) {
  if (!config?.perModel) return null;
  if (!current) {
    collectNow(); // the last device's models are released: whatever is left of it goes before the next one is made
    current = await newDevice(name);
  }
  else current.names.push(name);
  const mine = current;
  mine.users += 1;
  let open = true;
  return {
    environment: mine.environment, device: mine.device,
    close() {
      if (!open) return;
      open = false;
      mine.users -= 1;
      if (mine.users === 0) {
        if (current === mine) current = null;
        destroyDevice(mine);
      }
    },
  };
}
