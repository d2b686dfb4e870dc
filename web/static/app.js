// The page: prompt -> image from the bundle this folder sits in (web/ inside the bundle).
// index.html?check=1&prompt=P&seed=S runs on its own and writes a JSON summary into #result;
// with report=PATH it also POSTs that JSON to PATH on the serving origin.
import { loadLiteRt, getWebGpuDevice } from '@litertjs/core';
import { Bundle, imagePsnr, tokenizerCheck, checkFailures, componentReports } from './pipeline.js';
import { generate } from './generate.js';
import { installConsoleTap } from './prepare.js';
import { GpuLedger, useModelDevices } from './gpu_device.js';
import { bundleLimits, parseLimitOverrides, preflight } from './limits.js';
import { PictureControls, pictureMismatch } from './picture_ui.js';
import { LoraControls, loraMismatch } from './lora_ui.js';

installConsoleTap(); // before LiteRT.js loads and binds console.error (prepare.js)

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const CHECK = params.get('check') === '1';
const MIN_IMAGE_PSNR_DB = Number(params.get('min_image_psnr') ?? 30);
// ?unet=streamed: a chunked UNet's chunks compiled for each step and released after it (they do not fit together)
const STREAM_UNET = params.get('unet') === 'streamed';
// each model's WebGPU device destroyed when it is released (gpu_device.js); ?gpu_device=shared: LiteRT.js's one device
const GPU_DEVICE = params.get('gpu_device') === 'shared' ? 'shared' : 'per-model';
// ?precision=fp16: the text encoder and UNet on LiteRT.js's WebGPU path at half precision (their weight textures half
// the GPU memory; the decoder stays fp32, generate.js); fp32: LiteRT.js's default. ?decoder_precision=fp16: the decoder
// too, for a bundle exported with the decoder's 3x3 convs lowered (rewrites.conv_lowering_components: [vae_decoder])
const PRECISION = params.get('precision') === 'fp16' ? 'fp16' : 'fp32';
const DECODER_PRECISION = params.get('decoder_precision') === 'fp16' ? 'fp16' : 'fp32';
const ledger = new GpuLedger();
let fit = null; // limits.js preflight's sizes of each component
let fitFor = null; // {accelerator, limits} that preflight checked: another accelerator chosen later is checked again
const bundle = new Bundle(new URL(params.get('bundle') || '../', location.href));
let reference = null;
let picture = null; // the picture controls (picture_ui.js): img2img / inpainting where the bundle has an encoder
let lora = null; // the LoRA controls (lora_ui.js): a LoRA fed to a bundle exported with lora_slots
let webgpu = { available: false, adapter: null, reason: null };

function status(text, cls = '') {
  $('status').textContent = text;
  if (CHECK) console.info(`status: ${text}`); // a headless runner can follow a long check
  $('status').className = cls;
}

async function probeWebGpu() {
  if (!window.isSecureContext) return { available: false, reason: 'not a secure context (WebGPU needs https or localhost)' };
  if (!navigator.gpu) return { available: false, reason: 'this browser has no WebGPU (navigator.gpu is missing)' };
  try {
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) return { available: false, reason: 'WebGPU found no GPU adapter' };
    const info = adapter.info || {};
    const limits = { maxStorageBufferBindingSize: adapter.limits.maxStorageBufferBindingSize, maxBufferSize: adapter.limits.maxBufferSize };
    return { available: true, adapter: { vendor: info.vendor, architecture: info.architecture, description: info.description, limits } };
  } catch (e) {
    return { available: false, reason: `WebGPU adapter request failed: ${e.message}` };
  }
}

async function loadReference() {
  try {
    const res = await fetch('reference/reference.json');
    if (!res.ok) return null;
    const ref = await res.json();
    const bin = async (rel) => new Float32Array(await (await fetch(`reference/${rel}`)).arrayBuffer());
    ref.latentsData = await bin(ref.latents);
    ref.noiseData = ref.noise ? await bin(ref.noise) : null; // an lcm bundle's re-noising draws
    ref.imageData = await bin(ref.image);
    return ref;
  } catch {
    return null;
  }
}

function showStage(name, s) {
  let row = document.querySelector(`tr[data-stage="${name}"]`);
  if (!row) {
    row = document.createElement('tr');
    row.dataset.stage = name;
    $('stage-rows').appendChild(row);
  }
  const ms = (v) => (v ? `${v.toFixed(0)} ms` : '');
  const fa = s.accelerator === 'webgpu' ? (s.fully_accelerated ? '<span class="yes">yes</span>' : '<span class="no">no (fell back)</span>') : 'n/a (CPU)';
  row.innerHTML = `<td>${name}</td><td>${s.accelerator === 'webgpu' ? 'GPU (WebGPU)' : 'CPU (wasm)'}</td><td>${fa}</td><td>${ms(s.fetch_ms)}</td><td>${ms(s.compile_ms)}</td><td>${ms(s.run_ms)}</td>`;
}

