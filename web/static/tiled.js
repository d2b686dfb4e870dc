// The tiled VAE decoder in the page, as run-bundle decodes it (runtime/onepass_decode.py and
// runtime/tiled_decode.py). The head runs once on the whole latent -> features [1, F, H, W].
// `vae_tiling.scheme: one_pass`: every tile of the features runs once through a norm-free up path
// -> pixels [1, 3, th*f, tw*f]; the tiles are summed with blend weights that are zero `margin`
// latents deep at edges facing a neighbour and ramp linearly across the rest of the overlap,
// normalised to a partition of unity. The iterated-statistics schemes (plain, control_variate:
// `statsDecode`) run the square up tile `passes` times over the tiles, each run taking its blend
// weights, the norms' statistics (or corrections) and `own`, and returning pixels and the norms'
// sums [K, 5, G], whose totals give the next pass its statistics. A one-pass up path may come in K parts
// (`vae_tiling.components`: vae_decoder_head, vae_up_tile.0 ... vae_up_tile.K-1, issue 50): part k runs on every
// tile before part k + 1 (part-major), each tile's output waiting in memory for the next part.

import { TILED_DECODER } from './stages.js';

export const ONE_PASS = 'one_pass';
export const STATS_SCHEMES = ['plain', 'control_variate']; // runtime/tiled_decode.SCHEMES
// the registry's tiled decoder (stages.js): its head and up tile, the classic two, what a block without `components` means
export const [HEAD, UP_TILE] = TILED_DECODER;
export { TILED_DECODER };

class TilingError extends Error {}

/** The tiled decoder's components in decode order: the block's `components`, or the classic two when it has none. */
export function tilingComponents(block) {
  return block.components ?? TILED_DECODER;
}

/** The up path's part names in order: [vae_up_tile], or [vae_up_tile.0, ..., vae_up_tile.K-1]. */
export function upPartNames(block) {
  return tilingComponents(block).slice(1);
}

/** Why the block's `components` is not [head, vae_up_tile] or [head, vae_up_tile.0 .. K-1] (K >= 2, scheme one_pass
 *  only), or null. */
function componentsProblem(block, scheme) {
  const comps = block.components;
  if (comps === undefined) return null;
  const shape = `["${HEAD}", "${UP_TILE}"] or ["${HEAD}", "${UP_TILE}.0", ..., "${UP_TILE}.K-1"] (K >= 2)`;
  if (!Array.isArray(comps) || comps.length < 2 || comps[0] !== HEAD) return `bundle: vae_tiling.components must be ${shape}, got ${JSON.stringify(comps)}`;
  const ups = comps.slice(1);
  const want = ups.length === 1 ? [UP_TILE] : ups.map((_, k) => `${UP_TILE}.${k}`);
  if (JSON.stringify(ups) !== JSON.stringify(want)) return `bundle: vae_tiling.components must be ${shape}, got ${JSON.stringify(comps)}`;
  if (ups.length > 1 && scheme !== ONE_PASS) {
    return `bundle: vae_tiling.components splits the up path in ${ups.length} parts, which only scheme one_pass runs (this block's scheme is ${scheme})`;
  }
  return null;
}

/** Start offsets covering [0, size) with tiles of `tile`, stride tile - overlap; the last tile
 *  ends at `size` exactly (tiled_decode.tile_starts). */
export function tileStarts(size, tile, overlap) {
  if (tile >= size) return [0];
  const stride = tile - overlap;
  if (stride <= 0) throw new TilingError(`tiled decode: overlap ${overlap} must be smaller than the tile ${tile}`);
  const starts = [];
  for (let s = 0; s < size - tile; s += stride) starts.push(s);
  starts.push(size - tile);
  return [...new Set(starts)].sort((a, b) => a - b);
}

/** Weights over n latents: rising over loFade, falling over hiFade, 1 between (tiled_decode._ramp). */
function ramp(n, loFade, hiFade) {
  const w = new Float64Array(n).fill(1);
  for (let i = 0; i < loFade; i++) w[i] = (i + 0.5) / loFade;
  for (let j = 0; j < hiFade; j++) {
    const k = n - hiFade + j;
    w[k] = Math.min(w[k], (hiFade - 1 - j + 0.5) / hiFade);
  }
  return w;
}

