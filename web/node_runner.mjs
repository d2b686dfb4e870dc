#!/usr/bin/env node
// The web page's pipeline (static/generate.js, unchanged) in Node.js, on a GPU through Dawn's Node bindings
// (npm `webgpu`): the same LiteRT.js and the same WebGPU path as the page, without a browser, so a machine with a
// GPU and no display runs the page's code on its real GPU (Vulkan here, Metal / D3D12 elsewhere). It checks like
// the page's check mode: every component fully accelerated, each golden within its tolerance, and the image
// against run-bundle's reference (`pocketdiff web` writes BUNDLE/web/reference/).
//
//   node web/node_runner.mjs BUNDLE [--unet resident|streamed] [--out report.json] [--image image.png]
//        [--prompt P] [--seed S] [--no-goldens] [--min-image-psnr 30] [--gpu-device per-model|shared]
//        [--limit NAME=BYTES ...] [--no-gc] [--dawn-toggle NAME ...] [--no-settle-uploads] [--precision fp32|fp16]
//        [--decoder-precision fp32|fp16] [--init-image PICTURE.png [--mask MASK.png] [--strength S]]
//        [--lora FILE.safetensors [--lora-scale S]]
// Each model compiles on a WebGPU device of its own, destroyed when it is released (--gpu-device shared: LiteRT.js's
// one default device, as before), then garbage-collected at once (V8's gc; --no-gc: whenever V8 gets to it); the
// report gives the WebGPU bytes alive at the peak, in all and per model (static/gpu_device.js), the host peak while
// each model was open, and memory at each model's open, compiled and close (memory_events). Before anything compiles every component is
// checked against the adapter's limits and LiteRT.js's wasm heap (static/limits.js; --limit lowers one, for tests).
// After each compile the runner waits until the GPU has done the queued weight uploads (an `uploads_done` event), so
// their staging memory goes before the next model compiles (--no-settle-uploads: not, as before). Memory
// experiments: --dawn-toggle enables a Dawn toggle (e.g. disable_resource_suballocation). --precision fp16 asks LiteRT.js
// for half precision on WebGPU for the text encoder and UNet (their weights as rgba16float textures instead of
// rgba32float: half their GPU memory); the decoder stays fp32 (static/generate.js DECODER_PRECISION) unless
// --decoder-precision fp16, for a decoder exported with its 3x3 convs lowered (rewrites.conv_lowering_components).
// --init-image (a PNG, read by static/png.js as PIL reads it for run-bundle) runs image to image from it, --mask (white =
// repaint; the picture's size) inpainting, --strength the part of the schedule run (default 0.8, 1 with a mask), as
// run-bundle's flags (static/image_input.js); the image is compared with the reference only when it was made from the
// same picture, mask and strength (pocketdiff web's reference from a picture: web/reference/init_image.png, mask.png).
// --lora feeds a LoRA (safetensors; static/lora.js, run-bundle's --lora twin) to a bundle exported with lora_slots, at
// --lora-scale (default 1): the file is read and checked against the slots before anything compiles; the image is
// compared with the reference only when it was made with the same LoRA and scale (web/reference/lora.safetensors).
// Exit 0 when every check passed, 1 when one failed (the report says which), 2 on bad input or no GPU.
import fs from 'node:fs';
import path from 'node:path';
import v8 from 'node:v8';
import vm from 'node:vm';
import zlib from 'node:zlib';
import { createRequire } from 'node:module';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const WASM_DIR = path.join(HERE, 'node_modules', '@litertjs', 'core', 'wasm');

class UsageError extends Error {}

