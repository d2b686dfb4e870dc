// One prompt through the bundle's pipeline (stages.js: its encode-prompt stages, the denoise stage, the decode stage),
// pipelined as `run-bundle --pipelined` (a tiled decoder as tiled.js, a UNet or a text encoder in chunks as chunks.js).
// Every model's feeds are built from its stage by role (runtime/pipeline.py's twin): token ids from the stage's
// tokenizer, prompt roles from the encode stages (stacked by the declared guidance, stages.js Guidance), the latents,
// the timestep or its row of the time-embedding table, the block's constants.
import { BundleError, Component, pageNoise, parity, toHwc } from './pipeline.js';
import { StreamedChunk, chunkAliases, goldenIndices, outputNames, runParts, runPartsOnEach } from './chunks.js';
import { schedulerFor } from './schedulers.js';
import { ONE_PASS, UP_TILE, onePassDecode, statsDecode } from './tiled.js';
import { halfPrecisionProblem } from './prepare.js';
import { ImageStart, encodeImage, imagePlan } from './image_input.js';
import { Guidance, PROMPT, REGISTRY, ROLES, concatLast, inpaintingRoles, pipelineOf } from './stages.js';
import { loraFeeds } from './lora.js';

export const DECODER_PRECISION = 'fp32'; // the decoder's precision unless opts.decoderPrecision says otherwise

/** Stop with one line when a model at half precision returned NaN/Inf (prepare.js), not with a wrong image. */
function requireFinite(what, data, precision) {
  const problem = halfPrecisionProblem(what, data, precision);
  if (problem) throw new BundleError(problem);
}

/** The graph inputs of a stage fed `role`. */
function fedBy(stage, role) {
  return Object.keys(stage.inputs).filter((name) => stage.inputs[name] === role);
}

/** Latents -> pixels [1, 3, H, W] through the whole decoder, or the tiled one (tiled.js). `fetches`: the decoder's
 *  components fetched (bundle.decoder's order); `open(fetched)` compiles one, golden-checked, to run; `fed`: the
 *  decoder's (or its head's) input of role latents. A tiled decoder's head compiles, runs once on the whole latent and
 *  is released before its up path compiles, so no two decoder graphs are on the GPU together. */
async function decode(man, fetches, open, latents, fed) {
  if (fetches.length === 1) return (await open(fetches[0])).run({ [fed]: latents });
  const head = await open(fetches[0]);
  const feats = await head.run({ [fed]: latents });
  head.release(); // its memory back before the up path compiles (release is idempotent)
  const block = man.vae_tiling, runHead = async () => feats;
  if ((block.scheme ?? 'plain') === ONE_PASS) return onePassDecode(latents, runHead, upPartRunners(man, fetches.slice(1), open), block);
  const up = await open(fetches[1]);
  // the manifest declares (pixels, sums) in that order; the model may return them in the other
  const declared = man.components[up.name].outputs;
  const names = outputNames(up, declared);
  const [pixelsAt, sumsAt] = declared.map((o) => names.indexOf(o.name));
  const [fName, wName, sName, oName] = REGISTRY[UP_TILE].inputs; // the up tile's: features, weight, stats, own
  return statsDecode(latents, runHead, async (features, weight, stats, own) => {
    const outs = await up.runAll({ [fName]: features, [wName]: weight, [sName]: stats, [oName]: own });
    return { pixels: outs[pixelsAt], sums: outs[sumsAt] };
  }, block);
}

/** The one-pass up path's parts (vae_up_tile, or vae_up_tile.0 ... K-1) as onePassDecode's part runners: part k
 *  compiles (with its golden check), runs on every tile in order and is released before part k + 1 compiles; the
 *  tiles' outputs wait in memory. Each compiled part gets `calls`, the tiles it ran. */
function upPartRunners(man, fetches, open) {
  return fetches.map((fetched) => async (tiles) => {
    const c = await open(fetched);
    try {
      const input = man.components[c.name].inputs[0].name; // features, or hidden after part 0 (tiled.js upPartsProblem)
      const out = [];
      for (const t of tiles) out.push(await c.run({ [input]: t }));
      c.calls = tiles.length;
      return out;
    } finally {
      c.release();
    }
  });
}