/** [lo, hi) latents each tile contributes: less `margin` on sides with a neighbour (tiled_decode._spans). */
function spans(starts, tile, margin) {
  const last = starts.length - 1;
  const out = starts.map((s, i) => [s + (i > 0 ? margin : 0), s + tile - (i < last ? margin : 0)]);
  for (let i = 1; i < out.length; i++) {
    if (out[i - 1][1] < out[i][0]) {
      throw new TilingError(`tiled decode: margin ${margin} leaves latents [${out[i - 1][1]}, ${out[i][0]}) to no tile (tiles at ${starts}, tile ${tile})`);
    }
  }
  return out;
}

/** One Float64Array(tile) of blend weights per tile along one axis, at latent resolution,
 *  summing to one at every latent (tiled_decode.axis_weights). */
export function axisWeights(starts, tile, margin = 0) {
  const sp = spans(starts, tile, margin);
  const raw = sp.map(([lo, hi], i) => {
    const fadeLo = i > 0 ? sp[i - 1][1] - lo : 0;
    const fadeHi = i + 1 < sp.length ? hi - sp[i + 1][0] : 0;
    const row = new Float64Array(tile);
    row.set(ramp(hi - lo, Math.max(fadeLo, 0), Math.max(fadeHi, 0)), lo - starts[i]);
    return row;
  });
  const total = new Float64Array(Math.max(...starts) + tile);
  starts.forEach((s, i) => raw[i].forEach((v, k) => { total[s + k] += v; }));
  return raw.map((row, i) => row.map((v, k) => (v > 0 ? v / total[starts[i] + k] : v)));
}

/** A tile as [rows, columns]: an int is square (onepass_decode.tile_hw). */
export function tileHw(tile) {
  if (Array.isArray(tile)) {
    if (tile.length !== 2) throw new TilingError(`one-pass decode: tile must be an int or [rows, columns], got ${JSON.stringify(tile)}`);
    return [Number(tile[0]), Number(tile[1])];
  }
  return [Number(tile), Number(tile)];
}

/** Why the page cannot run this manifest's vae_tiling block, or null when it can. */
export function tilingProblem(block) {
  const scheme = block.scheme ?? 'plain';
  if (![ONE_PASS, ...STATS_SCHEMES].includes(scheme)) {
    return `bundle: vae_tiling.scheme ${JSON.stringify(scheme)} is not one the page runs (${[ONE_PASS, ...STATS_SCHEMES].join(', ')})`;
  }
  const ints = { overlap: block.overlap, factor: block.factor, margin: block.margin ?? 0, passes: block.passes ?? 1 };
  for (const [k, v] of Object.entries(ints)) if (!Number.isInteger(v) || v < 0) return `bundle: vae_tiling.${k} must be a non-negative int, got ${JSON.stringify(v)}`;
  if (scheme === ONE_PASS && ints.passes !== 1) return `bundle: vae_tiling.passes must be 1 for scheme one_pass, got ${ints.passes}`;
  if (scheme !== ONE_PASS) {
    if (ints.passes < 1) return `bundle: vae_tiling.passes must be at least 1, got ${ints.passes}`;
    const norms = block.norms;
    if (!Array.isArray(norms) || norms.length !== 2 || !norms.every((v) => Number.isInteger(v) && v >= 1)) {
      return `bundle: vae_tiling.norms must be [K, G] positive ints for scheme ${scheme}, got ${JSON.stringify(norms)}`;
    }
    if (!Number.isInteger(block.tile) || block.tile < 1) return `bundle: vae_tiling.tile must be a positive int for scheme ${scheme}, got ${JSON.stringify(block.tile)}`;
  }
  let hw;
  try { hw = tileHw(block.tile); } catch (e) { return `bundle: ${e.message}`; }
  if (!hw.every((v) => Number.isInteger(v) && v >= 1)) return `bundle: vae_tiling.tile must be positive ints, got ${JSON.stringify(block.tile)}`;
  return componentsProblem(block, scheme);
}

const sameShape = (a, b) => Array.isArray(a) && Array.isArray(b) && a.length === b.length && a.every((v, i) => v === b[i]);

/** The one input and one output a split up path's part `name` declares in the manifest, or a problem line. */
function partIo(man, name) {
  const entry = man.components?.[name];
  if (!entry) return { problem: `bundle: vae_tiling.components names ${name}, which manifest.components lacks` };
  for (const key of ['inputs', 'outputs']) {
    if (!Array.isArray(entry[key]) || entry[key].length !== 1) {
      return { problem: `bundle: ${name}.${key} must be exactly one tensor (an up part takes one and returns one), got ${JSON.stringify(entry[key]?.map?.((t) => t.name) ?? entry[key])}` };
    }
  }
  return { input: entry.inputs[0], output: entry.outputs[0] };
}

