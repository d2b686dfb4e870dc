// The bundle in the browser: the same steps as `pocketdiff run-bundle` (runtime/run_bundle.py)
// on LiteRT.js. The manifest's pipeline block (stages.js; derived for a bundle from before it) says which models run
// in which stage and what feeds each of their inputs, checked before any model loads. Every file is checked against
// the manifest's sha256 before use; the manifest's scheduler
// (schedulers.js: DDIM, or the lcm step) on its timesteps; classifier-free guidance in one batch-2 UNet call or the
// student's embedded guidance; the time embedding looked up in the bundle's table when it was
// computed outside the graph; a UNet or a text encoder in chunks run in sequence (chunks.js). Pipelined
// loading as run-bundle --pipelined: the text encoder (its chunks one after another) loads and runs while
// the UNet downloads and is released before the UNet compiles; the decoder (or the tiled
// decoder's head and up tile, or the up tile's parts, tiled.js) loads during the last denoising step.
import { loadAndCompile, Tensor } from '@litertjs/core';
import { ClipBpe } from './bpe.js';
import { parseNpy, parseNpz } from './npy.js';
import { sha256Hex } from './sha256.js';
import { schedulerProblem } from './schedulers.js';
import { tilingProblem, upPartsProblem } from './tiled.js';
import { layoutProblem } from './chunks.js';
import { BundleError, DECODE, DENOISE, ENCODE_PROMPT, checkPipeline, pipelineOf, stageParts } from './stages.js';
import { consoleMark, consoleSince, prepareFailure } from './prepare.js';
import { modelEvent, openModelGpu, settleUploads } from './gpu_device.js';

export { BundleError };

function safePath(rel, what) {
  if (typeof rel !== 'string' || !rel || rel.startsWith('/') || rel.startsWith('\\') || /^[a-zA-Z]:/.test(rel)
      || rel.split(/[\\/]/).includes('..') || /^[a-z]+:/i.test(rel)) {
    throw new BundleError(`manifest: ${what} path ${JSON.stringify(rel)} escapes the bundle folder`);
  }
  return rel;
}

export class Bundle {
  constructor(base) {
    this.base = base; // URL of the bundle folder (ends with '/')
  }

  async fetchBytes(rel, what) {
    const url = new URL(safePath(rel, what), this.base);
    const res = await fetch(url);
    if (!res.ok) throw new BundleError(`bundle: ${what} file ${rel} could not be read (HTTP ${res.status})`);
    return res.arrayBuffer();
  }

  /** The bytes of a manifest entry, refused when their sha256 differs from the manifest's. */
  async fetchVerified(entry, what) {
    const bytes = await this.fetchBytes(entry.path, what);
    const got = await sha256Hex(bytes);
    if (got !== entry.sha256) {
      throw new BundleError(`bundle: sha256 mismatch for ${entry.path} (${what}): manifest ${String(entry.sha256).slice(0, 12)}..., file ${got.slice(0, 12)}...; the page refuses this bundle`);
    }
    return bytes;
  }

  async open() {
    const text = new TextDecoder().decode(await this.fetchBytes('manifest.json', 'manifest'));
    const man = JSON.parse(text);
    if (man.schema !== 'pocketdiff-bundle') throw new BundleError('manifest.json: not a pocketdiff bundle manifest');
    const layout = layoutProblem(man);
    if (layout) throw new BundleError(layout);
    const schedProblem = schedulerProblem(man.scheduler);
    if (schedProblem) throw new BundleError(schedProblem);
    if (man.vae_tiling) {
      const problem = tilingProblem(man.vae_tiling);
      if (problem) throw new BundleError(problem);
    }
    checkPipeline(man); // stages, roles, the components present, the role-fed shapes: one line, before any model loads
    this.readStages(man);
    const chain = man.vae_tiling ? upPartsProblem(man) : null;
    if (chain) throw new BundleError(chain);
    this.man = man;
    await this.openTokenizers(man);
    this.table = null;
    if (man.time_embedding) {
      this.table = parseNpy(await this.fetchVerified(man.time_embedding, 'time embedding table'), man.time_embedding.path);
    }
    return man;
  }

