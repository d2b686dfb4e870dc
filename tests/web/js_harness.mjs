// Runs the page's plain modules (bpe.js, sha256.js, npy.js) under node for tests/web/test_js_modules.py.
// argv: <static dir> <request json file>; prints one JSON answer.
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';
import { join } from 'node:path';

const [dir, reqPath] = process.argv.slice(2);
const req = JSON.parse(readFileSync(reqPath, 'utf8'));
const load = (name) => import(pathToFileURL(join(dir, name)).href);
const { ClipBpe } = await load('bpe.js');
const { sha256Js, sha256Hex } = await load('sha256.js');
const { parseNpy, parseNpz } = await load('npy.js');

const out = {};
const tok = new ClipBpe(JSON.parse(readFileSync(req.tokenizer_json, 'utf8')), req.tokenizer);
out.tokens = req.prompts.map((p) => {
  const e = tok.encode(p);
  return { ids: Array.from(e.ids), tokens: e.tokens, truncated: e.truncated };
});
out.sha256 = req.files.map((f) => sha256Js(readFileSync(f)));
out.sha256_subtle = await Promise.all(req.files.map((f) => sha256Hex(new Uint8Array(readFileSync(f)))));
const bytes = (f) => { const b = readFileSync(f); return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); };
out.npy = req.npy.map((f) => { const a = parseNpy(bytes(f)); return { shape: a.shape, sum: a.data.reduce((s, v) => s + Number(v), 0), first: Number(a.data[0]) }; });
out.npz = req.npz.map((f) => Object.fromEntries(Object.entries(parseNpz(bytes(f))).map(([k, a]) => [k, { shape: a.shape, sum: a.data.reduce((s, v) => s + Number(v), 0) }])));
console.log(JSON.stringify(out));
