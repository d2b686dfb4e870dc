// The page's picture controls (index.html #picture), shown only for a bundle whose pipeline has an encode_image stage:
// pick or drop a picture (image-to-image), paint a mask over it (white = repaint: inpainting; brush size; clear), the
// strength slider (untouched: the task's default, as run-bundle's). Check mode's URL parameters: ?init_image=URL
// [&mask=URL] [&strength=S] (URLs relative to the page, e.g. reference/init_image.png). image_input.js does the
// arithmetic; this module holds the DOM.
import { BundleError, ENCODE_IMAGE, pipelineOf } from './stages.js';
import { DEFAULT_STRENGTH, IMAGE_TO_IMAGE, INPAINT, checkStrength, latentMask, maskGrey, pictureTensor } from './image_input.js';
import { decodePng, isPng } from './png.js';

/** zlib's inflate through the browser's DecompressionStream. */
async function inflate(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('deflate'));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

/** An image file's bytes -> {width, height, rgba}: a PNG through png.js (the file's own bytes, as PIL reads them for
 *  run-bundle), another format through the browser's decoder (no colour conversion). */
export async function decodePicture(bytes, what) {
  if (isPng(bytes)) return decodePng(bytes, inflate, what);
  let bmp;
  try {
    bmp = await createImageBitmap(new Blob([bytes]), { colorSpaceConversion: 'none', premultiplyAlpha: 'none' });
  } catch {
    throw new BundleError(`${what}: not an image this browser can read`);
  }
  const ctx = new OffscreenCanvas(bmp.width, bmp.height).getContext('2d');
  ctx.drawImage(bmp, 0, 0);
  return { width: bmp.width, height: bmp.height, rgba: new Uint8Array(ctx.getImageData(0, 0, bmp.width, bmp.height).data.buffer) };
}

async function fetchBytes(url, what) {
  const res = await fetch(url);
  if (!res.ok) throw new BundleError(`${what} ${url}: could not be read (HTTP ${res.status})`);
  return new Uint8Array(await res.arrayBuffer());
}

export class PictureControls {
  /** `$`: the page's getElementById; `man`: the opened bundle's manifest. */
  constructor($, man) {
    this.$ = $;
    this.man = man;
    this.W = man.image.width;
    this.H = man.image.height;
    this.enabled = pipelineOf(man).stages.some((s) => s.kind === ENCODE_IMAGE);
    this.clearPicture();
    $('picture').hidden = !this.enabled;
    if (!this.enabled) return;
    for (const id of ['picture-canvas', 'mask-canvas']) Object.assign($(id), { width: this.W, height: this.H });
    $('brush').max = String(Math.max(2, Math.ceil(Math.max(this.W, this.H) / 4)));
    $('brush').value = String(Math.max(1, Math.round(Math.max(this.W, this.H) / 16)));
    this.wire();
  }

  wire() {
    const $ = this.$, pick = (file) => file && file.arrayBuffer().then((b) => this.setPicture(new Uint8Array(b), file.name)).catch((e) => this.note(e.message, 'error'));
    $('picture-file').addEventListener('change', () => pick($('picture-file').files[0]));
    $('picture-box').addEventListener('dragover', (e) => e.preventDefault());
    $('picture-box').addEventListener('drop', (e) => { e.preventDefault(); pick(e.dataTransfer.files[0]); });
    $('strength').addEventListener('input', () => { this.strength = Number($('strength').value); this.strengthTouched = true; this.showStrength(); });
    $('mask-clear').addEventListener('click', () => { this.clearMask(); this.drawMask(); this.showStrength(); });
    $('picture-clear').addEventListener('click', () => { this.clearPicture(); this.show(); });
    let down = false;
    const paint = (e) => {
      if (!down || !this.rgb) return;
      const r = $('mask-canvas').getBoundingClientRect();
      this.paintAt(Math.floor(((e.clientX - r.left) / r.width) * this.W), Math.floor(((e.clientY - r.top) / r.height) * this.H));
    };
    $('mask-canvas').addEventListener('pointerdown', (e) => { down = true; $('mask-canvas').setPointerCapture(e.pointerId); paint(e); });
    $('mask-canvas').addEventListener('pointermove', paint);
    $('mask-canvas').addEventListener('pointerup', () => { down = false; });
  }

  clearPicture() {
    this.rgb = null;
    this.pixels = null;
    this.source = null;
    this.strengthTouched = false;
    this.clearMask();
  }

  clearMask() {
    this.grey = null;
    this.maskSource = null;
  }

  note(text, cls = 'note') {
    this.$('picture-note').textContent = text;
    this.$('picture-note').className = cls;
  }

  /** The user's picture from an image file's bytes (`source`: its name or URL); refused in #picture-note (and thrown). */
  async setPicture(bytes, source) {
    const pic = await decodePicture(bytes, `picture ${source}`);
    const tensor = pictureTensor(pic, this.man, `picture ${source}`);
    this.clearPicture();
    Object.assign(this, { rgb: tensor.rgb, pixels: tensor, size: [pic.width, pic.height], source });
    this.show();
    this.note(tensor.warning ?? `${source}: ${pic.width}x${pic.height} px`, tensor.warning ? 'warn' : 'note');
  }

