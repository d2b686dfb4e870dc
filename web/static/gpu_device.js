// GPU memory given back per model (issue 50). LiteRT.js 2.5.3 lets a model compile into its own Environment
// (`loadAndCompile(bytes, {accelerator: 'webgpu', environment})`, `Environment.create({webGpuDevice})`), so a
// compiled model gets a WebGPU device destroyed when it is released (pipeline.js Component; models alive at the
// same time share one, see openModelGpu):
// whatever LiteRT.js or the WebGPU implementation still held for it (buffers awaiting garbage collection, pooled
// heaps) goes with the device, as run-bundle gives each model its own LiteRT environment. The ledger counts the
// bytes of every buffer and texture created on a tracked device until it is destroyed (or its device is): live and
// peak bytes in all, and per model, the same on any WebGPU (a browser, Dawn's Node bindings).
import { Environment } from '@litertjs/core';

// what LiteRT.js's own default device asks of the adapter (its createDefaultWebGpuDevice)
const FEATURES = ['shader-f16', 'subgroups'];
const LIMITS = ['maxBufferSize', 'maxStorageBufferBindingSize', 'maxStorageBuffersPerShaderStage', 'maxTextureDimension2D'];
const TEXEL_BYTES = { r8: 1, r16: 2, rg8: 2, r32: 4, rg16: 4, rgba8: 4, bgra8: 4, rg32: 8, rgba16: 8, rgba32: 16 };
const MB = 1024 * 1024;

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
    const wrap = (obj, bytes) => {
      const entry = { bytes };
      mine.add(entry);
      add(bytes);
      const destroy = obj.destroy.bind(obj);
      obj.destroy = () => { if (mine.delete(entry)) add(-entry.bytes); return destroy(); };
      return obj;
    };
    const createBuffer = device.createBuffer.bind(device);
    const createTexture = device.createTexture.bind(device);
    device.createBuffer = (desc) => wrap(createBuffer(desc), Number(desc.size));
    device.createTexture = (desc) => wrap(createTexture(desc), textureBytes(desc));
    return () => {
      for (const entry of mine) add(-entry.bytes);
      mine.clear();
    };
  }

  summary() {
    const mb = (n) => Number((n / MB).toFixed(2));
    return {
      live_mb: mb(this.live), peak_mb: mb(this.peak),
      per_device: Object.entries(this.owners).map(([k, v]) => ({ device: k, models: [...v.models], peak_mb: mb(v.peak), live_mb: mb(v.live) })),
    };
  }
}

let config = null; // set by useModelDevices; null: every model on LiteRT.js's default environment
let current = null; // the device of the models alive now: {device, environment, users, names, untrack}
let devices = 0;

/** Models compiled from now on for WebGPU get a device that is destroyed when the last of them is released
 *  (perModel true) or share LiteRT.js's default one; `ledger` (a GpuLedger, optional) counts their memory;
 *  `onEvent(kind, name)` (optional) hears each model's open and close (the Node runner samples host memory there).
 *  `sharedDevice`: the default device, tracked as 'shared' when perModel is false. */
export function useModelDevices({ perModel = true, ledger = null, onEvent = null, sharedDevice = null } = {}) {
  config = { perModel, ledger, onEvent };
  if (!perModel && ledger && sharedDevice) ledger.track(sharedDevice, 'shared');
}

async function newDevice(name) {
  const adapter = await navigator.gpu.requestAdapter({ powerPreference: 'high-performance' }); // an adapter serves one device
  if (!adapter) throw new Error(`${name}: WebGPU found no adapter for the model's device`);
  const requiredLimits = Object.fromEntries(LIMITS.map((k) => [k, adapter.limits[k]]));
  const device = await adapter.requestDevice({ requiredFeatures: FEATURES.filter((f) => adapter.features.has(f)), requiredLimits });
  const names = [name];
  devices += 1;
  const untrack = config.ledger ? config.ledger.track(device, `device ${devices}`, names) : () => {};
  return { device, environment: await Environment.create({ webGpuDevice: device }), users: 0, names, untrack };
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
  if (!current) current = await newDevice(name);
  else current.names.push(name);
  const mine = current;
  mine.users += 1;
  config.onEvent?.('open', name);
  let open = true;
  return {
    environment: mine.environment, device: mine.device,
    close() {
      if (!open) return;
      open = false;
      mine.users -= 1;
      if (mine.users === 0) {
        if (current === mine) current = null;
        try {
          mine.environment.delete();
        } finally {
          mine.device.destroy(); // frees every buffer and texture of the device, whoever still held them
          mine.untrack();
        }
      }
      config.onEvent?.('close', name);
    },
  };
}
