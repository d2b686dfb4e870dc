// Image-to-image and inpainting in the page and the Node runner: the twin of runtime/image_tasks.py and of
// runtime/pipeline.py's encode_image stage. Plain module (no DOM, no LiteRT), so tests run it under node.
//
// - The picture is RGB at the bundle's image size: another size of the same aspect ratio is resized (Lanczos, PIL's
//   arithmetic: resizeLanczos) with one warning; another aspect ratio is refused (the picture is never stretched).
// - The mask (white = repaint) has the picture's size; read as grey (PIL's "L": ITU-R 601-2 luma), resized with the
//   picture, binarized at 0.5 and taken to the latent grid by the pixel at each latent cell's top-left corner.
// - The denoise loop starts from addNoise(imageLatents, noise, timesteps[0]) on schedulerFor(block, strength)'s partial
//   schedule (inpainting at strength 1: from the noise itself); inpainting blends after every step:
//   x = mask x + (1 - mask) addNoise(imageLatents, noise, t_next), and after the last step the picture's latents.
// - An inpainting UNet (9 channels: the mask and the masked picture's latents as inputs) repaints by itself: the encoder
//   also runs on the masked picture (the repainted part 0.5 grey), both are fed every step, nothing is blended.
import { schedulerFor } from './schedulers.js';
import { BundleError, ENCODE_IMAGE, inpaintingRoles, pipelineOf } from './stages.js';

export const IMAGE_TO_IMAGE = 'image_to_image', INPAINT = 'inpaint';
export const DEFAULT_STRENGTH = { [IMAGE_TO_IMAGE]: 0.8, [INPAINT]: 1.0 }; // diffusers' img2img and inpaint pipelines'
export const ENCODER_PRECISION = 'fp32'; // the VAE's 3x3 convs, as the decoder's (generate.js DECODER_PRECISION)

/** strength as a number in (0, 1], else a BundleError naming it (`flag`: how the caller spells it). */
export function checkStrength(strength, flag = 'strength') {
  if (!(typeof strength === 'number' && Number.isFinite(strength) && strength > 0 && strength <= 1)) {
    throw new BundleError(`${flag} ${strength}: must be a number in (0, 1] (the part of the schedule run from the picture)`);
  }
  return strength;
}

/** PIL's Lanczos filter (support 3). */
function lanczos(x) {
  const sinc = (v) => (v === 0 ? 1 : Math.sin(v * Math.PI) / (v * Math.PI));
  return x >= -3 && x < 3 ? sinc(x) * sinc(x / 3) : 0;
}

/** One axis' taps as PIL's precompute_coeffs + normalize_coeffs_8bpc: per output index, [first input, fixed-point
 *  weights (22 fraction bits)]. */
function taps(inSize, outSize) {
  const scale = inSize / outSize, filterscale = Math.max(scale, 1), support = 3 * filterscale, out = [];
  for (let o = 0; o < outSize; o++) {
    const center = (o + 0.5) * scale;
    const lo = Math.max(Math.trunc(center - support + 0.5), 0), hi = Math.min(Math.trunc(center + support + 0.5), inSize);
    const w = [];
    for (let i = lo; i < hi; i++) w.push(lanczos((i - center + 0.5) / filterscale));
    const sum = w.reduce((a, b) => a + b, 0);
    out.push([lo, w.map((v) => { const k = (sum ? v / sum : v) * 4194304; return Math.trunc(k < 0 ? k - 0.5 : k + 0.5); })]);
  }
  return out;
}

/** 8-bit interleaved pixels (`ch` channels, w x h) resized to W x H as PIL's Image.resize(LANCZOS): the horizontal pass,
 *  rounded to 8 bits, then the vertical one (each only where the size changes). */
export function resizeLanczos(src, w, h, ch, W, H) {
  const pass = (data, iw, ih, horizontal) => {
    const n = horizontal ? W : H, t = taps(horizontal ? iw : ih, n), ow = horizontal ? W : iw, oh = horizontal ? ih : H;
    const out = new Uint8Array(ow * oh * ch);
    for (let y = 0; y < oh; y++) for (let x = 0; x < ow; x++) for (let k = 0; k < ch; k++) {
      const [lo, ws] = t[horizontal ? x : y];
      let acc = 2097152; // 1 << 21: PIL's rounding
      for (let j = 0; j < ws.length; j++) acc += ws[j] * data[(horizontal ? y * iw + lo + j : (lo + j) * iw + x) * ch + k];
      out[(y * ow + x) * ch + k] = Math.min(255, Math.max(0, Math.floor(acc / 4194304)));
    }
    return out;
  };
  let data = src;
  if (W !== w) data = pass(data, w, h, true);
  if (H !== h) data = pass(data, W, h, false);
  return data;
}