/** One generation's bookkeeping: per model the stage table (accelerator, precision, fetch, compile and run times,
 *  reported as they come through opts.onStage), the golden checks (check mode: opts.goldens) and the latency. */
class RunLog {
  constructor(bundle, opts) {
    this.bundle = bundle;
    this.man = bundle.man;
    this.opts = opts;
    this.stages = {};
    this.golden = {};
    this.latency = {};
    this.goldenMs = 0; // check mode's golden runs, kept out of the generation latency
    this.note = opts.onStage || (() => {});
  }

  compile(fetched, precision = this.opts.precision) {
    return Component.compile(fetched, this.opts.accelerator, precision);
  }

  record(c) {
    this.stages[c.name] = { accelerator: c.accelerator, precision: c.precision, fully_accelerated: c.fullyAccelerated, fetch_ms: c.fetchMs, compile_ms: c.compileMs, run_ms: 0 };
    this.note(c.name, this.stages[c.name]);
  }

  /** A model's runs added up into its row (with `more`), reported. */
  ran(c, more = {}) {
    Object.assign(this.stages[c.name], { run_ms: c.runMs.reduce((a, b) => a + b, 0) }, more);
    this.note(c.name, this.stages[c.name]);
  }

  async checkGolden(c) {
    if (!this.opts.goldens) return;
    const tg = performance.now();
    try {
      await this.runGolden(c);
    } finally {
      this.goldenMs += performance.now() - tg;
    }
  }

  async runGolden(c) {
    const man = this.man;
    const g = await this.bundle.golden(c.name);
    if (!g) { this.golden[c.name] = { skipped: 'the manifest has no golden vectors for this component' }; return; }
    const feeds = {};
    for (const [k, v] of Object.entries(g)) if (k.startsWith('input_')) feeds[k.slice(6)] = v;
    const outs = await c.runAll(feeds);
    const firstRunMs = c.runMs.pop(); // golden runs are not part of the generation latency
    const precision = c.accelerator === 'webgpu' ? 'fp16' : 'fp32';
    const tol = man.components[c.name].golden.tolerances?.[precision] || {};
    // a UNet chunk has several outputs, which the model may return in another order than the golden's output_J
    // (the manifest's declared order): matched by name
    const at = outs.length > 1 ? goldenIndices(outputNames(c, man.components[c.name].outputs), man.components[c.name].outputs) : [0];
    const m = worstParity(outs.map((o, i) => parity(g[`output_${at[i]}`].data, o.data)));
    const pass = m.finite && m.cosine >= (tol.cosine_min ?? 0.999) && m.psnr_db >= (tol.psnr_min_db ?? 30);
    // the first run of a compiled model also builds its GPU pipelines (shader compilation)
    this.golden[c.name] = { ...m, precision, tolerances: tol, pass, first_run_ms: firstRunMs };
  }

  /** A fetched model as a part opened once (chunks.js runPartsOnEach's protocol): compiled, recorded and
   *  golden-checked at open, its runs recorded and released at close. */
  onceOpened(fetched) {
    let c = null;
    return {
      open: async () => {
        c = await this.compile(fetched);
        this.record(c);
        await this.checkGolden(c);
        return c;
      },
      close: () => {
        if (!c) return;
        this.ran(c);
        c.release();
        c = null;
      },
      outputNames: (comp) => outputNames(comp, this.man.components[comp.name].outputs),
    };
  }
}

/** Each model of `names` fetched (sha256-checked) from now on; an early failure waits for its await. */
function startFetches(bundle, names) {
  const fetches = names.map((name) => Component.fetch(bundle, name));
  for (const p of fetches) p.catch(() => {});
  return fetches;
}

/** Per encode stage, the tokens of each prompt it runs on (the prompt, then for cfg the empty one). */
function tokenRows(bundle, guidance, prompt) {
  const prompts = guidance.prompts(prompt);
  return Object.fromEntries(bundle.encoders.map((s) => [s.stage, prompts.map((p) => bundle.tokenizers[s.stage].encode(p))]));
}

