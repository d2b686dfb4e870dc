// The tiled VAE decoder in the page: `vae_tiling.scheme: one_pass`, as run-bundle decodes it
// (runtime/onepass_decode.py, with the tile origins and blend weights of runtime/tiled_decode.py).
// The head runs once on the whole latent -> features [1, F, H, W]; every tile of the features
// runs once through the up path -> pixels [1, 3, th*f, tw*f]; the tiles are summed with blend
// weights that are zero `margin` latents deep at edges facing a neighbour and ramp linearly
// across the rest of the overlap, normalised to a partition of unity (no division at the end).
// The iterated-statistics schemes (plain, control_variate) run several passes with norm
// statistics fed back into a two-output up tile; the page refuses them (`tilingProblem`).

export const ONE_PASS = 'one_pass';
export const TILED_DECODER = ['vae_decoder_head', 'vae_up_tile'];

class TilingError extends Error {}

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
  if (scheme !== ONE_PASS) {
    return `bundle: vae_tiling.scheme ${JSON.stringify(scheme)} (iterated norm statistics over ${block.passes} passes) is not supported in the browser; `
      + 'the page runs scheme one_pass (export with vae_tiling.scheme: one_pass, fold_norms: true or a distill-decoder VAE)';
  }
  const ints = { overlap: block.overlap, factor: block.factor, margin: block.margin ?? 0, passes: block.passes ?? 1 };
  for (const [k, v] of Object.entries(ints)) if (!Number.isInteger(v) || v < 0) return `bundle: vae_tiling.${k} must be a non-negative int, got ${JSON.stringify(v)}`;
  if (ints.passes !== 1) return `bundle: vae_tiling.passes must be 1 for scheme one_pass, got ${ints.passes}`;
  let hw;
  try { hw = tileHw(block.tile); } catch (e) { return `bundle: ${e.message}`; }
  if (!hw.every((v) => Number.isInteger(v) && v >= 1)) return `bundle: vae_tiling.tile must be positive ints, got ${JSON.stringify(block.tile)}`;
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

/**
 * One-pass tiled decode (onepass_decode.one_pass_decode): latents {data, shape [1, C, H, W]};
 * head(latents) and upTile(features tile) are async, taking and returning {data, shape}.
 * Returns {data: Float32Array, shape: [1, 3, H*f, W*f], calls} (calls: up-tile runs).
 */
export async function onePassDecode(latents, head, upTile, block) {
  const [, , H, W] = latents.shape;
  const [th, tw] = tileHw(block.tile);
  const f = block.factor, margin = block.margin ?? 0;
  if (th > H || tw > W) throw new TilingError(`one-pass decode: tile ${th}x${tw} is larger than the latent ${H}x${W}`);
  const ys = tileStarts(H, th, block.overlap), xs = tileStarts(W, tw, block.overlap);
  const wys = axisWeights(ys, th, margin), wxs = axisWeights(xs, tw, margin);
  const feats = await head(latents);
  if (feats.shape.length !== 4 || feats.shape[0] !== 1 || feats.shape[2] !== H || feats.shape[3] !== W) {
    throw new TilingError(`one-pass decode: the head returned [${feats.shape}] for latents [${latents.shape}]`);
  }
  const Th = th * f, Tw = tw * f, PH = H * f, PW = W * f;
  let image = null, channels = 0, calls = 0;
  for (let iy = 0; iy < ys.length; iy++) {
    for (let ix = 0; ix < xs.length; ix++) {
      const px = await upTile(crop(feats, ys[iy], xs[ix], th, tw));
      calls++;
      if (px.shape[0] !== 1 || px.shape[2] !== Th || px.shape[3] !== Tw) {
        throw new TilingError(`one-pass decode: the up tile returned [${px.shape}], expected [1, C, ${Th}, ${Tw}]`);
      }
      if (!image) { channels = px.shape[1]; image = new Float64Array(channels * PH * PW); }
      const y0 = ys[iy] * f, x0 = xs[ix] * f, wy = wys[iy], wx = wxs[ix];
      for (let c = 0; c < channels; c++) for (let r = 0; r < Th; r++) {
        const a = wy[Math.floor(r / f)]; // zero rows still add 0 * pixels: a NaN shows, as in numpy
        const src = (c * Th + r) * Tw, dst = (c * PH + y0 + r) * PW + x0;
        for (let q = 0; q < Tw; q++) image[dst + q] += px.data[src + q] * (a * wx[Math.floor(q / f)]);
      }
    }
  }
  return { data: Float32Array.from(image), shape: [1, channels, PH, PW], calls };
}