/** Why the manifest's split up path (vae_up_tile.0 .. K-1) does not chain, or null (also for an unsplit one): part 0
 *  takes `features` [1, F, th, tw], part k >= 1 `hidden` of part k-1's output shape, and the last returns pixels
 *  [1, C, th*f, tw*f]. */
export function upPartsProblem(man) {
  const names = upPartNames(man.vae_tiling);
  if (names.length < 2) return null;
  const [th, tw] = tileHw(man.vae_tiling.tile), f = man.vae_tiling.factor;
  let before = null;
  for (const [k, name] of names.entries()) {
    const { problem, input, output } = partIo(man, name);
    if (problem) return problem;
    const want = k === 0 ? 'features' : 'hidden';
    if (input.name !== want) return `bundle: ${name}'s input must be named ${want}, got ${JSON.stringify(input.name)}`;
    if (k === 0 && !(input.shape?.length === 4 && input.shape[0] === 1 && input.shape[2] === th && input.shape[3] === tw)) {
      return `bundle: ${name}'s input features must be [1, F, ${th}, ${tw}] (the tile), got ${JSON.stringify(input.shape)}`;
    }
    if (k > 0 && !sameShape(input.shape, before.output.shape)) {
      return `bundle: ${name}'s input hidden ${JSON.stringify(input.shape)} must be ${before.name}'s output shape ${JSON.stringify(before.output.shape)}`;
    }
    before = { name, output };
  }
  const px = before.output.shape;
  if (!(px?.length === 4 && px[0] === 1 && px[2] === th * f && px[3] === tw * f)) {
    return `bundle: ${before.name}'s output (the pixels) must be [1, C, ${th * f}, ${tw * f}], got ${JSON.stringify(px)}`;
  }
  return null;
}

/** The up tile's origins (latents) in decode order, rows outer, as one_pass_decode visits them. */
export function tileOrigins(height, width, block) {
  const [th, tw] = tileHw(block.tile);
  const ys = tileStarts(height, th, block.overlap), xs = tileStarts(width, tw, block.overlap);
  return ys.flatMap((y) => xs.map((x) => [y, x]));
}

/** Features [1, F, H, W] -> the tile [1, F, th, tw] at (y, x). */
function crop(feats, y, x, th, tw) {
  const [, F, H, W] = feats.shape;
  const out = new Float32Array(F * th * tw);
  for (let c = 0; c < F; c++) for (let r = 0; r < th; r++) {
    const from = (c * H + y + r) * W + x;
    out.set(feats.data.subarray(from, from + tw), (c * th + r) * tw);
  }
  return { data: out, shape: [1, F, th, tw] };
}

/** The up path as part runners (async tiles[] -> tiles[]): an array of them as given, or one made of a per-tile
 *  function (the whole up tile, async tile -> pixels). */
function upRunners(up) {
  if (typeof up === 'function') {
    return [async (tiles) => {
      const out = [];
      for (const t of tiles) out.push(await up(t));
      return out;
    }];
  }
  if (!Array.isArray(up) || !up.length || !up.every((p) => typeof p === 'function')) {
    throw new TilingError('one-pass decode: the up path must be a function or a non-empty array of part functions');
  }
  return up;
}

/** Each tile's input through every part in turn, part-major: part k runs on all tiles before part k + 1 starts. */
async function runUpParts(runners, tiles) {
  let cur = tiles;
  for (const [k, run] of runners.entries()) {
    const next = await run(cur);
    if (!Array.isArray(next) || next.length !== cur.length) {
      const got = Array.isArray(next) ? `${next.length} tiles` : typeof next;
      throw new TilingError(`one-pass decode: up part ${k} of ${runners.length} returned ${got} for ${cur.length} tiles`);
    }
    cur = next;
  }
  return cur;
}

/**
 * One-pass tiled decode (onepass_decode.one_pass_decode): latents {data, shape [1, C, H, W]}; head(latents) async,
 * taking and returning {data, shape}; `up`: the up tile as an async function of one features tile -> its pixels, or
 * the up path's parts as an array of async functions, each taking every tile's input ({data, shape}[], in tile
 * order: the features' tile crops for part 0, the part before's outputs otherwise) and returning their outputs.
 * Returns {data: Float32Array, shape: [1, 3, H*f, W*f], calls} (calls: tiles, each through the whole up path).
 */