/** One encode stage on each prompt's tokens: each part compiled in turn, golden-checked, run on every prompt and
 *  released before the next compiles (chunks.js runPartsOnEach); per prompt, its outputs in the stage's role order. */
async function encodeStage(log, stage, rows, fetches) {
  const man = log.man, comp = stage.component;
  const fed = fedBy(stage, 'token_ids');
  const feeds = rows.map((p) => Object.fromEntries(fed.map((name) => [name, { data: p.ids, shape: [1, p.ids.length] }])));
  const every = stage.outputs.length > 1;
  const outs = await runPartsOnEach(fetches.map((f) => log.onceOpened(f)), feeds, chunkAliases(man, comp), comp, every);
  const parts = log.bundle.parts[stage.stage];
  const declared = man.components[parts[parts.length - 1]].outputs.map((o) => o.name);
  const values = every ? outs.map(({ outs: o, names }) => declared.map((d) => o[names.indexOf(d)])) : outs.map((o) => [o]);
  for (const row of values) for (const t of row) requireFinite(comp, t.data, log.opts.precision);
  return values;
}

/** Every prompt role the encode stages make, stacked as the UNet's batch ([uncond, cond] for cfg); a role two stages
 *  make is their outputs joined on the last axis, in stage order. */
async function encodePrompts(log, guidance, rows, encFetches) {
  const perRole = {};
  for (const [k, stage] of log.bundle.encoders.entries()) {
    const values = await encodeStage(log, stage, rows[stage.stage], encFetches[k]);
    stage.outputs.forEach((r, j) => {
      const got = values.map((row) => row[j]);
      perRole[r] = perRole[r] ? perRole[r].map((a, i) => concatLast(a, got[i])) : got;
    });
  }
  return Object.fromEntries(Object.entries(perRole).map(([r, v]) => [r, guidance.stack(v)]));
}

/** The denoiser's models: kept resident from the last prompt (same accelerator and precision), streamed (its chunks
 *  compiled for each use: they do not fit the page's memory together; their verified bytes, fetched once, serve every
 *  later prompt: bundle.streamedBytes), or fetched now. */
function denoiserFetches(bundle, opts) {
  const streamed = Boolean(opts.streamUnet) && bundle.unetParts.length > 1;
  let kept = bundle.residentUnet;
  if (kept && (streamed || kept[0].accelerator !== opts.accelerator || kept[0].precision !== (opts.precision ?? 'fp32'))) {
    for (const c of kept) c.release();
    kept = bundle.residentUnet = null;
  }
  if (!streamed) bundle.streamedBytes = null;
  const fetches = kept ? null
    : streamed && bundle.streamedBytes ? bundle.streamedBytes.map((f) => Promise.resolve({ ...f, fetchMs: 0 }))
      : bundle.unetParts.map((name) => Component.fetch(bundle, name));
  for (const p of fetches || []) p.catch(() => {}); // awaited later; an early failure must not go unhandled
  return { streamed, kept, fetches };
}

/** The denoiser's models into `unet`: streamed chunks (each compiled once for its golden check), or compiled ones
 *  (kept from the last prompt, or compiled now), recorded and golden-checked. */
async function openDenoiser(log, unet, den) {
  if (den.streamed) {
    await openStreamedChunks(unet, den.fetches, (f) => log.compile(f), log);
    log.bundle.streamedBytes = unet.map((part) => part.fetched);
    return;
  }
  if (!den.kept) for (const p of den.fetches) unet.push(await log.compile(p));
  for (const c of unet) {
    if (den.kept) {
      c.fetchMs = 0;
      c.compileMs = 0;
      c.runMs = [];
    }
    log.record(c);
    log.stages[c.name].resident = Boolean(den.kept);
  }
  for (const c of unet) await log.checkGolden(c);
}

/** The denoise stage's feeds of one step, by role, in its inputs' order: the step's latents and timestep (or its row
 *  of the time-embedding table) batched, and `fixed`, the per-prompt roles and constants (the same every step). */
