// Runs the page's plain modules (bpe.js, sha256.js, npy.js, tiled.js, lcm.js, schedulers.js, prepare.js, chunks.js) under node for
// tests/web/test_js_modules.py and tests/runtime/test_schedulers.py.
// argv: <static dir> <request json file>; prints one JSON answer.
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';
import { join } from 'node:path';

const [dir, reqPath] = process.argv.slice(2);
const req = JSON.parse(readFileSync(reqPath, 'utf8'));
const load = (name) => import(pathToFileURL(join(dir, name)).href);
const { ClipBpe } = await load('bpe.js');
const { sha256Js, sha256Hex } = await load('sha256.js');
const { parseNpy, parseNpz } = await load('npy.js');
const tiled = await load('tiled.js');
const lcm = await load('lcm.js');
const schedulers = await load('schedulers.js');
const prepare = await load('prepare.js');
const chunks = await load('chunks.js');

const out = {};
const tok = new ClipBpe(JSON.parse(readFileSync(req.tokenizer_json, 'utf8')), req.tokenizer);
out.tokens = req.prompts.map((p) => {
  const e = tok.encode(p);
  return { ids: Array.from(e.ids), tokens: e.tokens, truncated: e.truncated };
});
out.sha256 = req.files.map((f) => sha256Js(readFileSync(f)));
out.sha256_subtle = await Promise.all(req.files.map((f) => sha256Hex(new Uint8Array(readFileSync(f)))));
const bytes = (f) => { const b = readFileSync(f); return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); };
out.npy = req.npy.map((f) => { const a = parseNpy(bytes(f)); return { shape: a.shape, sum: a.data.reduce((s, v) => s + Number(v), 0), first: Number(a.data[0]) }; });
out.npz = req.npz.map((f) => Object.fromEntries(Object.entries(parseNpz(bytes(f))).map(([k, a]) => [k, { shape: a.shape, sum: a.data.reduce((s, v) => s + Number(v), 0) }])));

// tiled.js: geometry per case, and a whole one-pass decode with the synthetic head / up tile
// that tests/web/test_js_modules.py gives numpy (head: 2 x latents; up: nearest x f of the
// first 3 channels plus 0.01 x (row + column) inside the tile, so the blend shows)
const tiles = [];
for (const c of req.tiles || []) {
  const hw = tiled.tileHw(c.tile);
  const ys = tiled.tileStarts(c.height, hw[0], c.overlap), xs = tiled.tileStarts(c.width, hw[1], c.overlap);
  const block = { tile: c.tile, overlap: c.overlap, margin: c.margin, factor: c.factor, scheme: 'one_pass', passes: 1 };
  const r = { ys, xs, wys: tiled.axisWeights(ys, hw[0], c.margin).map((w) => Array.from(w)),
    wxs: tiled.axisWeights(xs, hw[1], c.margin).map((w) => Array.from(w)), origins: tiled.tileOrigins(c.height, c.width, block) };
  if (c.latents) {
    const lat = { data: Float32Array.from(c.latents), shape: [1, c.channels, c.height, c.width] };
    const head = async (z) => ({ data: z.data.map((v) => 2 * v), shape: z.shape });
    const up = async (t) => {
      const [, , th, tw] = t.shape, f = c.factor, out = new Float32Array(3 * th * f * tw * f);
      for (let k = 0; k < 3; k++) for (let y = 0; y < th * f; y++) for (let x = 0; x < tw * f; x++) {
        out[(k * th * f + y) * tw * f + x] = t.data[(k * th + Math.floor(y / f)) * tw + Math.floor(x / f)] + 0.01 * (y + x);
      }
      return { data: out, shape: [1, 3, th * f, tw * f] };
    };
    const d = await tiled.onePassDecode(lat, head, up, block);
    r.image = Array.from(d.data);
    r.shape = d.shape;
    r.calls = d.calls;
  }
  tiles.push(r);
}
out.tiles = tiles;

