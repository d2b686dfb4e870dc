// Issue 50: what the GPU holds for WebGPU resources shaped as LiteRT.js 2.5.3 makes a model's weights (rgba32float 2D
// textures, usage 15, written with queue.writeTexture), against their bytes. The page's resident models hold about
// twice their ledger (web/static/gpu_device.js) on one H200; this separates the texture itself from its upload.
//   node benchmarks/webgpu_memory_probe.mjs [--mb 1024] [--shape 64x576] [--rounds 1] [--pause 1500] [--out probe.json]
// Phases, each settled (queue.onSubmittedWorkDone) and then read after --pause ms (for nvidia-smi; 0 reads at once),
// the GPU from nvidia-smi for this process (host RSS too: on lavapipe the GPU's memory is the host's): textures created;
// written (writeTexture, --shape each); after one more submission, then --rounds - 1 more, each its own phase; the same
// bytes as storage buffers created and written (writeBuffer); everything destroyed. Prints one JSON object (and writes
// --out). Here on lavapipe, 64 MB: textures written +118 MB of RSS, buffers +65 MB.
//
// Why the staging goes at a later submission, and not always at the first (issue 66): Dawn gives a finished write's
// staging back (DynamicUploader::Deallocate, 4 MB ring buffers) only in a device tick that sees the write's serial
// completed, and it ticks a device only while that device has work in flight. dawn.node calls ProcessEvents (each
// device's tick, then the event poll that resolves onSubmittedWorkDone) only while a promise is pending. So after the
// writes' onSubmittedWorkDone nothing ticks until a later submission; and when the GPU finishes between a tick and the
// poll of one ProcessEvents, that submission's promise resolves before any tick saw it, and the staging stays until the
// next one. Each tick's Deallocate also erases about every other empty ring buffer (as Dawn's source reads), so what
// one submission frees (none, half, three quarters) depends on how many ticks it saw: on lavapipe, whose "GPU" is CPU
// threads, that varies with the machine's load. A pause does not help (nothing ticks while no promise is pending); more
// submissions do: on the 2-core CPU, loaded or not, the RSS reached its floor within three
// (benchmarks/results/webgpu_memory_probe_rounds_lavapipe_cpu.json; tests/benchmarks/test_webgpu_memory_probe.py).
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import { createRequire } from 'node:module';
import { parseArgs } from 'node:util';

const require = createRequire(new URL('../web/node_runner.mjs', import.meta.url));
const { values } = parseArgs({ options: { mb: { type: 'string', default: '1024' }, shape: { type: 'string', default: '64x576' },
  out: { type: 'string' }, pause: { type: 'string', default: '1500' }, rounds: { type: 'string', default: '1' } } });
const [W, H] = values.shape.split('x').map(Number);
const MB = Number(values.mb), PAUSE = Number(values.pause), ROUNDS = Number(values.rounds);
if (!(W > 0 && H > 0 && MB > 0)) throw new Error(`--shape WxH and --mb must be positive, got ${values.shape}, ${values.mb}`);
if (!(Number.isInteger(ROUNDS) && ROUNDS >= 1 && PAUSE >= 0)) throw new Error(`--rounds must be >= 1 and --pause >= 0, got ${values.rounds}, ${values.pause}`);

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
  if (PAUSE > 0) await new Promise((r) => setTimeout(r, PAUSE));
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
for (let round = 1; round <= ROUNDS; round++) { // one more submission each: Dawn reclaims what it staged for the
  device.queue.submit([device.createCommandEncoder().finish()]); // writes in a tick that sees them done (above)
  await settle(round === 1 ? 'textures written, later' : `textures written, submission ${round}`);
}
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