function draw(image) {
  const cv = $('image');
  cv.width = image.w;
  cv.height = image.h;
  const ctx = cv.getContext('2d');
  const id = ctx.createImageData(image.w, image.h);
  for (let p = 0; p < image.w * image.h; p++) {
    for (let k = 0; k < 3; k++) id.data[4 * p + k] = Math.round(image.img[p * image.c + k] * 255);
    id.data[4 * p + 3] = 255;
  }
  ctx.putImageData(id, 0, 0);
}

async function run(prompt, seed) {
  const accelerator = $('accelerator').value;
  const scale = Number($('guidance').value);
  const useRef = reference && reference.seed === seed;
  $('stage-rows').innerHTML = '';
  const res = await generate(bundle, {
    prompt, seed, scale, accelerator, precision: PRECISION, decoderPrecision: DECODER_PRECISION, goldens: CHECK, streamUnet: STREAM_UNET,
    latents: useRef ? reference.latentsData : null, // from a picture: the noise it is noised with
    image: picture?.input() ?? null,
    lora: lora?.input() ?? null, // read at each image: swapped without reloading models
    noise: useRef ? reference.noiseData : null,
    onStage: showStage,
    onStep: (i, n, ms) => status(`denoising step ${i}/${n} (${ms.toFixed(0)} ms)`),
  });
  draw(res.image);
  const t = res.tokens;
  $('prompt-note').hidden = t.truncated === 0;
  $('prompt-note').textContent = t.truncated
    ? `The prompt has ${t.tokens} tokens; the text encoder takes ${bundle.tokenizerBlock.max_length - 2}: the last ${t.truncated} were dropped (as the Python runner does).`
    : '';
  const L = res.latency;
  $('latency').textContent = `total ${L.total_ms.toFixed(0)} ms, UNet ${L.unet_step_mean_ms.toFixed(1)} ms/step over ${L.unet_steps_ms.length} steps`;
  status(`done in ${(L.total_ms / 1000).toFixed(2)} s`);
  return { res, latentsSource: useRef ? `reference/${reference.latents}` : 'page noise (seeded; not numpy\'s)' };
}

function summary(prompt, seed, out, runtimeMs) {
  const man = bundle.man;
  const { res } = out;
  const failures = [];
  const accelerator = $('accelerator').value;
  if (accelerator !== 'webgpu') failures.push(`ran on ${accelerator}, not WebGPU (${webgpu.reason || 'chosen on the page'})`);
  const components = componentReports(res);
  const tokenizer = tokenizerCheck(bundle, res.tokens);
  const image = { finite: res.image.finite, height: res.image.h, width: res.image.w, min_psnr_db: MIN_IMAGE_PSNR_DB };
  const otherPicture = reference ? pictureMismatch(reference, res.task, picture, location.href) ?? loraMismatch(reference, lora, location.href) : null;
  if (reference && reference.prompt === prompt && reference.seed === seed && !otherPicture) {
    image.reference = `reference/${reference.image}`;
    image.reference_made_by = reference.made_by;
    image.psnr_db = imagePsnr(reference.imageData, res.image.img);
  } else {
    image.skipped = !reference ? 'no reference/ in this page (pocketdiff web --no-reference)'
      : reference.prompt !== prompt || reference.seed !== seed ? `the reference is for prompt ${JSON.stringify(reference.prompt)}, seed ${reference.seed}` : otherPicture;
  }
  failures.push(...checkFailures(res, tokenizer, image, { accelerated: accelerator === 'webgpu' }));
  const nav = performance.getEntriesByType('navigation')[0];
  return {
    ok: failures.length === 0,
    failures,
    prompt, seed,
    steps: man.scheduler.timesteps.length,
    guidance: { mode: man.guidance.mode, scale: Number($('guidance').value) },
    accelerator,
    unet: STREAM_UNET ? 'streamed' : 'resident',
    precision: PRECISION,
    decoder_precision: DECODER_PRECISION,
    gpu_device: GPU_DEVICE,
    gpu_memory: { ...ledger.summary(), what: 'bytes of WebGPU buffers and textures alive (gpu_device.js)' },
    preflight: fit,
    webgpu,
    latents: out.latentsSource,
    picture: picture.describe(res.task), // the task, strength and steps run, and the picture and mask
    lora: lora.describe(), // the LoRA fed to the slots and its scale (null: none)
    tokenizer,
    components,
    image,
    latency_ms: {
      page_load: nav ? nav.loadEventEnd || nav.domContentLoadedEventEnd : null,
      runtime_ready: runtimeMs,
      ...res.latency,
    },
    notes: ['webgpu-note', 'prompt-note'].filter((id) => !$(id).hidden).map((id) => $(id).textContent),
    user_agent: navigator.userAgent,
  };
}

