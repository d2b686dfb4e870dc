// One prompt through the bundle, pipelined as `run-bundle --pipelined` (a tiled decoder as tiled.js, a UNet or a
// text encoder in chunks as chunks.js).
import { BundleError, Component, pageNoise, parity, toHwc } from './pipeline.js';
import { StreamedChunk, TEXT_ENCODER, UNET, chunkAliases, goldenIndices, outputNames, runParts, runPartsOnEach } from './chunks.js';
import { schedulerFor } from './schedulers.js';
import { ONE_PASS, onePassDecode, statsDecode } from './tiled.js';
import { halfPrecisionProblem } from './prepare.js';

export const DECODER_PRECISION = 'fp32'; // the decoder's precision unless opts.decoderPrecision says otherwise

/** Stop with one line when a model at half precision returned NaN/Inf (prepare.js), not with a wrong image. */
function requireFinite(what, data, precision) {
  const problem = halfPrecisionProblem(what, data, precision);
  if (problem) throw new BundleError(problem);
}

/** Latents -> pixels [1, 3, H, W] through the whole decoder, or the tiled one (tiled.js). `fetches`: the decoder's
 *  components fetched (bundle.decoder's order); `open(fetched)` compiles one, golden-checked, to run. A tiled decoder's
 *  head compiles, runs once on the whole latent and is released before its up path compiles, so no two decoder graphs
 *  are on the GPU together. */