function stepFeeds(stage, guidance, fixed, x, t, table, latentShape) {
  const feeds = {};
  for (const [name, r] of Object.entries(stage.inputs)) {
    if (Object.hasOwn(fixed, name)) feeds[name] = fixed[name];
    else if (r === 'latents') feeds[name] = guidance.repeat({ data: x, shape: latentShape });
    else if (r === 'timestep') feeds[name] = { data: new Float32Array(guidance.batch).fill(t), shape: [guidance.batch] };
    else if (r === 'timestep_embedding') {
      const D = table.shape[1];
      feeds[name] = guidance.repeat({ data: table.data.subarray(t * D, (t + 1) * D), shape: [1, D] });
    }
  }
  return feeds;
}

/** The denoise stage's inputs that stay the same at every step: the prompt roles, the block's constants and an
 *  inpainting UNet's mask and masked-picture latents (`picture`, by role). */
function fixedFeeds(bundle, stage, guidance, cond, lora, picture = null) {
  const ids = bundle.conditioning?.time_ids;
  const constants = Array.isArray(ids) ? { time_ids: { data: Float32Array.from(ids), shape: [1, ids.length] } } : {};
  const factors = Object.values(stage.inputs).includes('lora_factors') ? loraFeeds(bundle.man, lora) : {}; // zeros without opts.lora
  const feeds = {};
  for (const [name, r] of Object.entries(stage.inputs)) {
    if (ROLES[r].per === PROMPT) feeds[name] = cond[r];
    else if (Object.hasOwn(constants, r)) feeds[name] = guidance.repeat(constants[r]);
    else if (r === 'lora_factors') feeds[name] = factors[name];
    else if (picture && Object.hasOwn(picture, r)) feeds[name] = guidance.repeat(picture[r]);
  }
  return feeds;
}

/** What the denoise loop starts from: the plan, the picture's latents and an inpainting UNet's inputs by role. */
function imageStart(plan, latents, lat) {
  const shape = [1, lat.channels, lat.height, lat.width];
  const unetInputs = plan.inpaintUnet ? { mask: plan.mask, masked_image_latents: { data: latents.masked_image_latents, shape } } : null;
  return { ...plan, latents: latents.image_latents, unetInputs };
}

/** The initial latents (given: run-bundle's, else the page's seeded noise) and the noise between an lcm scheduler's
 *  steps (given, else the page's own). */
function latentSource(opts, n, steps) {
  const x = opts.latents ?? pageNoise(opts.seed, n);
  if (x.length !== n) throw new BundleError(`latents: ${x.length} values, the bundle's latent is ${n}`);
  const stepNoise = (i) => {
    const given = opts.noise ? opts.noise.subarray(i * n, (i + 1) * n) : null;
    if (given && given.length !== n) throw new BundleError(`noise: ${opts.noise.length} values, too few for ${steps - 1} re-noisings of ${n}`);
    return given ?? pageNoise((opts.seed + 0x9e3779b9 * (i + 1)) >>> 0, n);
  };
  return { x, stepNoise };
}

/** The sampling loop under the manifest's scheduler (schedulers.js: DDIM or LCM, one interface), the denoiser run on
 *  each step's feeds and its batch output combined by the guidance; `lastStep()` is called as the last step begins
 *  (the decoder downloads during it). Returns the final latents. */