  /** The pipeline's stages (stages.js) and the models each runs: a component, its chunks, or a tiled decoder's head
   *  and up path (tiled.js); `teParts`, `unetParts` and `decoder` name the encode stages', the denoise stage's and the
   *  decode stage's models in order of use (limits.js preflight reads them). */
  readStages(man) {
    const pipe = pipelineOf(man);
    this.stages = pipe.stages;
    this.conditioning = pipe.conditioning ?? {}; // the block's constants (time_ids)
    this.parts = Object.fromEntries(this.stages.map((s) => [s.stage, stageParts(man, s.component)]));
    this.encoders = this.stages.filter((s) => s.kind === ENCODE_PROMPT);
    this.denoiser = this.stages.find((s) => s.kind === DENOISE);
    this.decodeStage = this.stages.find((s) => s.kind === DECODE);
    this.teParts = this.encoders.flatMap((s) => this.parts[s.stage]);
    this.unetParts = this.parts[this.denoiser.stage];
    this.decoder = this.parts[this.decodeStage.stage];
  }

  /** Each encode stage's tokenizer (its manifest block's tokenizer.json, checked, read once per block); `tokenizer`
   *  and `tokenizerBlock`: the first stage's, whose tokens the page reports. */
  async openTokenizers(man) {
    const byBlock = {};
    this.tokenizers = {};
    for (const s of this.encoders) {
      if (!byBlock[s.tokenizer]) {
        const block = man[s.tokenizer];
        const bytes = await this.fetchVerified(block.files['tokenizer.json'], 'tokenizer file tokenizer.json');
        byBlock[s.tokenizer] = new ClipBpe(JSON.parse(new TextDecoder().decode(bytes)), block);
      }
      this.tokenizers[s.stage] = byBlock[s.tokenizer];
    }
    this.tokenizerBlock = man[this.encoders[0].tokenizer];
    this.tokenizer = this.tokenizers[this.encoders[0].stage];
  }

  async golden(name) {
    const g = this.man.components[name].golden;
    if (!g) return null;
    return parseNpz(await this.fetchVerified(g, `golden of ${name}`), g.path);
  }
}

/** A compiled component. Loading is split in two, because in a page only the download
 *  overlaps other work: `fetch` (network + sha256) can run beside a UNet step, while wasm
 *  compilation holds the page's one thread. */
export class Component {
  static fetch(bundle, name) {
    const t0 = performance.now();
    // `streamable`: a chunk of the denoiser, which the page option unet=streamed compiles one at a time
    const streamable = bundle.unetParts.length > 1 && bundle.unetParts.includes(name);
    return bundle.fetchVerified(bundle.man.components[name], `component ${name}`).then((bytes) => ({ name, bytes, fetchMs: performance.now() - t0, streamable }));
  }

  /** `precision` (webgpu): 'fp32', LiteRT.js's default, or 'fp16', its weights and activations at half precision
   *  (rgba16float weight textures: half the GPU memory). */
  static async compile(fetched, accelerator, precision = 'fp32') {
    const c = new Component();
    const { name, bytes, fetchMs, streamable } = await fetched;
    c.name = name;
    c.streamable = Boolean(streamable);
    c.accelerator = accelerator;
    c.precision = precision;
    const t1 = performance.now();
    c.consoleMark = consoleMark(); // what LiteRT.js prints from here to the first run's end is checked (prepare.js)
    modelEvent('open', name); // memory sampled at open, compiled and close (gpu_device.js; the Node runner's report)
    c.opened = true;
    c.gpu = accelerator === 'webgpu' ? await openModelGpu(name) : null; // its own WebGPU device, or null: the default (gpu_device.js)
    try {
      const gpuOptions = accelerator === 'webgpu' ? { gpuOptions: { precision } } : {};
      c.model = await loadAndCompile(new Uint8Array(bytes), c.gpu ? { accelerator, environment: c.gpu.environment, ...gpuOptions } : { accelerator, ...gpuOptions });
      modelEvent('compiled', name);
      await settleUploads(name, c.gpu);
    } catch (e) {
      c.release();
      throw e;
    }
    try {
      c.checkPrepared();
    } catch (e) {
      c.release();
      throw e;
    }
    c.fetchMs = fetchMs;
    c.compileMs = performance.now() - t1;
    c.fullyAccelerated = accelerator === 'webgpu' ? Boolean(c.model.isFullyAccelerated) : false;
    c.runMs = [];
    return c;
  }