async function decode(man, fetches, open, latents) {
  if (fetches.length === 1) return (await open(fetches[0])).run({ latents });
  const head = await open(fetches[0]);
  const feats = await head.run({ latents });
  head.release(); // its memory back before the up path compiles (release is idempotent)
  const block = man.vae_tiling, runHead = async () => feats;
  if ((block.scheme ?? 'plain') === ONE_PASS) return onePassDecode(latents, runHead, upPartRunners(man, fetches.slice(1), open), block);
  const up = await open(fetches[1]);
  // the manifest declares (pixels, sums) in that order; the model may return them in the other
  const declared = man.components[up.name].outputs;
  const names = outputNames(up, declared);
  const [pixelsAt, sumsAt] = declared.map((o) => names.indexOf(o.name));
  return statsDecode(latents, runHead, async (features, weight, stats, own) => {
    const outs = await up.runAll({ features, weight, stats, own });
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

/**
 * opts: {prompt, seed, scale, accelerator, latents (Float32Array|null), noise (Float32Array|null: an lcm
 *        bundle's re-noising draws, steps - 1 latents long), goldens (bool), streamUnet (bool: a chunked
 *        UNet's chunks compiled one at a time for each step and released after it, instead of kept),
 *        precision ('fp32', LiteRT.js's default, or 'fp16': the text encoder's and UNet's WebGPU weights and
 *        arithmetic at half precision), decoderPrecision (the decoder's, DECODER_PRECISION unless given: fp16 only
 *        for a decoder exported with its 3x3 convs lowered, rewrites.conv_lowering_components [vae_decoder]),
 *        onStage(name, info), onStep(i, n, ms)}
 * returns {image: {img, h, w, c, finite}, tokens, stages, golden, latency}
 */
export async function generate(bundle, opts) {
  const man = bundle.man;
  const sched = man.scheduler;
  const B = man.guidance.unet_batch;
  const lat = man.latent;
  const stages = {};
  const golden = {};
  const latency = {};
  const note = opts.onStage || (() => {});
  const tStart = performance.now();

  const t0 = performance.now();
  const enc = bundle.tokenizer.encode(opts.prompt);
  const empty = B === 2 ? bundle.tokenizer.encode('') : null;
  latency.tokenize_ms = performance.now() - t0;

  const record = (c) => {
    stages[c.name] = { accelerator: c.accelerator, precision: c.precision, fully_accelerated: c.fullyAccelerated, fetch_ms: c.fetchMs, compile_ms: c.compileMs, run_ms: 0 };
    note(c.name, stages[c.name]);
  };
  let goldenMs = 0; // check mode's golden runs, kept out of the generation latency
  const checkGolden = async (c) => {
    if (!opts.goldens) return;
    const tg = performance.now();
    try {
      await runGolden(c);
    } finally {
      goldenMs += performance.now() - tg;
    }
  };
  const runGolden = async (c) => {
    const g = await bundle.golden(c.name);
    if (!g) { golden[c.name] = { skipped: 'the manifest has no golden vectors for this component' }; return; }
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
    golden[c.name] = { ...m, precision, tolerances: tol, pass, first_run_ms: firstRunMs };
  };

  // text encoder and UNet download together; the text encoder compiles, runs and is released
  // before the UNet compiles (one model compiling at a time on the page's thread); a text encoder in
  // chunks compiles, runs and releases one chunk after another
  const teFetch = bundle.teParts.map((name) => Component.fetch(bundle, name));
  for (const p of teFetch) p.catch(() => {}); // awaited below; an early failure must not go unhandled
  // the UNet (its chunks, one after another) stays resident between prompts (as run-bundle --pipelined keeps it),
  // unless its chunks are streamed (compiled for each use: they do not fit the page's memory together)
  const streamed = Boolean(opts.streamUnet) && bundle.unetParts.length > 1;
  let kept = bundle.residentUnet;
  if (kept && (streamed || kept[0].accelerator !== opts.accelerator || kept[0].precision !== (opts.precision ?? 'fp32'))) {
    for (const c of kept) c.release();
    kept = bundle.residentUnet = null;
  }
  // streamed: the chunks' verified bytes, fetched once, serve every later prompt (bundle.streamedBytes)
  if (!streamed) bundle.streamedBytes = null;
  const unetFetch = kept ? null
    : streamed && bundle.streamedBytes ? bundle.streamedBytes.map((f) => Promise.resolve({ ...f, fetchMs: 0 }))
      : bundle.unetParts.map((name) => Component.fetch(bundle, name));
  for (const p of unetFetch || []) p.catch(() => {}); // awaited below; an early failure must not go unhandled
  // each part compiled in turn, checked against its golden, run on the prompt (and the empty prompt), and
  // released before the next one compiles (chunks.js runPartsOnEach)
  const teParts = teFetch.map((fetched) => {
    let c = null;
    return {
      async open() {
        c = await Component.compile(fetched, opts.accelerator, opts.precision);
        record(c);
        await checkGolden(c);
        return c;
      },
      close() {
        if (!c) return;
        stages[c.name].run_ms = c.runMs.reduce((a, b) => a + b, 0);
        note(c.name, stages[c.name]);
        c.release();
        c = null;
      },
      outputNames: (comp) => outputNames(comp, man.components[comp.name].outputs),
    };
  });
  const prompts = empty ? [enc, empty] : [enc];
  const [cond, uncond] = await runPartsOnEach(teParts, prompts.map((p) => ({ input_ids: { data: p.ids, shape: [1, p.ids.length] } })),
    chunkAliases(man, TEXT_ENCODER), TEXT_ENCODER);
  for (const t of [cond, uncond]) if (t) requireFinite('text_encoder', t.data, opts.precision);
  const text = { cond, uncond };
  const unet = kept ?? [];
  bundle.residentUnet = null; // held by this call until it ends
  let decoderP = null;
  try {
    if (streamed) {
      await openStreamedChunks(unet, unetFetch, (f) => Component.compile(f, opts.accelerator, opts.precision), man, record, checkGolden);
      bundle.streamedBytes = unet.map((part) => part.fetched);
    } else {
      if (!kept) for (const p of unetFetch) unet.push(await Component.compile(p, opts.accelerator, opts.precision));
      for (const c of unet) {
        if (kept) {
          c.fetchMs = 0;
          c.compileMs = 0;
          c.runMs = [];
        }
        record(c);
        stages[c.name].resident = Boolean(kept);
      }
      for (const c of unet) await checkGolden(c);
    }
    // a chunk's output names, found once (not per step; a streamed chunk's at its first use); a whole UNet
    // returns its one output
    const outNames = streamed ? new Array(unet.length) : (unet.length > 1 ? unet.map((c) => outputNames(c, man.components[c.name].outputs)) : null);
    const aliases = chunkAliases(man, UNET);
    const stepMs = [];
    const h = text.cond.shape;
    let ehs = text.cond.data;
    let ehsShape = h;
    if (B === 2) {
      ehs = new Float32Array(2 * text.cond.data.length);
      ehs.set(text.uncond.data, 0);
      ehs.set(text.cond.data, text.cond.data.length);
      ehsShape = [2, ...h.slice(1)];
    }

    const n = lat.channels * lat.height * lat.width;
    let x = opts.latents ?? pageNoise(opts.seed, n);
    if (x.length !== n) throw new BundleError(`latents: ${x.length} values, the bundle's latent is ${n}`);
    const scheduler = schedulerFor(sched); // DDIM or LCM, one interface (schedulers.js)
    const ts = scheduler.timesteps;
    const table = bundle.table;
    // lcm: the noise between steps, run-bundle's draws when given (check mode), else the page's own
    const stepNoise = (i) => {
      const given = opts.noise ? opts.noise.subarray(i * n, (i + 1) * n) : null;
      if (given && given.length !== n) throw new BundleError(`noise: ${opts.noise.length} values, too few for ${ts.length - 1} re-noisings of ${n}`);
      return given ?? pageNoise((opts.seed + 0x9e3779b9 * (i + 1)) >>> 0, n);
    };
    for (let i = 0; i < ts.length; i++) {
      const t = ts[i];
      if (i === ts.length - 1) { // the decoder (a tiled one's head and up tile or its parts) downloads during the last step
        decoderP = bundle.decoder.map((name) => Component.fetch(bundle, name));
        for (const p of decoderP) p.catch(() => {});
      }
      const sample = new Float32Array(B * n);
      for (let b = 0; b < B; b++) sample.set(x, b * n);
      const feeds = { sample: { data: sample, shape: [B, lat.channels, lat.height, lat.width] }, encoder_hidden_states: { data: ehs, shape: ehsShape } };
      if (table) {
        const D = table.shape[1];
        const row = table.data.subarray(t * D, (t + 1) * D);
        const tt = new Float32Array(B * D);
        for (let b = 0; b < B; b++) tt.set(row, b * D);
        feeds.timestep = { data: tt, shape: [B, D] };
      } else {
        feeds.timestep = { data: new Float32Array(B).fill(t), shape: [B] };
      }
      const res = await runParts(unet, feeds, outNames, aliases, UNET);
      requireFinite(`unet (step ${i + 1})`, res.data, opts.precision);
      stepMs.push(unet.reduce((a, c) => a + c.runMs[c.runMs.length - 1], 0));
      let out = res.data;
      if (B === 2) {
        out = new Float32Array(n);
        for (let k = 0; k < n; k++) out[k] = res.data[k] + opts.scale * (res.data[n + k] - res.data[k]);
      }
      x = scheduler.step(out, t, x, () => stepNoise(i)).prevSample; // the noise is drawn only where the scheduler re-noises
      if (opts.onStep) opts.onStep(i + 1, ts.length, stepMs[stepMs.length - 1]);
    }
    for (const c of unet) {
      stages[c.name].run_ms = c.runMs.reduce((a, b) => a + b, 0);
      if (streamed) Object.assign(stages[c.name], { compiles: c.compiles, compile_ms_all: c.compileMsAll.reduce((a, b) => a + b, 0) });
      note(c.name, stages[c.name]);
    }
    latency.unet_steps_ms = stepMs;
    latency.unet_step_mean_ms = stepMs.reduce((a, b) => a + b, 0) / Math.max(1, stepMs.length);

    // the decoder: a whole one compiles and runs; a tiled one's head compiles, runs once on the whole latent and is
    // released before the up path compiles, and each part of a split up path is released before the next compiles
    // (run-bundle --pipelined), so no two decoder graphs are on the GPU together (decode above)
    const decs = [];
    const latents = { data: x, shape: [1, lat.channels, lat.height, lat.width] };
    const decoderPrecision = opts.decoderPrecision ?? DECODER_PRECISION;
    const openDecoder = async (fetched) => { // fp32 unless asked: LiteRT.js 2.5.3's half-precision 3x3 conv breaks the
      // smoke decoder's up_blocks.1 upsampler conv (a black image on lavapipe); lowered to 1x1 taps it runs at fp16
      const c = await Component.compile(fetched, opts.accelerator, decoderPrecision);
      decs.push(c); // released below whatever happens (release is idempotent)
      record(c);
      await checkGolden(c);
      return c;
    };
    let image;
    try {
      const d = await decode(man, decoderP, openDecoder, latents);
      requireFinite('vae_decoder', d.data, decoderPrecision);
      image = toHwc(d.data, d.shape);
      for (const c of decs) {
        stages[c.name].run_ms = c.runMs.reduce((a, b) => a + b, 0);
        if (d.calls !== undefined && c.name !== bundle.decoder[0]) stages[c.name].calls = c.calls ?? d.calls; // the up path's
        note(c.name, stages[c.name]);
      }
      if (d.calls !== undefined) latency.vae_up_tile_calls = d.calls; // tiles (passes x tiles for the iterated schemes)
    } finally {
      for (const c of decs) c.release();
    }
    latency.total_ms = performance.now() - tStart - goldenMs;
    if (opts.goldens) latency.golden_checks_ms = goldenMs;
    return { image, tokens: enc, stages, golden, latency };
  } finally {
    // the text encoder and decoder were released after use; a streamed UNet's chunks after each
    bundle.residentUnet = !streamed && unet.length === bundle.unetParts.length ? unet : null;
    if (!bundle.residentUnet) for (const c of unet) (streamed ? c.close() : c.release()); // a chunk failed to compile: none is kept
  }
}

/** Streamed chunks (StreamedChunk) into `unet`, each compiled once here for its golden check and the stage
 *  table (its first compile), then released until its first step. */
async function openStreamedChunks(unet, fetches, compile, man, record, checkGolden) {
  for (const p of fetches) {
    const fetched = await p;
    unet.push(new StreamedChunk(fetched, compile, man.components[fetched.name].outputs));
  }
  for (const part of unet) {
    const c = await part.open();
    try {
      record(c);
      await checkGolden(c);
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
