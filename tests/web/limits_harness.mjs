// Runs web/static/tflite.js, limits.js and gpu_device.js's GpuLedger under node (no GPU) for
// tests/web/test_limits_gpu_memory.py. argv: <request json file>; prints one JSON answer.
import { readFileSync } from 'node:fs';
import { tfliteSizes } from '../../web/static/tflite.js';
import { bundleLimits, componentProblem, parseLimitOverrides, preflight } from '../../web/static/limits.js';
import { GpuLedger } from '../../web/static/gpu_device.js';

const req = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const out = { sizes: {}, problems: [], errors: [] };
for (const f of req.files) out.sizes[f] = tfliteSizes(readFileSync(f));
for (const c of req.problems) {
  const sizes = tfliteSizes(readFileSync(c.file));
  out.problems.push(componentProblem(c.name, sizes, readFileSync(c.file).byteLength, bundleLimits(c.adapter, c.overrides), c.opts));
}
for (const items of req.bad_overrides) {
  try {
    bundleLimits({}, parseLimitOverrides(items));
    out.errors.push(null);
  } catch (e) {
    out.errors.push(e.message);
  }
}
// preflight over a bundle-like object reading files from the bundle folder
const man = JSON.parse(readFileSync(`${req.bundle}/manifest.json`, 'utf8'));
const parts = (k, base) => (man[k] ? man[k].components : [base]);
const bundle = { man, teParts: parts('text_encoder_chunks', 'text_encoder'), unetParts: parts('unet_chunks', 'unet'), decoder: ['vae_decoder'],
  fetchBytes: async (rel) => { const b = readFileSync(`${req.bundle}/${rel}`); return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); } };
out.preflight = [];
for (const p of req.preflights) {
  try {
    out.preflight.push({ ok: await preflight(bundle, bundleLimits(p.adapter, p.overrides), p.opts) });
  } catch (e) {
    out.preflight.push({ error: e.message, name: e.constructor.name });
  }
}
// the ledger on a fake device: buffers and textures counted until destroyed, the rest when the device goes
const ledger = new GpuLedger();
const fake = () => ({ createBuffer: (d) => ({ destroy() {}, d }), createTexture: (d) => ({ destroy() {}, d }) });
const dev = fake();
const untrack = ledger.track(dev, 'device 1', ['unet.0']);
const a = dev.createBuffer({ size: 1 << 20 });
dev.createBuffer({ size: 3 << 20 });
dev.createTexture({ size: [256, 256, 1], format: 'rgba16float' });
dev.createBuffer({ size: 512 }); // a uniform's size: 64 KiB as a 64 KiB-granular sub-allocator rounds it
const steps = [ledger.summary()];
a.destroy();
a.destroy(); // twice: counted once
steps.push(ledger.summary());
untrack();
steps.push(ledger.summary());
out.ledger = steps;
process.stdout.write(JSON.stringify(out));