function options() {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      unet: { type: 'string', default: 'resident' }, out: { type: 'string' }, image: { type: 'string' },
      prompt: { type: 'string' }, seed: { type: 'string' }, 'no-goldens': { type: 'boolean', default: false },
      'min-image-psnr': { type: 'string', default: '30' },
      'gpu-device': { type: 'string', default: 'per-model' }, limit: { type: 'string', multiple: true, default: [] },
      'no-gc': { type: 'boolean', default: false }, 'dawn-toggle': { type: 'string', multiple: true, default: [] },
      'no-settle-uploads': { type: 'boolean', default: false }, precision: { type: 'string', default: 'fp32' },
      'decoder-precision': { type: 'string', default: 'fp32' }, // generate.js's DECODER_PRECISION
      'init-image': { type: 'string' }, mask: { type: 'string' }, strength: { type: 'string' },
      lora: { type: 'string' }, 'lora-scale': { type: 'string' },
    },
  });
  checkPictureFlags(values);
  checkLoraFlags(values);
  if (positionals.length !== 1) throw new UsageError('usage: node web/node_runner.mjs BUNDLE [--unet resident|streamed] [--out report.json] [--image image.png]');
  const bundle = path.resolve(positionals[0]);
  if (!fs.existsSync(path.join(bundle, 'manifest.json'))) throw new UsageError(`BUNDLE: ${bundle} has no manifest.json`);
  if (!['resident', 'streamed'].includes(values.unet)) throw new UsageError(`--unet: ${values.unet}, expected resident or streamed`);
  for (const key of ['precision', 'decoder-precision']) {
    if (!['fp32', 'fp16'].includes(values[key])) throw new UsageError(`--${key}: ${values[key]}, expected fp32 or fp16`);
  }
  if (!['per-model', 'shared'].includes(values['gpu-device'])) throw new UsageError(`--gpu-device: ${values['gpu-device']}, expected per-model or shared`);
  const badToggle = values['dawn-toggle'].find((t) => !/^[a-z0-9_]+$/.test(t));
  if (badToggle !== undefined) throw new UsageError(`--dawn-toggle: ${JSON.stringify(badToggle)}, expected a Dawn toggle name (letters, digits, _)`);
  const minPsnr = Number(values['min-image-psnr']);
  if (!Number.isFinite(minPsnr)) throw new UsageError(`--min-image-psnr: ${values['min-image-psnr']} is not a number`);
  const seed = values.seed === undefined ? undefined : Number(values.seed);
  if (seed !== undefined && !Number.isInteger(seed)) throw new UsageError(`--seed: ${values.seed} is not an integer`);
  return { ...values, bundle, seed, minPsnr, goldens: !values['no-goldens'] };
}

/** --mask / --strength without --init-image, a strength outside (0, 1]: one line, before anything is read. */
function checkPictureFlags(values) {
  if (!values['init-image'] && (values.mask !== undefined || values.strength !== undefined)) {
    const flag = values.mask !== undefined ? `--mask ${values.mask}` : `--strength ${values.strength}`;
    throw new UsageError(`${flag}: only with --init-image PATH (the picture it starts from)`);
  }
  const s = Number(values.strength);
  if (values.strength !== undefined && !(s > 0 && s <= 1)) throw new UsageError(`--strength ${values.strength}: must be a number in (0, 1]`);
}

/** --lora-scale without --lora, a scale that is no finite number, a pickle (never opened): one line, before anything is read. */
function checkLoraFlags(values) {
  const scale = values['lora-scale'];
  if (scale !== undefined && !values.lora) throw new UsageError(`--lora-scale ${scale}: scales a LoRA; give it with --lora FILE`);
  if (scale !== undefined && !(scale.trim() !== '' && Number.isFinite(Number(scale)))) throw new UsageError(`--lora-scale ${scale}: not a finite number`);
  const suffix = values.lora ? (/\.[^./\\]*$/.exec(values.lora)?.[0] ?? '').toLowerCase() : '.safetensors';
  if (['.ckpt', '.pt', '.pth', '.bin', '.pkl', '.pickle'].includes(suffix)) { // pocketdiff/lora_keys.py PICKLE_SUFFIXES
    throw new UsageError(`--lora ${values.lora}: a pickle (${suffix}); it is never unpickled: convert the LoRA to .safetensors`);
  }
  if (suffix !== '.safetensors') throw new UsageError(`--lora ${values.lora}: must be a .safetensors file, got suffix ${suffix || '(none)'}`);
}

/** --lora as generate.js's opts.lora ({bytes, scale, name}), read and checked against the bundle's slots (static/lora.js's
 *  refusals as a UsageError: exit 2 before anything compiles), or null. */
