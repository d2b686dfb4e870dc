// tests/web/test_lora_js.py's harness: web/static/lora.js's feeds of a LoRA file for a manifest, or its one-line refusal.
//   node lora_harness.mjs request.json  (request: {manifest, cases: [{file, scale}]}) -> [{feeds: {name: [...]}} | {error}]
import fs from 'node:fs';
import { loraFeeds } from '../../web/static/lora.js';

const req = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const out = req.cases.map(({ file, scale }) => {
  try {
    const lora = file ? { bytes: fs.readFileSync(file), scale, name: file } : null;
    const feeds = loraFeeds(req.manifest, lora);
    return { feeds: Object.fromEntries(Object.entries(feeds).map(([k, v]) => [k, { shape: v.shape, data: Array.from(v.data) }])) };
  } catch (e) {
    return { error: e.message };
  }
});
process.stdout.write(JSON.stringify(out));