export async function onePassDecode(latents, head, up, block) {
  const [, , H, W] = latents.shape;
  const [th, tw] = tileHw(block.tile);
  const f = block.factor, margin = block.margin ?? 0;
  if (th > H || tw > W) throw new TilingError(`one-pass decode: tile ${th}x${tw} is larger than the latent ${H}x${W}`);
  const runners = upRunners(up);
  const ys = tileStarts(H, th, block.overlap), xs = tileStarts(W, tw, block.overlap);
  const wys = axisWeights(ys, th, margin), wxs = axisWeights(xs, tw, margin);
  const feats = await head(latents);
  if (feats.shape.length !== 4 || feats.shape[0] !== 1 || feats.shape[2] !== H || feats.shape[3] !== W) {
    throw new TilingError(`one-pass decode: the head returned [${feats.shape}] for latents [${latents.shape}]`);
  }
  const origins = ys.flatMap((y, iy) => xs.map((x, ix) => ({ y, x, iy, ix })));
  const pixels = await runUpParts(runners, origins.map(({ y, x }) => crop(feats, y, x, th, tw)));
  const Th = th * f, Tw = tw * f, PH = H * f, PW = W * f;
  const what = runners.length > 1 ? `the up path's last part (of ${runners.length})` : 'the up tile';
  let image = null, channels = 0;
  for (const [i, { y, x, iy, ix }] of origins.entries()) {
    const px = pixels[i];
    if (px?.shape?.length !== 4 || px.shape[0] !== 1 || px.shape[2] !== Th || px.shape[3] !== Tw) {
      throw new TilingError(`one-pass decode: ${what} returned [${px?.shape}], expected [1, C, ${Th}, ${Tw}]`);
    }
    if (!image) { channels = px.shape[1]; image = new Float64Array(channels * PH * PW); }
    if (px.shape[1] !== channels) throw new TilingError(`one-pass decode: ${what} returned ${px.shape[1]} channels for a tile, ${channels} for the first`);
    const y0 = y * f, x0 = x * f, wy = wys[iy], wx = wxs[ix];
    for (let c = 0; c < channels; c++) for (let r = 0; r < Th; r++) {
      const a = wy[Math.floor(r / f)]; // zero rows still add 0 * pixels: a NaN shows, as in numpy
      const src = (c * Th + r) * Tw, dst = (c * PH + y0 + r) * PW + x0;
      for (let q = 0; q < Tw; q++) image[dst + q] += px.data[src + q] * (a * wx[Math.floor(q / f)]);
    }
  }
  return { data: Float32Array.from(image), shape: [1, channels, PH, PW], calls: origins.length };
}

/** [K, R, G] sums (blend-weighted sum, sum of squares, weight; rows past 3 ignored) -> [K, 2, G]
 *  (mean, variance) as Float32Array (tiled_decode.stats_from_sums). */
export function statsFromSums(sums, K, R, G) {
  const out = new Float32Array(K * 2 * G);
  for (let k = 0; k < K; k++) for (let g = 0; g < G; g++) {
    const at = (r) => sums[(k * R + r) * G + g];
    const mean = at(0) / at(2);
    out[(k * 2) * G + g] = mean;
    out[(k * 2 + 1) * G + g] = Math.max(at(1) / at(2) - mean * mean, 0);
  }
  return out;
}

/** [K, 2, G] corrections that leave every tile's own statistics as they are (shift 0, ratio 1). */
function firstPassCorrections(K, G) {
  const out = new Float32Array(K * 2 * G);
  for (let k = 0; k < K; k++) out.fill(1, (k * 2 + 1) * G, (k * 2 + 2) * G);
  return out;
}

/** The whole image's statistics `given` against a tile's own `ownBefore` (both [K, 2, G]) as a mean
 *  shift and a variance ratio (tiled_decode.control_variate). */
export function controlVariate(given, ownBefore, K, G, eps = 1e-6) {
  const out = new Float32Array(K * 2 * G);
  for (let k = 0; k < K; k++) for (let g = 0; g < G; g++) {
    const m = (k * 2) * G + g, v = (k * 2 + 1) * G + g;
    out[m] = given[m] - ownBefore[m];
    out[v] = (Math.max(given[v], 0) + eps) / (Math.max(ownBefore[v], 0) + eps);
  }
  return out;
}