async function loraInput(opts, man) {
  if (!opts.lora) return null;
  const { loraFeeds } = await import('./static/lora.js');
  let bytes;
  try {
    bytes = new Uint8Array(fs.readFileSync(opts.lora));
  } catch (e) {
    throw new UsageError(`--lora ${opts.lora}: ${e.code === 'ENOENT' ? 'no such file' : e.message}`);
  }
  const lora = { bytes, scale: opts['lora-scale'] === undefined ? 1 : Number(opts['lora-scale']), name: opts.lora };
  try {
    loraFeeds(man, lora);
  } catch (e) {
    throw new UsageError(e.message.startsWith('lora ') ? `--${e.message}` : e.message);
  }
  return lora;
}

/** Why this run's LoRA is not the reference's (reference.json lora, lora_scale: the same bytes at the same scale), or null. */
function loraMismatch(ref, opts, lora) {
  const file = ref.lora ? path.join(opts.bundle, 'web', 'reference', ref.lora) : null;
  const same = file && lora ? Buffer.compare(fs.readFileSync(file), lora.bytes) === 0 && ref.lora_scale === lora.scale : !file && !lora;
  if (same) return null;
  const say = (name, scale) => (name ? `LoRA ${name} at scale ${scale}` : 'no LoRA');
  return `the reference is made with ${say(file, ref.lora_scale)}; this run with ${say(opts.lora, lora?.scale)}`;
}

/** --init-image, --mask, --strength as generate.js's opts.image (static/image_input.js), or null (text to image). */
async function pictureInput(opts, man) {
  if (!opts['init-image']) return null;
  const { decodePng } = await import('./static/png.js');
  const { latentMask, maskGrey, pictureTensor } = await import('./static/image_input.js');
  const read = (file, flag) => {
    let bytes;
    try {
      bytes = fs.readFileSync(file);
    } catch (e) {
      throw new UsageError(`${flag} ${file}: ${e.code === 'ENOENT' ? 'no such file' : e.message}`);
    }
    return decodePng(new Uint8Array(bytes), (b) => zlib.inflateSync(b), `${flag} ${file}`);
  };
  const pic = await read(opts['init-image'], '--init-image');
  const pixels = pictureTensor(pic, man, `--init-image ${opts['init-image']}`);
  const grey = opts.mask ? maskGrey(await read(opts.mask, '--mask'), man, [pic.width, pic.height], `--mask ${opts.mask}`) : null;
  if (pixels.warning) process.stderr.write(`${pixels.warning}\n`);
  return { pixels, mask: grey ? latentMask(grey, man) : null, grey, strength: opts.strength === undefined ? null : Number(opts.strength) };
}

/** Why this run is not the reference's (its picture, mask and strength: reference.json), or null when it is. */
function pictureMismatch(ref, opts, task) {
  const dir = path.join(opts.bundle, 'web', 'reference'), real = (f) => (f ? fs.realpathSync(f) : null);
  const want = ref.init_image ? { init_image: real(path.join(dir, ref.init_image)), mask: ref.mask ? real(path.join(dir, ref.mask)) : null, strength: ref.strength } : null;
  const got = task.task === 'text_to_image' ? null : { init_image: real(opts['init-image']), mask: real(opts.mask), strength: task.strength };
  if (JSON.stringify(want) === JSON.stringify(got)) return null;
  const say = (v) => (v ? `from picture ${v.init_image}${v.mask ? ` with mask ${v.mask}` : ''} at strength ${v.strength}` : 'text to image');
  return `the reference is ${say(want)}; this run is ${say(got)}`;
}

/** navigator.gpu and the WebGPU constants from Dawn's Node bindings; the adapter, or a UsageError naming why not. */
async function installWebGpu(toggles = []) {
  let webgpu;
  try {
    webgpu = await import('webgpu');
  } catch (e) {
    throw new UsageError(`npm package webgpu (Dawn's Node bindings) is missing: bash scripts/setup.sh installs it (${e.message})`);
  }
  Object.assign(globalThis, webgpu.globals);
  const flags = toggles.length ? [`enable-dawn-features=${toggles.join(',')}`] : []; // Dawn toggles, e.g. disable_resource_suballocation
  globalThis.navigator = { gpu: webgpu.create(flags), userAgent: `node ${process.version} (webgpu)` };
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) throw new UsageError('no WebGPU adapter: Dawn found no Vulkan (or Metal / D3D12) device');
  const info = adapter.info || {};
  const limits = { maxStorageBufferBindingSize: adapter.limits.maxStorageBufferBindingSize, maxBufferSize: adapter.limits.maxBufferSize };
  return { vendor: info.vendor, architecture: info.architecture, description: info.description, device: info.device, limits };
}