async function denoise(log, guidance, cond, unet, streamed, lastStep) {
  const { bundle, man, opts } = log;
  const stage = bundle.denoiser, comp = stage.component, lat = man.latent;
  // a chunk's output names, found once (not per step; a streamed chunk's at its first use); a whole UNet returns its one output
  const outNames = streamed ? new Array(unet.length) : (unet.length > 1 ? unet.map((c) => outputNames(c, man.components[c.name].outputs)) : null);
  const aliases = chunkAliases(man, comp);
  const n = lat.channels * lat.height * lat.width, latentShape = [1, lat.channels, lat.height, lat.width];
  const scheduler = log.image?.scheduler ?? schedulerFor(man.scheduler); // from a picture: the strength's partial schedule
  const ts = scheduler.timesteps;
  const source = latentSource(opts, n, ts.length);
  // from a picture (image_input.js): the initial latents are the noise it is noised with; a mask blends after each step
  const start = log.image ? new ImageStart(scheduler, log.image.latents, source.x, log.image.mask, log.image.strength, log.image.unetInputs) : null;
  let x = start ? start.start() : source.x;
  const fixed = fixedFeeds(bundle, stage, guidance, cond, opts.lora, log.image?.unetInputs); // opts.lora {bytes, scale, name}: swapped per image
  const stepMs = [];
  for (let i = 0; i < ts.length; i++) {
    const t = ts[i];
    if (i === ts.length - 1) lastStep();
    const res = await runParts(unet, stepFeeds(stage, guidance, fixed, x, t, bundle.table, latentShape), outNames, aliases, comp);
    requireFinite(`${comp} (step ${i + 1})`, res.data, opts.precision);
    stepMs.push(unet.reduce((a, c) => a + c.runMs[c.runMs.length - 1], 0));
    x = scheduler.step(guidance.combine(res.data), t, x, () => source.stepNoise(i)).prevSample; // noise drawn only where the scheduler re-noises
    if (start) x = start.blend(i, x);
    if (opts.onStep) opts.onStep(i + 1, ts.length, stepMs[stepMs.length - 1]);
  }
  for (const c of unet) log.ran(c, streamed ? { compiles: c.compiles, compile_ms_all: c.compileMsAll.reduce((a, b) => a + b, 0) } : {});
  log.latency.unet_steps_ms = stepMs;
  log.latency.unet_step_mean_ms = stepMs.reduce((a, b) => a + b, 0) / Math.max(1, stepMs.length);
  return x;
}

/** The decode stage: a whole decoder compiles and runs; a tiled one's head compiles, runs once on the whole latent and
 *  is released before the up path compiles, and each part of a split up path is released before the next compiles
 *  (run-bundle --pipelined), so no two decoder graphs are on the GPU together (decode above). */
async function decodeStage(log, x, fetches) {
  const { bundle, man, opts } = log;
  const stage = bundle.decodeStage, lat = man.latent;
  const decs = [];
  const latents = { data: x, shape: [1, lat.channels, lat.height, lat.width] };
  const precision = opts.decoderPrecision ?? DECODER_PRECISION;
  const open = async (fetched) => { // fp32 unless asked: LiteRT.js 2.5.3's half-precision 3x3 conv breaks the
    // smoke decoder's up_blocks.1 upsampler conv (a black image on lavapipe); lowered to 1x1 taps it runs at fp16
    const c = await log.compile(fetched, precision);
    decs.push(c); // released below whatever happens (release is idempotent)
    log.record(c);
    await log.checkGolden(c);
    return c;
  };
  try {
    const d = await decode(man, fetches, open, latents, fedBy(stage, 'latents')[0]);
    requireFinite(stage.component, d.data, precision);
    const image = toHwc(d.data, d.shape);
    for (const c of decs) {
      const upPath = d.calls !== undefined && c.name !== bundle.decoder[0];
      log.ran(c, upPath ? { calls: c.calls ?? d.calls } : {});
    }
    if (d.calls !== undefined) log.latency.vae_up_tile_calls = d.calls; // tiles (passes x tiles for the iterated schemes)
    return image;
  } finally {
    for (const c of decs) c.release();
  }
}

/**
 * opts: {prompt, seed, scale, accelerator, latents (Float32Array|null), noise (Float32Array|null: an lcm
 *        bundle's re-noising draws, steps - 1 latents long), goldens (bool), streamUnet (bool: a chunked
 *        UNet's chunks compiled one at a time for each step and released after it, instead of kept),
 *        precision ('fp32', LiteRT.js's default, or 'fp16': the text encoder's and UNet's WebGPU weights and
 *        arithmetic at half precision), decoderPrecision (the decoder's, DECODER_PRECISION unless given: fp16 only
 *        for a decoder exported with its 3x3 convs lowered, rewrites.conv_lowering_components [vae_decoder]),
 *        image ({pixels: {data, shape} [1, 3, H, W] in [0, 1], mask: {data, shape} [1, 1, h, w] (1 = repaint) | null,
 *        strength | null}: image-to-image or inpainting, image_input.js; null: text to image),
 *        onStage(name, info), onStep(i, n, ms)}
 * returns {image: {img, h, w, c, finite}, tokens, stages, golden, latency, task: {task, strength, steps}}
 */