// tiled.js statsDecode with a synthetic up tile that tests/web/test_js_modules.py gives numpy too: K
// chained "norms" of one channel per group over the features (F = G): each records its input's
// blend-weighted sums and the tile's own mean and variance (each / the tile's latents), then
// normalises with own * tile statistics + stats (tiled_vae's rule) and maps x -> 0.5 x + 0.1 (k + 1);
// pixels: nearest x f of the first 3 channels
const statsUp = (c) => async (features, weight, stats, own) => {
  const [, F, t] = features.shape, n = t * t, K = c.K, o = own.data[0];
  let x = Array.from(features.data);
  const sums = new Float32Array(K * 5 * F);
  for (let k = 0; k < K; k++) {
    for (let g = 0; g < F; g++) {
      let s0 = 0, s1 = 0, s2 = 0, m = 0, q = 0;
      for (let i = 0; i < n; i++) { const v = x[g * n + i], w = weight.data[i]; s0 += w * v; s1 += w * v * v; s2 += w; m += v; q += v * v; }
      m /= n; q = q / n - m * m;
      [s0 / n, s1 / n, s2 / n, m, q].forEach((v, r) => { sums[(k * 5 + r) * F + g] = v; });
      const mean = o * m + stats.data[(k * 2) * F + g], vr = (o * q + 1 - o) * stats.data[(k * 2 + 1) * F + g];
      for (let i = 0; i < n; i++) x[g * n + i] = 0.5 * (x[g * n + i] - mean) / Math.sqrt(vr + 1e-5) + 0.1 * (k + 1);
    }
  }
  const f = c.factor, T = t * f, px = new Float32Array(3 * T * T);
  for (let ch = 0; ch < 3; ch++) for (let r = 0; r < T; r++) for (let q = 0; q < T; q++) px[(ch * T + r) * T + q] = x[ch * n + Math.floor(r / f) * t + Math.floor(q / f)];
  return { pixels: { data: px, shape: [1, 3, T, T] }, sums: { data: sums, shape: [K, 5, F] } };
};
out.stats_decodes = [];
for (const c of req.stats_cases || []) {
  const lat = { data: Float32Array.from(c.latents), shape: [1, c.channels, c.height, c.width] };
  const head = async (z) => ({ data: z.data.map((v) => 2 * v), shape: z.shape });
  const block = { tile: c.tile, overlap: c.overlap, margin: c.margin, factor: c.factor, scheme: c.scheme, passes: c.passes, norms: [c.K, c.channels] };
  const d = await tiled.statsDecode(lat, head, statsUp(c), block);
  out.stats_decodes.push({ image: Array.from(d.data), shape: d.shape, calls: d.calls });
}
out.problems = (req.blocks || []).map((b) => tiled.tilingProblem(b));