/** What LiteRT.js's loader expects of a browser (classic scripts, `self`), and fetch of file: URLs. */
function installBrowserShims() {
  globalThis.self = globalThis;
  globalThis.require = createRequire(import.meta.url);
  globalThis.__dirname = WASM_DIR + path.sep;
  globalThis.__filename = path.join(WASM_DIR, 'loader.js');
  globalThis.importScripts = (url) => {
    const file = String(url).startsWith('file:') ? fileURLToPath(url) : String(url);
    vm.runInThisContext(fs.readFileSync(file, 'utf8'), { filename: file });
  };
  const netFetch = globalThis.fetch;
  globalThis.fetch = async (resource, init) => {
    const url = new URL(resource instanceof Request ? resource.url : String(resource));
    if (url.protocol !== 'file:') return netFetch(resource, init);
    try {
      return new Response(await fs.promises.readFile(fileURLToPath(url)));
    } catch (e) {
      return new Response(null, { status: e.code === 'ENOENT' ? 404 : 500 });
    }
  };
}

/** run-bundle's reference (latents, re-noising draws, image) from BUNDLE/web/reference/, or null. */
function loadReference(bundle) {
  const dir = path.join(bundle, 'web', 'reference');
  if (!fs.existsSync(path.join(dir, 'reference.json'))) return null;
  const ref = JSON.parse(fs.readFileSync(path.join(dir, 'reference.json'), 'utf8'));
  const f32 = (rel) => { const b = fs.readFileSync(path.join(dir, rel)); return new Float32Array(b.buffer, b.byteOffset, b.byteLength / 4); };
  ref.latentsData = f32(ref.latents);
  ref.noiseData = ref.noise ? f32(ref.noise) : null;
  ref.imageData = f32(ref.image);
  return ref;
}

function crc32(buf) {
  let c, crc = 0xffffffff;
  for (let n = 0; n < buf.length; n++) {
    c = (crc ^ buf[n]) & 0xff;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    crc = (crc >>> 8) ^ c;
  }
  return (crc ^ 0xffffffff) >>> 0;
}

/** An 8-bit RGB PNG of the image ({img: HWC floats in [0, 1], h, w, c}). */
function writePng(file, image) {
  const raw = Buffer.alloc(image.h * (1 + image.w * 3));
  for (let y = 0; y < image.h; y++) {
    for (let x = 0; x < image.w; x++) {
      for (let k = 0; k < 3; k++) {
        const v = image.img[(y * image.w + x) * image.c + k];
        raw[y * (1 + image.w * 3) + 1 + x * 3 + k] = Math.max(0, Math.min(255, Math.round(v * 255)));
      }
    }
  }
  const chunk = (type, data) => {
    const head = Buffer.alloc(8);
    head.writeUInt32BE(data.length, 0);
    head.write(type, 4, 'ascii');
    const crc = Buffer.alloc(4);
    crc.writeUInt32BE(crc32(Buffer.concat([head.subarray(4), data])), 0);
    return Buffer.concat([head, data, crc]);
  };
  const ihdr = Buffer.alloc(13);
  ihdr.writeUInt32BE(image.w, 0);
  ihdr.writeUInt32BE(image.h, 4);
  ihdr.set([8, 2, 0, 0, 0], 8);
  fs.writeFileSync(file, Buffer.concat([Buffer.from([137, 80, 78, 71, 13, 10, 26, 10]), chunk('IHDR', ihdr),
    chunk('IDAT', zlib.deflateSync(raw)), chunk('IEND', Buffer.alloc(0))]));
}

function procStatusMb(field) {
  try {
    const m = new RegExp(`${field}:\\s+(\\d+) kB`).exec(fs.readFileSync('/proc/self/status', 'utf8'));
    return m ? Math.round(Number(m[1]) / 1024) : null;
  } catch {
    return null;
  }
}

function hostPeakMb() {
  return procStatusMb('VmHWM');
}