export async function generate(bundle, opts) {
  const plan = opts.image ? imagePlan(bundle.man, opts.image) : null; // checked before any model loads (image_input.js)
  if (!plan && inpaintingRoles(pipelineOf(bundle.man).stages).length) throw new BundleError("init_image: the bundle's UNet inpaints: it runs from a picture and a mask only");
  const log = new RunLog(bundle, opts);
  const zeroUncond = Boolean(bundle.man.pipeline?.conditioning?.zero_unconditional); // runtime/guidance.py's rule
  const guidance = new Guidance(bundle.man.guidance, opts.scale, zeroUncond);
  const tStart = performance.now();
  const rows = tokenRows(bundle, guidance, opts.prompt);
  log.latency.tokenize_ms = performance.now() - tStart;
  // the encode stages' models and the denoiser's download together; each encode stage's model compiles, runs and is
  // released before the denoiser compiles (one model compiling at a time on the page's thread; a model in chunks
  // compiles, runs and releases one chunk after another); the denoiser stays resident between prompts (as run-bundle
  // --pipelined keeps it), unless its chunks are streamed
  const encFetches = bundle.encoders.map((s) => startFetches(bundle, bundle.parts[s.stage]));
  const imageFetch = plan ? startFetches(bundle, bundle.parts[plan.stage.stage])[0] : null; // a text run never loads it
  const den = denoiserFetches(bundle, opts);
  const cond = await encodePrompts(log, guidance, rows, encFetches);
  if (plan) log.image = imageStart(plan, await encodeImage(log, plan, imageFetch), bundle.man.latent);
  const unet = den.kept ?? [];
  bundle.residentUnet = null; // held by this call until it ends
  try {
    await openDenoiser(log, unet, den);
    let decoderFetches = null; // the decoder (a tiled one's head and up path) downloads during the last step
    const x = await denoise(log, guidance, cond, unet, den.streamed, () => { decoderFetches = startFetches(bundle, bundle.decoder); });
    const image = await decodeStage(log, x, decoderFetches);
    log.latency.total_ms = performance.now() - tStart - log.goldenMs;
    if (opts.goldens) log.latency.golden_checks_ms = log.goldenMs;
    const task = plan ? { task: plan.task, strength: plan.strength, steps: plan.scheduler.timesteps.length } : { task: 'text_to_image' };
    return { image, tokens: rows[bundle.encoders[0].stage][0], stages: log.stages, golden: log.golden, latency: log.latency, task };
  } finally {
    // the encoders and decoder were released after use; a streamed denoiser's chunks after each
    bundle.residentUnet = !den.streamed && unet.length === bundle.unetParts.length ? unet : null;
    if (!bundle.residentUnet) for (const c of unet) (den.streamed ? c.close() : c.release()); // a chunk failed to compile: none is kept
  }
}

/** Streamed chunks (StreamedChunk) into `unet`, each compiled once here for its golden check and the stage
 *  table (its first compile), then released until its first step. */
async function openStreamedChunks(unet, fetches, compile, log) {
  for (const p of fetches) {
    const fetched = await p;
    unet.push(new StreamedChunk(fetched, compile, log.man.components[fetched.name].outputs));
  }
  for (const part of unet) {
    const c = await part.open();
    try {
      log.record(c);
      await log.checkGolden(c);
    } finally {
      part.close();
    }
  }
}

/** The worst of several outputs' parity (a UNet chunk returns the stream and the skip connections). */
function worstParity(ms) {
  if (ms.some((m) => !m.finite)) return ms.find((m) => !m.finite);
  return {
    finite: true, nonfinite: 0, cosine: Math.min(...ms.map((m) => m.cosine)),
    psnr_db: Math.min(...ms.map((m) => m.psnr_db)), max_abs: Math.max(...ms.map((m) => m.max_abs)),
  };
}
