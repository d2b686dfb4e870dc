// tests/web/test_img2img_js.py's node side: web/static/png.js and image_input.js on the request's pictures.
//   node img2img_harness.mjs STATIC_DIR REQUEST.json  ->  JSON on stdout
// request: {cases: [{png, ch (3: RGB, 1: grey), width, height (the bundle's image size), vae_factor, mask_of (a
// picture's [w, h]: read as a mask)}]}; each answer: {values (the fitted bytes), warning, latent_mask} or {error}.
import fs from 'node:fs';
import path from 'node:path';
import zlib from 'node:zlib';
import { pathToFileURL } from 'node:url';

const [staticDir, requestPath] = process.argv.slice(2);
const load = (name) => import(pathToFileURL(path.join(staticDir, name)).href);
const { decodePng } = await load('png.js');
const { fitted, latentMask, maskGrey, pictureTensor } = await load('image_input.js');
const request = JSON.parse(fs.readFileSync(requestPath, 'utf8'));

async function answer(c) {
  const man = { image: { width: c.width, height: c.height }, latent: { vae_factor: c.vae_factor ?? 4 } };
  try {
    const pic = await decodePng(new Uint8Array(fs.readFileSync(c.png)), (b) => zlib.inflateSync(b), c.png);
    if (c.mask_of) {
      const grey = maskGrey(pic, man, c.mask_of);
      return { values: Array.from(grey), latent_mask: Array.from(latentMask(grey, man).data) };
    }
    if (c.ch === 3) {
      const t = pictureTensor(pic, man);
      return { values: Array.from(t.rgb), tensor_sum: t.data.reduce((a, b) => a + b, 0), warning: t.warning };
    }
    return { values: Array.from(fitted(pic, 1, man, 'x')) };
  } catch (e) {
    return { error: `${e.constructor.name}: ${e.message}` };
  }
}

const out = [];
for (const c of request.cases) out.push(await answer(c));
process.stdout.write(JSON.stringify(out));