/** Memory at every model's open, compiled and close (gpu_device.js's modelEvent), and the host peak while each model
 *  was open: at each event the process's peak RSS since the last one is charged to every model open in that span,
 *  then reset (/proc/self/clear_refs 5; where that is refused the peaks are since the start). Each event also gives the
 *  size of LiteRT.js's wasm heap, V8's heap and its array buffers (host memory of JS), the WebGPU ledger's live bytes, the devices made / destroyed / not yet garbage-collected (gpu_device.js deviceCounts),
 *  and the wall clock (epoch_s), which benchmarks/web_node.py matches with its GPU memory samples. */
function memoryEvents(ledger, counts, wasmHeapBytes) {
  const open = new Set(), peaks = {}, events = [];
  let processPeak = 0;
  const t0 = performance.now();
  const onEvent = (kind, name) => {
    const hwm = procStatusMb('VmHWM');
    processPeak = Math.max(processPeak, hwm ?? 0);
    for (const n of open) peaks[n] = Math.max(peaks[n] ?? 0, hwm ?? 0);
    if (kind === 'open') open.add(name);
    if (kind === 'close') open.delete(name);
    const rss = procStatusMb('VmRSS'), js = process.memoryUsage(), mb = (n) => Math.round(n / 2 ** 20);
    if (kind === 'open') peaks[name] = Math.max(peaks[name] ?? 0, rss ?? 0);
    events.push({
      t_s: Number(((performance.now() - t0) / 1000).toFixed(2)), epoch_s: Date.now() / 1000, event: kind, model: name,
      rss_mb: rss, hwm_mb: hwm, wasm_heap_mb: mb(wasmHeapBytes()), js_heap_mb: mb(js.heapUsed), js_buffers_mb: mb(js.arrayBuffers),
      webgpu_live_mb: Number((ledger.live / 2 ** 20).toFixed(1)), webgpu_live_count: ledger.count,
      webgpu_live_rounded_mb: Number((ledger.rounded / 2 ** 20).toFixed(1)),
      devices_alive: counts.created - counts.destroyed, devices_uncollected: counts.created - counts.collected,
    });
    try {
      fs.writeFileSync('/proc/self/clear_refs', '5');
    } catch { /* the peak stays the process's */ }
  };
  return { onEvent, peaks, events, processPeakMb: () => Math.max(processPeak, hostPeakMb() ?? 0) };
}

/** A full garbage collection (V8's gc, exposed at run time): a destroyed device's JS objects, and with them what
 *  Dawn still holds for it, go at once instead of whenever V8 next collects. */
function forcedGc() {
  v8.setFlagsFromString('--expose-gc');
  const gc = vm.runInNewContext('gc');
  const stats = { runs: 0, ms: 0 };
  const collect = () => {
    const t = performance.now();
    gc();
    stats.runs += 1;
    stats.ms += performance.now() - t;
  };
  return { collect, stats };
}

