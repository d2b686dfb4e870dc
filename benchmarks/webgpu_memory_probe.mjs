// Issue 50: what the GPU holds for WebGPU resources shaped as LiteRT.js 2.5.3 makes a model's weights (rgba32float 2D
// textures, usage 15, written with queue.writeTexture), against their bytes. The page's resident models hold about
// twice their ledger (web/static/gpu_device.js) on one H200; this separates the texture itself from its upload.
//   node benchmarks/webgpu_memory_probe.mjs [--mb 1024] [--shape 64x576] [--out probe.json]
// Phases, each followed by a settle (queue.onSubmittedWorkDone) and a pause, the GPU read from nvidia-smi for this
// process (host RSS too: on lavapipe the GPU's memory is the host's): textures created; written (writeTexture, --shape
// each); after one more submission; the same bytes as storage buffers created and written (writeBuffer); everything
// destroyed. Prints one JSON object (and writes --out). Here on lavapipe, 64 MB: textures written +118 MB of RSS,
// buffers +65 MB.
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import { createRequire } from 'node:module';
import { parseArgs } from 'node:util';

const require = createRequire(new URL('../web/node_runner.mjs', import.meta.url));
const { values } = parseArgs({ options: { mb: { type: 'string', default: '1024' }, shape: { type: 'string', default: '64x576' },
  out: { type: 'string' }, pause: { type: 'string', default: '1500' } } });
const [W, H] = values.shape.split('x').map(Number);
const MB = Number(values.mb), PAUSE = Number(values.pause);
if (!(W > 0 && H > 0 && MB > 0)) throw new Error(`--shape WxH and --mb must be positive, got ${values.shape}, ${values.mb}`);

function gpuMb() { // this process's GPU memory (NVML through nvidia-smi); null where there is none
  try {
    const rows = execFileSync('nvidia-smi', ['--query-compute-apps=pid,used_memory', '--format=csv,noheader,nounits']).toString();
    const mine = rows.split('\n').map((r) => r.split(',').map((s) => s.trim())).filter((r) => Number(r[0]) === process.pid);
    return mine.reduce((a, r) => a + Number(r[1]), 0);
  } catch { return null; }
}

const webgpu = require('webgpu');
Object.assign(globalThis, webgpu.globals);
const gpu = webgpu.create([]); // kept alive: the adapter and device die with it
globalThis.navigator = { gpu };
const adapter = await gpu.requestAdapter({ powerPreference: 'high-performance' });
const device = await adapter.requestDevice({ requiredLimits: { maxBufferSize: adapter.limits.maxBufferSize,
  maxStorageBufferBindingSize: adapter.limits.maxStorageBufferBindingSize } });
const texBytes = W * H * 16; // rgba32float
const count = Math.max(1, Math.round((MB * 2 ** 20) / texBytes));
const rows = [];
const settle = async (phase) => {
  await device.queue.onSubmittedWorkDone();
  await new Promise((r) => setTimeout(r, PAUSE));
  rows.push({ phase, gpu_mb: gpuMb(), rss_mb: Math.round(process.memoryUsage().rss / 2 ** 20) });
  console.error(JSON.stringify(rows.at(-1)));
};

await settle('device');
const data = new Float32Array(W * H * 4).fill(0.5);
const textures = [];
for (let i = 0; i < count; i++) textures.push(device.createTexture({ size: [W, H], format: 'rgba32float', usage: 15 }));
await settle('textures created');
for (const t of textures) device.queue.writeTexture({ texture: t }, data, { bytesPerRow: W * 16, rowsPerImage: H }, [W, H]);
await settle('textures written');
device.queue.submit([device.createCommandEncoder().finish()]); // one more submission: the implementation may reclaim
await settle('textures written, later');                       // what it staged for the writes once the GPU passed them
const buffers = [];
for (let i = 0; i < count; i++) {
  const b = device.createBuffer({ size: texBytes, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC });
  device.queue.writeBuffer(b, 0, data);
  buffers.push(b);
}
await settle('buffers created and written');
for (const t of textures) t.destroy();
await settle('textures destroyed');
for (const b of buffers) b.destroy();
await settle('buffers destroyed');
const result = { what: 'GPU memory of rgba32float textures (usage 15) and storage buffers of the same bytes, this process (nvidia-smi)',
  shape: [W, H], count, bytes_mb_each_kind: Math.round((count * texBytes) / 2 ** 20), adapter: adapter.info?.description ?? null, rows };
if (values.out) fs.writeFileSync(values.out, JSON.stringify(result, null, 1));
console.log(JSON.stringify(result));
device.destroy();