  /** A mask file (white = repaint) of the picture's size. */
  async setMask(bytes, source) {
    if (!this.rgb) throw new BundleError(`mask ${source}: masks the picture: give init_image too`);
    const grey = maskGrey(await decodePicture(bytes, `mask ${source}`), this.man, this.size, `mask ${source}`);
    this.grey = grey;
    this.maskSource = source;
    this.drawMask();
    this.showStrength();
  }

  /** A disc of the brush's radius made white (repaint) on the mask at bundle pixel (x, y). */
  paintAt(cx, cy) {
    const r = Number(this.$('brush').value) / 2, W = this.W, H = this.H;
    this.grey ??= new Uint8Array(W * H);
    this.maskSource ??= 'painted';
    for (let y = Math.max(0, Math.floor(cy - r)); y <= Math.min(H - 1, Math.ceil(cy + r)); y++) {
      for (let x = Math.max(0, Math.floor(cx - r)); x <= Math.min(W - 1, Math.ceil(cx + r)); x++) {
        if ((x - cx) ** 2 + (y - cy) ** 2 <= r * r) this.grey[y * W + x] = 255;
      }
    }
    this.drawMask();
    this.showStrength();
  }

  show() {
    const ctx = this.$('picture-canvas').getContext('2d'), id = ctx.createImageData(this.W, this.H);
    for (let p = 0; p < this.W * this.H; p++) {
      for (let k = 0; k < 3; k++) id.data[4 * p + k] = this.rgb ? this.rgb[3 * p + k] : 244;
      id.data[4 * p + 3] = 255;
    }
    ctx.putImageData(id, 0, 0);
    this.$('picture-paint').hidden = !this.rgb;
    if (!this.rgb) this.note('No picture: text to image. Pick or drop one to start from it.');
    this.drawMask();
    this.showStrength();
  }

  drawMask() {
    const ctx = this.$('mask-canvas').getContext('2d'), id = ctx.createImageData(this.W, this.H);
    for (let p = 0; p < this.W * this.H; p++) if (this.grey?.[p] >= 128) id.data.set([255, 64, 64, 150], 4 * p);
    ctx.putImageData(id, 0, 0);
  }

  task() {
    return this.grey ? INPAINT : IMAGE_TO_IMAGE;
  }

  showStrength() {
    if (!this.strengthTouched) this.strength = DEFAULT_STRENGTH[this.task()];
    this.$('strength').value = String(this.strength); // the slider shows it (snapped to its step); `strength` is what runs
    this.$('strength-value').textContent = `${this.strength}${this.strengthTouched ? '' : ' (default)'}`;
    this.$('strength-row').hidden = !this.rgb;
  }

  /** Check mode's ?init_image=URL&mask=URL&strength=S (URLs against `base`, the page's). */
  async fromParams(params, base) {
    const init = params.get('init_image'), mask = params.get('mask'), strength = params.get('strength');
    if (!init) {
      if (mask || strength) throw new BundleError(`${mask ? `mask=${mask}` : `strength=${strength}`}: only with init_image=URL`);
      return;
    }
    if (!this.enabled) throw new BundleError(`init_image=${init}: the bundle has no encode_image stage (tasks ${JSON.stringify(pipelineOf(this.man).tasks ?? [])}): export it with tasks: [text_to_image, image_to_image, inpaint]`);
    const url = new URL(init, base).href;
    await this.setPicture(await fetchBytes(url, 'init_image'), url);
    if (mask) {
      const murl = new URL(mask, base).href;
      await this.setMask(await fetchBytes(murl, 'mask'), murl);
    }
    if (strength !== null) {
      this.strength = checkStrength(Number(strength), 'strength');
      this.strengthTouched = true;
      this.showStrength();
    }
  }

  /** generate.js's opts.image (null: text to image). */
  input() {
    if (!this.enabled || !this.rgb) return null;
    return { pixels: this.pixels, mask: this.grey ? latentMask(this.grey, this.man) : null, grey: this.grey ?? null,
      strength: this.strengthTouched ? this.strength : null };
  }

  /** What the run started from, for the check's JSON; `task`: generate's result.task. */
  describe(task) {
    return { ...task, init_image: this.rgb ? this.source : null, mask: this.grey ? this.maskSource : null };
  }
}

/** Why a run (`task`: generate's result.task; `controls`: its PictureControls) is not the reference's (`ref`:
 *  reference.json, whose init_image / mask / strength say what run-bundle started from), or null when it is. */
export function pictureMismatch(ref, task, controls, base) {
  const at = (rel) => (rel ? new URL(`reference/${rel}`, base).href : null);
  const want = ref.init_image ? { init_image: at(ref.init_image), mask: at(ref.mask), strength: ref.strength } : null;
  const got = task.task === 'text_to_image' ? null : { init_image: controls.source, mask: controls.grey ? controls.maskSource : null, strength: task.strength };
  if (JSON.stringify(want) === JSON.stringify(got)) return null;
  const say = (v) => (v ? `from picture ${v.init_image}${v.mask ? ` with mask ${v.mask}` : ''} at strength ${v.strength}` : 'text to image');
  return `the reference is ${say(want)}; this run is ${say(got)}`;
}