  /** feeds: name -> {data: TypedArray, shape}; returns the first output, {data: Float32Array, shape}. */
  async run(feeds) {
    return (await this.runAll(feeds))[0];
  }

  /** Every output, in the model's order: [{data: Float32Array, shape}]. */
  async runAll(feeds) {
    const names = Object.keys(feeds);
    const inputs = [];
    try {
      this.model.getInputDetails().forEach((d, i) => {
        const f = feeds[d.name] ?? feeds[names[i]];
        const shape = Array.from(d.shape);
        if (!f) throw new BundleError(`${this.name}: no value for input ${d.name}`);
        if (f.shape.join(',') !== shape.join(',')) {
          throw new BundleError(`${this.name}: input ${d.name} has shape [${f.shape}], the model takes [${shape}]`);
        }
        const data = d.dtype === 'int32' ? Int32Array.from(f.data) : Float32Array.from(f.data);
        inputs.push(new Tensor(data, shape, this.gpu?.environment));
      });
      const t0 = performance.now();
      let dev = inputs;
      if (this.accelerator === 'webgpu') dev = await Promise.all(inputs.map((t) => t.copyTo('webgpu', this.gpu ? { environment: this.gpu.environment } : undefined)));
      const outs = await this.model.run(dev);
      if (this.consoleMark !== null) this.checkPrepared(true); // the first run: XNNPACK may prepare lazily
      const host = await Promise.all(outs.map((o) => (o.accelerator === 'wasm' ? o : o.copyTo('wasm'))));
      const details = this.model.getOutputDetails();
      const results = host.map((o, i) => ({ data: Float32Array.from(o.toTypedArray()), shape: Array.from(details[i].shape) }));
      this.runMs.push(performance.now() - t0);
      for (const t of new Set([...dev, ...outs, ...host])) if (!t.deleted) t.delete();
      return results;
    } finally {
      for (const t of inputs) if (!t.deleted) t.delete();
    }
  }

  /** A BundleError naming the component when LiteRT.js printed that it could not prepare the model; after
   *  the first run (`done`) the console is no longer watched. */
  checkPrepared(done = false) {
    const bad = prepareFailure(consoleSince(this.consoleMark));
    if (done) this.consoleMark = null;
    if (bad) {
      throw new BundleError(`${this.name}: LiteRT.js could not prepare the model on ${this.accelerator === 'webgpu' ? 'WebGPU' : 'the wasm CPU path'} `
        + `(it said: ${bad.replace(/^\s*(error:\s*)?/, '').trim()}); a model this size does not fit LiteRT.js's 2 GB wasm heap`
        + (this.streamable ? ' (with the other chunks held: the page option unet=streamed compiles one chunk at a time)' : ''));
    }
  }

  /** Frees the compiled model, and its own WebGPU device with all it held (gpu_device.js). Never throws: a model LiteRT.js failed to prepare can fail to delete
   *  ("null function"), and that must not hide the failure that brought the page here. */
  release() {
    try {
      if (this.model && !this.model.deleted) this.model.delete();
    } catch (e) {
      console.warn(`${this.name}: releasing the model failed: ${e.message}`);
    }
    this.model = null;
    try {
      this.gpu?.close();
    } catch (e) {
      console.warn(`${this.name}: destroying its WebGPU device failed: ${e.message}`);
    }
    this.gpu = null;
    if (this.opened) modelEvent('close', this.name);
    this.opened = false;
  }
}

/** Cosine, PSNR (reference's peak-to-peak range) and max-abs, as runtime/parity.py. */
export function parity(ref, out) {
  if (ref.length !== out.length) throw new BundleError(`output has ${out.length} values, reference ${ref.length}`);
  let nonfinite = 0;
  for (const v of out) if (!Number.isFinite(v)) nonfinite++;
  if (nonfinite) return { finite: false, nonfinite, cosine: null, psnr_db: null, max_abs: null };
  let dot = 0, nr = 0, no = 0, se = 0, mx = 0, lo = Infinity, hi = -Infinity;
  for (let i = 0; i < ref.length; i++) {
    const r = ref[i], o = out[i], d = o - r;
    dot += r * o; nr += r * r; no += o * o; se += d * d;
    mx = Math.max(mx, Math.abs(d)); lo = Math.min(lo, r); hi = Math.max(hi, r);
  }
  const denom = Math.sqrt(nr) * Math.sqrt(no);
  const cosine = denom > 0 ? dot / denom : (se === 0 ? 1 : 0);
  const mse = se / ref.length;
  const peak = hi - lo;
  const psnr = mse === 0 ? Infinity : (peak === 0 ? -Infinity : 10 * Math.log10(peak * peak / mse));
  return { finite: true, nonfinite: 0, cosine, psnr_db: psnr, max_abs: mx };
}

