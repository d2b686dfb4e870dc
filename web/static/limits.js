// Bad input (issue 50): a bundle whose components cannot fit the adapter's limits or LiteRT.js's wasm heap is
// refused before anything compiles, with one line naming the component and the limit, never a wrong image (buffers
// over a binding limit can come back as garbage). Sizes come from each .tflite's flatbuffer (tflite.js).
//
// The wasm heap rule is an estimate fitted to what LiteRT.js 2.5.3 did (benchmarks/results/web_compile_probe_*):
// compiling for WebGPU needs about the file plus two fp32 copies of its weights (8 bytes a weight) inside the heap;
// int8 files of 141 MB compiled, of 243 MB and more aborted; fp16 files of 97 MB compiled, of 558 MB aborted. A
// compiled model keeps its file in the heap until it is released, so a resident UNet's chunks add up.
//
// Weights outside the heap: LiteRT.js 2.5.3 exports loadModelAndWeights (a model whose tensors name external buffers,
// their bytes streamed into WebGPU buffers), but it compiles no such model, by either entry point, in Chromium (its
// JSPI build) or Node (docs/MEASUREMENTS.md, web section); a component with external tensors is refused here.
import { BundleError } from './pipeline.js';
import { tfliteSizes } from './tflite.js';

/** LiteRT.js 2.5.3's wasm heap: its glue caps the memory at 2 GiB (getHeapMax). */
export const WASM_HEAP_BYTES = 2 ** 31;
export const LIMIT_NAMES = ['maxStorageBufferBindingSize', 'maxBufferSize', 'wasmHeap'];
const MIB = 1024 * 1024;
const mib = (n) => `${(n / MIB).toFixed(1)} MiB`;

/** The limits the check uses: the adapter's (LiteRT.js and gpu_device.js ask their devices for the adapter's
 *  maxima), the wasm heap, then `overrides` ({name: bytes}, tests only); an unknown name or a value that is not a
 *  positive number throws. */
export function bundleLimits(adapterLimits, overrides = {}) {
  const limits = { wasmHeap: WASM_HEAP_BYTES };
  for (const k of ['maxStorageBufferBindingSize', 'maxBufferSize']) if (adapterLimits?.[k]) limits[k] = Number(adapterLimits[k]);
  for (const [k, v] of Object.entries(overrides)) {
    if (!LIMIT_NAMES.includes(k)) throw new BundleError(`limit ${k}: unknown (one of ${LIMIT_NAMES.join(', ')})`);
    if (!(Number(v) > 0)) throw new BundleError(`limit ${k}: ${v} is not a positive number of bytes`);
    limits[k] = Number(v);
  }
  return limits;
}

/** Heap bytes that compiling a model of these sizes needs (the estimate above; on wasm only its file is counted). */
export function heapNeed(sizes, fileBytes, accelerator) {
  return fileBytes + (accelerator === 'webgpu' ? 8 * sizes.weightElements : 0);
}

/** The first problem of one component (`name`, its tfliteSizes `sizes`, its file's bytes), or null. `heldBytes`:
 *  bytes of other models' files held in the heap while it compiles (a resident UNet's other chunks). */
export function componentProblem(name, sizes, fileBytes, limits, { accelerator = 'webgpu', heldBytes = 0, heldWhat = '' } = {}) {
  if (sizes.external) {
    return `${name}: ${sizes.external} of its tensors keep their weights in external buffers, which LiteRT.js 2.5.3 cannot compile (loadAndCompile and loadModelAndWeights both fail); refused before loading (export the component with its weights inside the .tflite)`;
  }
  const big = sizes.largest;
  if (accelerator === 'webgpu' && big) {
    for (const k of ['maxStorageBufferBindingSize', 'maxBufferSize']) {
      if (limits[k] && big.gpuBytes > limits[k]) {
        const tensor = String(big.name).split('/').pop();
        return `${name}: its ${big.constant ? 'constant' : 'activation'} tensor ${tensor} [${big.shape.join(', ')}] needs ${mib(big.gpuBytes)} on the GPU (fp16), over this adapter's ${k} ${mib(limits[k])}; refused before loading`;
      }
    }
  }
  const need = heapNeed(sizes, fileBytes, accelerator) + heldBytes;
  if (limits.wasmHeap && need > limits.wasmHeap) {
    const how = accelerator === 'webgpu' ? `its ${mib(fileBytes)} file and ~8 bytes for each of its ${(sizes.weightElements / 1e6).toFixed(1)} M weights` : `its ${mib(fileBytes)} file`;
    return `${name}: compiling it needs ~${mib(need)} of LiteRT.js's wasm heap (${how}${heldBytes ? `, with ${heldWhat} holding ${mib(heldBytes)}` : ''}), over its wasmHeap ${mib(limits.wasmHeap)}; refused before loading${heldBytes ? ' (unet=streamed holds one UNet chunk at a time)' : ''}`;
  }
  return null;
}

/** Every component the run compiles (bundle.teParts, unetParts, decoder; after bundle.open()) read once and checked
 *  against `limits` before anything compiles; throws a BundleError with the first problem's one line. A resident
 *  UNet in chunks counts its other chunks' files as held. Returns {name: {file_mb, weights_m, largest_gpu_mb}}.
 *  Each file's sizes are kept on the bundle (bundle.tfliteSizes), so a check again (another accelerator chosen on
 *  the page) reads no file twice. */
export async function preflight(bundle, limits, { accelerator = 'webgpu', streamed = false } = {}) {
  const man = bundle.man;
  const report = {};
  const parts = [...bundle.teParts, ...bundle.unetParts, ...bundle.decoder];
  const fileBytes = (n) => Number(man.components[n].bytes) || 0;
  const unetHeld = !streamed && bundle.unetParts.length > 1 ? bundle.unetParts.reduce((a, n) => a + fileBytes(n), 0) : 0;
  const known = (bundle.tfliteSizes ??= {});
  for (const name of parts) {
    if (!known[name]) {
      const bytes = await bundle.fetchBytes(man.components[name].path, `component ${name}`);
      try {
        known[name] = { sizes: tfliteSizes(bytes), bytes: bytes.byteLength };
      } catch (e) {
        throw new BundleError(`${name}: ${man.components[name].path} is ${e.message}`);
      }
    }
    const { sizes, bytes } = known[name];
    const isUnet = bundle.unetParts.includes(name);
    const held = unetHeld && !bundle.teParts.includes(name) ? unetHeld - (isUnet ? fileBytes(name) : 0) : 0; // the text encoder runs before
    const problem = componentProblem(name, sizes, bytes, limits, {
      accelerator, heldBytes: held, heldWhat: isUnet ? 'the other resident UNet chunks' : 'the resident UNet chunks' });
    if (problem) throw new BundleError(problem);
    report[name] = { file_mb: Number((bytes / MIB).toFixed(2)), weights_m: Number((sizes.weightElements / 1e6).toFixed(3)),
      largest_gpu_mb: Number(((sizes.largest?.gpuBytes ?? 0) / MIB).toFixed(3)), external_tensors: sizes.external };
  }
  return report;
}

/** `NAME=BYTES` / `NAME:BYTES` strings (a test's option or URL parameter) -> {name: bytes}. */
export function parseLimitOverrides(items) {
  const out = {};
  for (const item of items || []) {
    const m = /^([A-Za-z]+)[=:](\d+)$/.exec(String(item).trim());
    if (!m) throw new BundleError(`limit ${JSON.stringify(item)}: expected NAME=BYTES with NAME one of ${LIMIT_NAMES.join(', ')}`);
    out[m[1]] = Number(m[2]);
  }
  return out;
}
