// Runs web/static/tiled.js's one-pass decode with the up path whole or split in parts (plain JS functions, no GPU),
// its tiling validator and the split up path's manifest check, for tests/web/test_tiled_up_parts.py.
// argv: <request json file>; prints one JSON answer.
import { readFileSync } from 'node:fs';
import * as tiled from '../../web/static/tiled.js';

const req = JSON.parse(readFileSync(process.argv[2], 'utf8'));

// The synthetic up path (tests/web/test_tiled_up_parts.py gives numpy the same): nearest x f of the features' first
// 3 channels, plus 0.01 x (row + column) inside the tile so the blend shows. Split: nearest x a of every channel,
// then nearest x (f / a) of the first 3, then the ramp; each step one part, or all in one function.
function nearest(t, s, channels) {
  const [, , h, w] = t.shape, H = h * s, W = w * s, out = new Float32Array(channels * H * W);
  for (let c = 0; c < channels; c++) for (let y = 0; y < H; y++) for (let x = 0; x < W; x++) {
    out[(c * H + y) * W + x] = t.data[(c * h + Math.floor(y / s)) * w + Math.floor(x / s)];
  }
  return { data: out, shape: [1, channels, H, W] };
}

function ramp(t) {
  const [, c, H, W] = t.shape, out = Float32Array.from(t.data);
  for (let k = 0; k < c; k++) for (let y = 0; y < H; y++) for (let x = 0; x < W; x++) out[(k * H + y) * W + x] += 0.01 * (y + x);
  return { data: out, shape: t.shape };
}

const steps = (f, a) => [(t) => nearest(t, a, t.shape[1]), (t) => nearest(t, f / a, 3), ramp];

/** Part runners over tiles[], logging `k:i` for part k's run on tile i; `wrongCount`: part k drops one tile. */
function partRunners(fns, log, wrongCount) {
  return fns.map((fn, k) => async (tiles) => {
    const out = tiles.map((t, i) => { log.push(`${k}:${i}`); return fn(t); });
    return k === wrongCount ? out.slice(1) : out;
  });
}

/** The up path as the case asks: `parts` 0 (one per-tile function), 1 (one part runner), 2 (nearest x a, then the
 *  rest), 3 (each step a part). */
function upPath(c, log) {
  const [a, b, r] = steps(c.factor, c.first_scale);
  let n = 0;
  if (c.parts === 0) return async (t) => { log.push(`0:${n++}`); return r(b(a(t))); };
  const fns = { 1: [(t) => r(b(a(t)))], 2: [a, (t) => r(b(t))], 3: [a, b, r] }[c.parts];
  return partRunners(fns, log, c.wrong_count);
}

async function decodeCase(c) {
  const lat = { data: Float32Array.from(c.latents), shape: [1, c.channels, c.height, c.width] };
  const head = async (z) => ({ data: z.data.map((v) => 2 * v), shape: z.shape });
  const block = { scheme: 'one_pass', tile: c.tile, overlap: c.overlap, margin: c.margin, factor: c.factor, passes: 1 };
  const log = [];
  let up = upPath(c, log);
  const flat = (t) => ({ data: t.data, shape: [1, 3, 1, t.data.length / 3] }); // the pixels' values, a wrong shape
  const given = up;
  if (c.last_shape_wrong) up = typeof given === 'function' ? async (t) => flat(await given(t)) : [...given, async (tiles) => tiles.map(flat)];
  if (c.not_a_function) up = [up[0], 'vae_up_tile.1'];
  if (c.no_parts) up = [];
  try {
    const d = await tiled.onePassDecode(lat, head, up, block);
    return { image: Array.from(d.data), shape: d.shape, calls: d.calls, log };
  } catch (e) {
    return { error: `${e.constructor.name}: ${e.message}`, log };
  }
}

const out = { decodes: [] };
for (const c of req.decodes || []) out.decodes.push(await decodeCase(c));
out.problems = (req.blocks || []).map((b) => tiled.tilingProblem(b));
out.components = (req.blocks || []).map((b) => tiled.tilingComponents(b));
out.chains = (req.manifests || []).map((m) => tiled.upPartsProblem(m));
process.stdout.write(JSON.stringify(out));