/** A decoded picture ({width, height, rgba}) as `ch` = 3 (RGB, alpha dropped as PIL's convert('RGB')) or 1 (PIL's 'L'). */
function channelsOf(pic, ch) {
  const n = pic.width * pic.height, out = new Uint8Array(n * ch), p = pic.rgba;
  for (let i = 0; i < n; i++) {
    if (ch === 3) out.set(p.subarray(4 * i, 4 * i + 3), 3 * i);
    else out[i] = (p[4 * i] * 19595 + p[4 * i + 1] * 38470 + p[4 * i + 2] * 7471 + 0x8000) >>> 16;
  }
  return out;
}

/** `pic` at the bundle's size (`ch` channels): as it is, or resized (same aspect ratio), else refused naming `what`. */
export function fitted(pic, ch, man, what) {
  const W = man.image.width, H = man.image.height, { width: w, height: h } = pic;
  const data = channelsOf(pic, ch);
  if (w === W && h === H) return data;
  if (w * H !== h * W) {
    throw new BundleError(`${what}: ${w}x${h} px has another aspect ratio than the bundle's ${W}x${H} image; crop it to ${W}:${H} (a picture is never stretched)`);
  }
  return resizeLanczos(data, w, h, ch, W, H);
}

/** The picture as the encoder's input: {data: [1, 3, H, W] float32 in [0, 1], shape}; `rgb`: its interleaved bytes at the
 *  bundle's size (what the page shows); `warning`: the resize's line. */
export function pictureTensor(pic, man, what = 'init_image') {
  const W = man.image.width, H = man.image.height, rgb = fitted(pic, 3, man, what);
  const data = new Float32Array(3 * H * W);
  for (let i = 0; i < H * W; i++) for (let k = 0; k < 3; k++) data[k * H * W + i] = rgb[3 * i + k] / 255;
  const warning = pic.width === W && pic.height === H ? null : `warning: ${what} is ${pic.width}x${pic.height} px; resized to the bundle's ${W}x${H}`;
  return { data, shape: [1, 3, H, W], rgb, warning };
}

/** Grey at the bundle's size (one byte a pixel) -> the mask on the latent grid [1, 1, h, w]: 1 = repaint. */
export function latentMask(grey, man) {
  const W = man.image.width, H = man.image.height, f = man.latent.vae_factor;
  const h = Math.ceil(H / f), w = Math.ceil(W / f), out = new Float32Array(h * w);
  for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) out[y * w + x] = grey[y * f * W + x * f] / 255 >= 0.5 ? 1 : 0;
  return { data: out, shape: [1, 1, h, w] };
}

/** A mask picture (the picture's size, `pictureSize` [w, h]) -> its grey at the bundle's size. */
export function maskGrey(maskPic, man, pictureSize, what = 'mask') {
  const [w, h] = pictureSize;
  if (maskPic.width !== w || maskPic.height !== h) {
    throw new BundleError(`${what}: ${maskPic.width}x${maskPic.height} px, but the picture is ${w}x${h}: give a mask of the picture's size`);
  }
  return fitted(maskPic, 1, man, what);
}

/** An inpainting UNet's masked picture (runtime/image_tasks.py masked_picture): where the mask's grey (at the bundle's
 *  size) is >= 0.5, 0.5 (diffusers' 0 in [-1, 1]); elsewhere the picture. */
export function maskedPicture(pixels, grey) {
  const hw = grey.length, data = new Float32Array(pixels.data.length);
  for (let j = 0; j < data.length; j++) data[j] = grey[j % hw] / 255 >= 0.5 ? 0.5 : pixels.data[j];
  return { data, shape: pixels.shape };
}