async function report(result) {
  $('check').hidden = false;
  $('result').textContent = JSON.stringify(result, null, 1);
  const c = result.components || {};
  const gold = Object.entries(c).map(([n, v]) => `${n} cos ${v.golden?.cosine?.toFixed(6) ?? '-'}`).join(', ');
  const img = result.image?.psnr_db !== undefined ? `; image vs run-bundle ${result.image.psnr_db.toFixed(1)} dB` : '';
  $('check-verdict').className = result.ok ? 'yes' : 'error';
  $('check-verdict').textContent = result.ok ? `ok: every component fully accelerated, goldens within tolerance (${gold})${img}` : `failed: ${result.failures.join('; ')}`;
  const path = params.get('report');
  if (!path) return;
  const url = new URL(path, location.origin);
  if (url.origin !== location.origin) {
    $('result').textContent += '\nreport: refused (only paths on the serving origin)';
    return;
  }
  await fetch(url, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(result) });
}

async function main() {
  const t0 = performance.now();
  let man;
  try {
    webgpu = await probeWebGpu();
    if (!webgpu.available) {
      $('webgpu-note').hidden = false;
      $('webgpu-note').textContent = `No WebGPU here: ${webgpu.reason}. The page can still run the bundle on the CPU (wasm, slower); choose "CPU (wasm)" above.`;
      $('accelerator').value = 'wasm';
    }
    if (params.get('accelerator')) $('accelerator').value = params.get('accelerator');
    await loadLiteRt(new URL('litertjs/core/wasm/', location.href).href);
    useModelDevices({ perModel: GPU_DEVICE === 'per-model', ledger, sharedDevice: getWebGpuDevice() });
    man = await bundle.open();
    // every component checked against the adapter's limits and the wasm heap before anything compiles (limits.js;
    // ?limit=NAME:BYTES lowers one, for tests)
    const limits = bundleLimits(webgpu.adapter?.limits, parseLimitOverrides(params.getAll('limit')));
    fit = await preflight(bundle, limits, { accelerator: $('accelerator').value, streamed: STREAM_UNET });
    fitFor = { accelerator: $('accelerator').value, limits };
    reference = await loadReference();
    picture = new PictureControls($, man);
    await picture.fromParams(params, location.href); // ?init_image=URL&mask=URL&strength=S
    lora = new LoraControls($, man);
    await lora.fromParams(params, location.href); // ?lora=URL&lora_scale=S
  } catch (e) {
    status(`error: ${e.message}`, 'error');
    if (CHECK) await report({ ok: false, failures: [e.message], error: e.message, webgpu });
    return;
  }
  const runtimeMs = performance.now() - t0;
  const weights = Object.entries(man.components).map(([n, c]) => `${n} ${c.weights}`).join(', ');
  $('bundle-info').textContent = `${man.provenance?.source ?? 'bundle'}: ${man.image.width}x${man.image.height} px, ${man.scheduler.timesteps.length} DDIM steps, ${weights}`;
  $('steps').value = man.scheduler.timesteps.length;
  $('guidance').value = man.guidance.scale;
  if (man.guidance.mode === 'cfg') {
    $('guidance-note').textContent = 'Classifier-free guidance: the UNet runs on the prompt and the empty prompt in one batch-2 call.';
  } else {
    $('guidance').readOnly = true;
    $('guidance-note').textContent = man.guidance.mode === 'embedded'
      ? `Guidance is embedded in the distilled student (w = ${man.guidance.scale}, fixed at export).`
      : 'This bundle runs without guidance.';
  }
  if (reference) {
    $('prompt').value = reference.prompt;
    $('seed').value = reference.seed;
  }
  if (params.has('prompt')) $('prompt').value = params.get('prompt');
  if (params.has('seed')) $('seed').value = params.get('seed');
  if (params.has('scale') && man.guidance.mode === 'cfg') $('guidance').value = params.get('scale');
  status(`ready (LiteRT.js loaded in ${runtimeMs.toFixed(0)} ms)`);
  const go = async () => {
    $('generate').disabled = true;
    const prompt = $('prompt').value;
    const seed = Number($('seed').value) | 0;
    try {
      if ($('accelerator').value !== fitFor.accelerator) { // the limits differ (the CPU path binds no GPU buffers)
        fit = await preflight(bundle, fitFor.limits, { accelerator: $('accelerator').value, streamed: STREAM_UNET });
        fitFor = { ...fitFor, accelerator: $('accelerator').value };
      }
      const out = await run(prompt, seed);
      if (CHECK) await report(summary(prompt, seed, out, runtimeMs));
    } catch (e) {
      status(`error: ${e.message}`, 'error');
      console.error(e);
      if (CHECK) await report({ ok: false, failures: [e.message], error: e.message, prompt, seed, webgpu });
    } finally {
      $('generate').disabled = false;
    }
  };
  $('generate').disabled = false;
  $('generate').addEventListener('click', go);
  if (CHECK) await go();
}

main();