/**
 * Iterated-statistics tiled decode (tiled_decode.tiled_decode_with_stats, schemes plain and
 * control_variate): latents {data, shape [1, C, H, W]}; head(latents) -> features and
 * upTile(features tile, weight [t, t], stats [K, 2, G], own [1]) -> {pixels, sums [K, 5, G]}, async,
 * all {data, shape}. Returns {data: Float32Array, shape: [1, 3, H*f, W*f], calls}.
 */
export async function statsDecode(latents, head, upTile, block) {
  const [, , H, W] = latents.shape;
  const t = block.tile, f = block.factor, margin = block.margin ?? 0, passes = block.passes;
  const [K, G] = block.norms;
  if (t > H || t > W) throw new TilingError(`tiled decode: tile ${t} is larger than the latent ${H}x${W}`);
  const ys = tileStarts(H, t, block.overlap), xs = tileStarts(W, t, block.overlap);
  const wys = axisWeights(ys, t, margin), wxs = axisWeights(xs, t, margin);
  const feats = await head(latents);
  if (feats.shape.length !== 4 || feats.shape[0] !== 1 || feats.shape[2] !== H || feats.shape[3] !== W) {
    throw new TilingError(`tiled decode: the head returned [${feats.shape}] for latents [${latents.shape}]`);
  }
  const tiles = ys.flatMap((y, iy) => xs.map((x, ix) => {
    const weight = new Float32Array(t * t); // the graph's input, and (as float64) the pixels' blend
    for (let r = 0; r < t; r++) for (let q = 0; q < t; q++) weight[r * t + q] = wys[iy][r] * wxs[ix][q];
    return { y, x, weight, features: crop(feats, y, x, t, t) };
  }));
  const T = t * f, PH = H * f, PW = W * f;
  let corrections = tiles.map(() => firstPassCorrections(K, G));
  let own = 1, image = null, wsum = null, channels = 0, calls = 0;
  for (let p = 1; p <= passes; p++) {
    wsum = new Float64Array(PH * PW);
    image = null;
    const totals = new Float64Array(K * 3 * G), owns = [];
    for (let i = 0; i < tiles.length; i++) {
      const { y, x, weight, features } = tiles[i];
      const { pixels, sums } = await upTile(features, { data: weight, shape: [t, t] }, { data: corrections[i], shape: [K, 2, G] },
        { data: Float32Array.of(own), shape: [1] });
      calls++;
      if (pixels.shape[0] !== 1 || pixels.shape[2] !== T || pixels.shape[3] !== T) {
        throw new TilingError(`tiled decode: the up tile returned pixels [${pixels.shape}], expected [1, C, ${T}, ${T}]`);
      }
      if (sums.shape.join(',') !== [K, 5, G].join(',')) {
        throw new TilingError(`tiled decode: the up tile returned sums [${sums.shape}], expected [${K}, 5, ${G}]`);
      }
      if (!image) { channels = pixels.shape[1]; image = new Float64Array(channels * PH * PW); }
      blendInto(image, wsum, pixels.data, weight, { y, x, t, f, channels, PH, PW });
      const own2 = new Float32Array(K * 2 * G);
      for (let k = 0; k < K; k++) for (let r = 0; r < 5; r++) for (let g = 0; g < G; g++) {
        const v = sums.data[(k * 5 + r) * G + g];
        if (r < 3) totals[(k * 3 + r) * G + g] += v;
        else own2[(k * 2 + r - 3) * G + g] = v;
      }
      owns.push(own2);
    }
    const given = statsFromSums(totals, K, 3, G);
    if ((block.scheme ?? 'plain') === 'plain') {
      corrections = tiles.map(() => given);
      own = 0;
    } else {
      corrections = owns.map((o) => controlVariate(given, o, K, G));
    }
  }
  const out = new Float32Array(image.length);
  for (let c = 0; c < channels; c++) for (let k = 0; k < PH * PW; k++) out[c * PH * PW + k] = image[c * PH * PW + k] / wsum[k];
  return { data: out, shape: [1, channels, PH, PW], calls };
}

/** image += pixels * blend, wsum += blend over one tile (blend: the tile's weights, each latent's f x f pixels). */
function blendInto(image, wsum, pixels, weight, { y, x, t, f, channels, PH, PW }) {
  const T = t * f;
  for (let r = 0; r < T; r++) for (let q = 0; q < T; q++) {
    const b = weight[Math.floor(r / f) * t + Math.floor(q / f)];
    const at = (y * f + r) * PW + x * f + q;
    wsum[at] += b;
    for (let c = 0; c < channels; c++) image[c * PH * PW + at] += pixels[(c * T + r) * T + q] * b;
  }
}