async function main() {
  const opts = options();
  const t0 = performance.now();
  const adapter = await installWebGpu(opts['dawn-toggle']);
  installBrowserShims();
  const { installConsoleTap } = await import('./static/prepare.js');
  installConsoleTap();
  const { loadLiteRt, getWebGpuDevice, getGlobalLiteRt } = await import('@litertjs/core');
  await loadLiteRt(WASM_DIR + path.sep);
  const runtimeMs = performance.now() - t0;
  const { Bundle, imagePsnr, tokenizerCheck, checkFailures, componentReports } = await import('./static/pipeline.js');
  const { GpuLedger, deviceCounts, useModelDevices } = await import('./static/gpu_device.js');
  const { bundleLimits, parseLimitOverrides, preflight } = await import('./static/limits.js');
  const ledger = new GpuLedger(), host = memoryEvents(ledger, deviceCounts, () => getGlobalLiteRt().liteRtWasm.HEAPU8.length), gc = opts['no-gc'] ? null : forcedGc();
  useModelDevices({ perModel: opts['gpu-device'] === 'per-model', ledger, onEvent: host.onEvent, collect: gc?.collect, sharedDevice: getWebGpuDevice(),
    settleUploads: !opts['no-settle-uploads'] });
  const { generate } = await import('./static/generate.js');
  const bundle = new Bundle(pathToFileURL(opts.bundle).href + '/');
  const man = await bundle.open();
  const picture = await pictureInput(opts, man); // refused (exit 2) before anything compiles
  const lora = await loraInput(opts, man); // likewise
  const limits = bundleLimits(adapter.limits, parseLimitOverrides(opts.limit));
  const fit = await preflight(bundle, limits, { accelerator: 'webgpu', streamed: opts.unet === 'streamed' });
  const ref = loadReference(opts.bundle);
  const prompt = opts.prompt ?? ref?.prompt ?? bundle.tokenizerBlock.golden?.prompt ?? 'a photograph of an astronaut riding a horse';
  const seed = opts.seed ?? ref?.seed ?? 0;
  const useRef = ref && ref.prompt === prompt && ref.seed === seed;
  const say = (text) => process.stderr.write(`[${((performance.now() - t0) / 1000).toFixed(1)} s] ${text}\n`);
  const res = await generate(bundle, {
    prompt, seed, scale: man.guidance.scale, accelerator: 'webgpu', precision: opts.precision, decoderPrecision: opts['decoder-precision'], goldens: opts.goldens, streamUnet: opts.unet === 'streamed',
    latents: useRef ? ref.latentsData : null, noise: useRef ? ref.noiseData : null, image: picture, lora,
    onStage: (name, s) => say(`${name}: compiled in ${(s.compile_ms ?? 0).toFixed(0)} ms${s.run_ms ? `, ran ${s.run_ms.toFixed(0)} ms` : ''}`),
    onStep: (i, n, ms) => say(`denoising step ${i}/${n} (${ms.toFixed(0)} ms)`),
  });
  const image = { finite: res.image.finite, height: res.image.h, width: res.image.w, min_psnr_db: opts.minPsnr };
  const otherPicture = ref ? pictureMismatch(ref, opts, res.task) ?? loraMismatch(ref, opts, lora) : null;
  if (useRef && !otherPicture) image.psnr_db = imagePsnr(ref.imageData, res.image.img);
  else image.skipped = !ref ? 'no web/reference/ in the bundle (pocketdiff web writes it)' : useRef ? otherPicture : `the reference is for prompt ${JSON.stringify(ref.prompt)}, seed ${ref.seed}`;
  if (opts.image) writePng(opts.image, res.image);
  const tokenizer = tokenizerCheck(bundle, res.tokens);
  const failures = checkFailures(res, tokenizer, image);
  const components = componentReports(res);
  const report = {
    ok: failures.length === 0, failures, runner: 'node', node: process.version, adapter, prompt, seed,
    steps: man.scheduler.timesteps.length, resolution: man.image.width, unet: opts.unet, precision: opts.precision,
    decoder_precision: opts['decoder-precision'],
    latents: useRef ? 'reference/' + ref.latents : 'page noise (seeded)', tokenizer,
    picture: { ...res.task, init_image: opts['init-image'] ?? null, mask: opts.mask ?? null }, components, image,
    lora: lora ? { file: opts.lora, scale: lora.scale } : null,
    latency_ms: { runtime_ready: runtimeMs, ...res.latency }, host_peak_mb: host.processPeakMb(),
    gpu_device: opts['gpu-device'], dawn_toggles: opts['dawn-toggle'], settle_uploads: !opts['no-settle-uploads'], gpu_memory: { ...ledger.summary(), what: 'bytes of WebGPU buffers and textures alive (static/gpu_device.js)' },
    host_per_model_peak_mb: host.peaks, memory_events: host.events, limits, preflight: fit,
    malloc_arena_max: process.env.MALLOC_ARENA_MAX ?? null, // glibc's arenas hold freed native memory (see memory_events)
    devices: { ...deviceCounts, forced_gc: gc ? { runs: gc.stats.runs, ms: Number(gc.stats.ms.toFixed(1)) } : 'off (--no-gc)' },
    wall_s: Number(((performance.now() - t0) / 1000).toFixed(2)),
  };
  const text = JSON.stringify(report, null, 1);
  if (opts.out) fs.writeFileSync(opts.out, text);
  else process.stdout.write(text + '\n');
  say(report.ok ? 'ok' : `failed: ${failures.join('; ')}`);
  return report.ok ? 0 : 1;
}

main().then((code) => process.exit(code), (e) => {
  process.stderr.write(`node_runner: ${e instanceof UsageError || e?.constructor?.name === 'BundleError' ? e.message : e?.stack || e}\n`);
  process.exit(2);
});