// lcm.js: grids, scheduler problems, and whole lcm loops with the stand-in model out = a x + b t / 1000
// and the noise numpy drew (as generate.js runs them)
out.lcm_grids = (req.lcm_grids || []).map(([T, K, N]) => lcm.lcmTimesteps(T, K, N));
out.lcm_problems = (req.schedulers || []).map((s) => lcm.schedulerProblem(s));
out.lcm_runs = (req.lcm_runs || []).map((r) => {
  const s = schedulers.schedulerFor(r.sched), n = r.x.length;
  let x = Float32Array.from(r.x);
  s.timesteps.forEach((t, i) => {
    const o = x.map((v) => r.a * v + (r.b * t) / 1000);
    x = s.step(o, t, x, () => Float32Array.from(r.noise.slice(i * n, (i + 1) * n))).prevSample;
  });
  return Array.from(x);
});
// schedulers.js on diffusers' vectors (tests/runtime/test_schedulers.py): per case the timesteps setTimesteps(steps)
// gives, the manifest block's, and every step on the given inputs (the noise for a re-noising scheduler)
if (req.scheduler_vectors) {
  out.scheduler_cases = JSON.parse(readFileSync(req.scheduler_vectors, 'utf8')).map((c) => {
    const fresh = c.block.type === 'lcm' ? new schedulers.LCMScheduler(c.block) : new schedulers.DDIMScheduler(c.block);
    fresh.setTimesteps(c.steps);
    const s = schedulers.schedulerFor(c.block);
    const steps = c.inputs.map((i) => {
      const r = s.step(Float32Array.from(i.model_output), i.t, Float32Array.from(i.sample), () => Float32Array.from(i.noise));
      return { prev: Array.from(r.prevSample), x0: Array.from(r.predOriginalSample) };
    });
    return { timesteps: fresh.timesteps, manifest_timesteps: s.timesteps, steps };
  });
}
// prepare.js: the console lines LiteRT.js prints for a model it could not prepare, as the page records them
if (req.console_lines) {
  prepare.installConsoleTap();
  const before = prepare.consoleMark();
  for (const line of req.console_lines) console.error(line);
  out.prepare_since = prepare.consoleSince(before);
  out.prepare_failure = prepare.prepareFailure(out.prepare_since);
  out.prepare_later = prepare.consoleSince(prepare.consoleMark());
}
// prepare.js: a model's output at a precision ({what, values: numbers or 'NaN' / 'Infinity', precision})
out.half_precision = (req.outputs || []).map((o) => prepare.halfPrecisionProblem(o.what, Float32Array.from(o.values, Number), o.precision));
// chunks.js: a model's layout in the manifest ({manifest, base}: 'unet' or 'text_encoder'), and the whole manifest's
out.layouts = (req.layouts || []).map(({ manifest, base }) => {
  const problem = chunks.partsProblem(manifest, base);
  return { problem, parts: problem ? null : chunks.modelParts(manifest, base), layout: chunks.layoutProblem(manifest) };
});
// chunks.js: which golden output_J each of a model's outputs is compared with
if (req.golden_order) {
  out.golden_order = req.golden_order.map(([names, declared]) => {
    try {
      return chunks.goldenIndices(names, declared.map((name) => ({ name })));
    } catch (e) {
      return String(e.message);
    }
  });
}
// chunks.js: runParts (one feed) or runPartsOnEach (chain.feeds_list: each feed through a chunk before the next
// opens, as the page runs a chunked text encoder) over stand-in parts that add 1 to their inputs, with aliases
// between them (the arithmetic, not LiteRT, is what is checked here; the page runs real chunks in
// test_check_chunked.py); `opened`: +name at a compile, run:name at a run, -name at a release, in order
if (req.chunk_chain) {
  const chain = req.chunk_chain;
  const opened = [];
  const part = (name, ins, outs) => ({
    name,
    model: { getInputDetails: () => ins.map((n) => ({ name: n })), getOutputDetails: () => outs.map((n) => ({ name: n })) },
    runAll: async (feeds) => {
      if (chain.log_runs) opened.push(`run:${name}`);
      return outs.map((o, i) => ({ data: Float32Array.from([ins.reduce((a, n) => a + feeds[n].data[0], 0) + i + 1]), shape: [1] }));
    },
    run: async (feeds) => ({ data: Float32Array.from([Object.values(feeds).reduce((a, f) => a + f.data[0], 0) + 1]), shape: [1] }),
  });
  const streamedPart = (p) => new chunks.StreamedChunk({ name: p.name }, async () => {
    const c = { ...part(p.name, p.inputs, p.outputs), runMs: [5], compileMs: 7, release() { opened.push(`-${p.name}`); } };
    opened.push(`+${p.name}`);
    return c;
  }, p.outputs.map((name) => ({ name })));
  const streamed = Boolean(chain.streamed) || Boolean(chain.feeds_list);
  const parts = chain.parts.map((p) => (streamed ? streamedPart(p) : part(p.name, p.inputs, p.outputs)));
  const value = (feeds) => Object.fromEntries(Object.entries(feeds).map(([k, v]) => [k, { data: Float32Array.from([v]), shape: [1] }]));
  const base = chain.base ?? 'unet';
  const aliases = chunks.chunkAliases(chain.manifest, base);
  try {
    if (chain.feeds_list) {
      const res = await chunks.runPartsOnEach(parts, chain.feeds_list.map(value), aliases, base);
      out.chunk_chain = { values: res.map((r) => r.data[0]), opened, compiles: parts.map((p) => p.compiles) };
    } else {
      const names = streamed ? new Array(parts.length) : chain.parts.map((p) => p.outputs);
      const res = await chunks.runParts(parts, value(chain.feeds ?? { sample: 1 }), names, aliases, base);
      out.chunk_chain = { value: res.data[0], opened, compiles: streamed ? parts.map((p) => p.compiles) : null };
    }
  } catch (e) {
    out.chunk_chain = { error: String(e.message), opened };
  }
}
console.log(JSON.stringify(out));