/** Image PSNR with data range 1 (images in [0, 1]). */
export function imagePsnr(ref, out) {
  let se = 0;
  for (let i = 0; i < ref.length; i++) se += (out[i] - ref[i]) ** 2;
  const mse = se / ref.length;
  return mse === 0 ? Infinity : 10 * Math.log10(1 / mse);
}

/** The tokenizer's part of a check: its tokens for the prompt, and whether the manifest's golden
 *  prompt still encodes to the manifest's ids (null when the bundle has none). */
export function tokenizerCheck(bundle, tokens) {
  const golden = bundle.tokenizerBlock.golden;
  const ids = golden ? Array.from(bundle.tokenizer.encode(golden.prompt).ids) : null;
  return { tokens: tokens.tokens, truncated: tokens.truncated, golden_ids_match: golden ? ids.join(',') === golden.ids.join(',') : null };
}

/** Each stage's report with its golden-vector check (or why there was none), as a check run reports them. */
export function componentReports(res) {
  return Object.fromEntries(Object.entries(res.stages).map(([name, s]) => [name, { ...s, golden: res.golden[name] || { skipped: 'not run' } }]));
}

/** What a check run failed on, one line each: a stage not fully accelerated (when `accelerated`
 *  is asked), a golden vector outside its tolerances, the tokenizer's golden ids, a non-finite
 *  image, and the image's PSNR against the reference where one was compared. Shared by the
 *  page's check mode (app.js) and the Node runner, so both judge alike. */
export function checkFailures(res, tokenizer, image, { accelerated = true } = {}) {
  const failures = [];
  for (const [name, s] of Object.entries(res.stages)) {
    const g = res.golden[name];
    if (accelerated && !s.fully_accelerated) failures.push(`${name}: not fully accelerated`);
    if (g && !g.skipped && !g.pass) failures.push(`${name}: golden vector cosine ${g.cosine} / PSNR ${g.psnr_db} dB outside the ${g.precision} tolerances`);
  }
  if (tokenizer.golden_ids_match === false) failures.push('tokenizer: the golden prompt\'s ids differ from the manifest\'s');
  if (!image.finite) failures.push('image: NaN/Inf values');
  if (image.psnr_db !== undefined && !(image.psnr_db >= image.min_psnr_db)) {
    failures.push(`image: PSNR ${image.psnr_db.toFixed(2)} dB against the reference < ${image.min_psnr_db}`);
  }
  return failures;
}

/** Seeded standard normal noise (mulberry32 + Box-Muller). Not numpy's stream: a page and
 *  run-bundle share noise only through a latents file (the reference's). */
export function pageNoise(seed, n) {
  let a = seed >>> 0;
  const rand = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const out = new Float32Array(n);
  for (let i = 0; i < n; i += 2) {
    const u = Math.max(rand(), 1e-12), v = rand();
    const r = Math.sqrt(-2 * Math.log(u));
    out[i] = r * Math.cos(2 * Math.PI * v);
    if (i + 1 < n) out[i + 1] = r * Math.sin(2 * Math.PI * v);
  }
  return out;
}

/** Decoder output [1, 3, H, W] -> HWC in [0, 1] (clipped, as run-bundle writes its PNG). */
export function toHwc(data, shape) {
  const [, c, h, w] = shape;
  const img = new Float32Array(h * w * c);
  let nonfinite = 0;
  for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) for (let k = 0; k < c; k++) {
    const v = data[(k * h + y) * w + x];
    if (!Number.isFinite(v)) nonfinite++;
    img[(y * w + x) * c + k] = Math.min(1, Math.max(0, v));
  }
  return { img, h, w, c, finite: nonfinite === 0 };
}