/** The run's image input checked against the bundle: the task its tasks must serve, the strength (its default by task),
 *  the encode_image stages (an inpainting UNet's bundle: the picture's and the masked picture's) and the pictures they
 *  read, the scheduler on the strength's partial schedule. `image`: {pixels: {data, shape}, mask: {data, shape} | null,
 *  grey: the mask's bytes at the bundle's size | null, strength: number | null}. */
export function imagePlan(man, image) {
  const task = image.mask ? INPAINT : IMAGE_TO_IMAGE;
  const pipe = pipelineOf(man), tasks = pipe.tasks ?? [];
  const stages = pipe.stages.filter((s) => s.kind === ENCODE_IMAGE), stage = stages[0];
  const inpaintUnet = inpaintingRoles(pipe.stages).length > 0;
  if (inpaintUnet && !image.mask) throw new BundleError('init_image: the bundle serves inpaint only (its UNet inpaints): add a mask');
  if (inpaintUnet && !image.grey) throw new BundleError("mask: an inpainting UNet needs the mask's grey at the bundle's size (image.grey)");
  if (!tasks.includes(task) || !stage) {
    throw new BundleError(`${image.mask ? 'mask' : 'init_image'}: the bundle serves ${tasks.join(', ') || 'text_to_image'}, not ${task} (it has no image encoder stage): export it with tasks: [text_to_image, image_to_image, inpaint]`);
  }
  const strength = checkStrength(image.strength ?? DEFAULT_STRENGTH[task]);
  let scheduler;
  try {
    scheduler = schedulerFor(man.scheduler, strength); // a strength that keeps none of the bundle's steps: refused here
  } catch (e) {
    throw new BundleError(`strength ${strength}: ${e.message}`);
  }
  const pictures = { init_image: image.pixels, ...(inpaintUnet ? { masked_image: maskedPicture(image.pixels, image.grey) } : {}) };
  return { task, stage, stages: inpaintUnet ? stages : [stage], inpaintUnet, strength, scheduler, pixels: image.pixels, pictures, mask: image.mask ?? null };
}

/** The denoise loop from the user's picture (runtime/image_tasks.py ImageStart): its start latents, the blend after
 *  each step under a mask. `scheduler`: schedulerFor(block, strength); `noise`: the run's initial latents. */
export class ImageStart {
  constructor(scheduler, imageLatents, noise, mask = null, strength = 1, unetInputs = null) {
    Object.assign(this, { scheduler, imageLatents, noise, mask, strength, unetInputs }); // unetInputs: an inpainting UNet's (no blend)
  }

  start() {
    if (this.mask && this.strength === 1) return this.noise; // inpainting from scratch: pure noise, as diffusers
    return this.scheduler.addNoise(this.imageLatents, this.noise, this.scheduler.timesteps[0]);
  }

  /** After step i: the picture's latents, noised to the next timestep (none after the last), outside the mask. */
  blend(i, x) {
    if (!this.mask || this.unetInputs) return x;
    const ts = this.scheduler.timesteps;
    const kept = i + 1 === ts.length ? this.imageLatents : this.scheduler.addNoise(this.imageLatents, this.noise, ts[i + 1]);
    const m = this.mask.data, hw = m.length, y = new Float32Array(x.length);
    for (let j = 0; j < x.length; j++) y[j] = m[j % hw] * x[j] + (1 - m[j % hw]) * kept[j];
    return y;
  }
}

/** The encode_image stages: the encoder compiles (golden-checked), runs on each stage's picture (the picture; an
 *  inpainting UNet's bundle also the masked one) and is released before the denoiser compiles; `log`: generate.js's
 *  RunLog; `fetched`: its model's fetch. Returns the latents by role ({image_latents[, masked_image_latents]}). */
export async function encodeImage(log, plan, fetched) {
  const c = await log.compile(fetched, ENCODER_PRECISION);
  try {
    log.record(c);
    await log.checkGolden(c);
    const latents = {};
    for (const s of plan.stages) {
      const [[fed, role]] = Object.entries(s.inputs);
      const out = await c.run({ [fed]: plan.pictures[role] });
      if (!out.data.every(Number.isFinite)) throw new BundleError(`${s.component}: the picture's latents have NaN/Inf values`);
      latents[s.outputs[0]] = out.data;
    }
    log.ran(c);
    return latents;
  } finally {
    c.release();
  }
}
