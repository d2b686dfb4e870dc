// Does LiteRT.js 2.5.3's loadModelAndWeights (weights streamed into WebGPU buffers outside the wasm heap) take a
// .tflite whose constant tensors point into external buffers (TFLite schema: Model.external_buffer_groups,
// external_buffers; Tensor.external_buffer)? Runs DIR/plain.tflite with loadAndCompile and DIR/ext.tflite +
// DIR/weights.bin with loadModelAndWeights on WebGPU (Dawn's Node bindings), each on DIR/x.bin against DIR/y.bin.
// Made by benchmarks/web_external_weights_probe.py; prints one JSON line.
import fs from 'node:fs';
import path from 'node:path';
import vm from 'node:vm';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

const WEB = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', 'web');
const WASM_DIR = path.join(WEB, 'node_modules/@litertjs/core/wasm');
const DIR = process.argv[2];
const webgpu = await import(path.join(WEB, 'node_modules/webgpu/index.js'));
Object.assign(globalThis, webgpu.globals);
globalThis.navigator = { gpu: webgpu.create([]), userAgent: 'node' };
globalThis.self = globalThis;
globalThis.require = createRequire(import.meta.url);
globalThis.__dirname = WASM_DIR + path.sep;
globalThis.__filename = path.join(WASM_DIR, 'loader.js');
globalThis.importScripts = (url) => {
  const f = String(url).startsWith('file:') ? fileURLToPath(url) : String(url);
  vm.runInThisContext(fs.readFileSync(f, 'utf8'), { filename: f });
};
const core = await import(path.join(WEB, 'node_modules/@litertjs/core/dist/index.js'));
await core.loadLiteRt(WASM_DIR + path.sep);
const f32 = (name) => { const b = fs.readFileSync(path.join(DIR, name)); return new Float32Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength)); };
const x = f32('x.bin'), y = f32('y.bin'), shape = JSON.parse(fs.readFileSync(path.join(DIR, 'shape.json'), 'utf8'));

async function check(model) {
  const t = await new core.Tensor(x, shape).copyTo('webgpu');
  const [o] = await model.run([t]);
  const out = Float32Array.from((await o.copyTo('wasm')).toTypedArray());
  let maxAbs = 0;
  for (let i = 0; i < y.length; i++) maxAbs = Math.max(maxAbs, Math.abs(out[i] - y[i]));
  return { ok: true, fully_accelerated: model.isFullyAccelerated, max_abs: maxAbs };
}

const result = {};
const calls = [];
const log = console.log;
console.log = (...a) => { if (String(a[0]).startsWith('[StreamWeights]')) calls.push(String(a[0]).slice(0, 200)); else log(...a); };
try {
  const plain = await core.loadAndCompile(new Uint8Array(fs.readFileSync(path.join(DIR, 'plain.tflite'))), { accelerator: 'webgpu' });
  result.plain = await check(plain);
  plain.delete();
} catch (e) {
  result.plain = { ok: false, error: String(e.message).replace(/\s+/g, ' ') };
}
try {
  const w = new Uint8Array(fs.readFileSync(path.join(DIR, 'weights.bin')));
  const stream = new ReadableStream({ start(c) { c.enqueue(w); c.close(); } });
  const ext = await core.loadModelAndWeights(new Uint8Array(fs.readFileSync(path.join(DIR, 'ext.tflite'))), stream, { accelerator: 'webgpu' });
  result.external = await check(ext);
} catch (e) {
  result.external = { ok: false, error: String(e.message).replace(/\s+/g, ' ') };
}
result.external.stream_weights_log = calls;
console.log = log;
process.stdout.write(JSON.stringify(result) + '\n');
process.exit(0);
