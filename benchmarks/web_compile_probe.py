#!/usr/bin/env python
"""Which of a bundle's model files LiteRT.js compiles in the page, one file per fresh headless Chromium.

    python benchmarks/web_compile_probe.py BUNDLE --out R.json [--files unet.0.tflite,...] [--accelerator webgpu]

For each file: the bundle's page is served (`pocketdiff web` writes it, without a reference image), LiteRT.js
is loaded as the page loads it, the file is fetched and compiled with `loadAndCompile` on WebGPU (SwiftShader
here; the adapter WebGPU reports is recorded), then (--run) run once on zeros; what LiteRT.js said (ok, or its error: its wasm heap is capped at 2 GB; a
model XNNPACK failed to prepare counts as failed, from the console, as LiteRT.js returns from it anyway), the
seconds, and the peak PSS of Chromium's processes (benchmarks/_proc_tree.py). A wasm abort ends LiteRT.js
for the page, hence a fresh browser per file. Without --files: every .tflite the manifest lists.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proc_tree import TreePeak  # noqa: E402

from pocketdiff.web.headless import Chromium  # noqa: E402
from pocketdiff.web.page import PAGE_FILES, STATIC, PageConfig, write_page  # noqa: E402
from pocketdiff.web.serve import PageServer  # noqa: E402

PROBE_JS = """
(async () => {
  const ad = navigator.gpu ? await navigator.gpu.requestAdapter() : null;  // which GPU WebGPU runs on (SwiftShader or real)
  const adapter = ad && ad.info ? { vendor: ad.info.vendor, architecture: ad.info.architecture, description: ad.info.description } : null;
  // the page's own reading of LiteRT.js's console (prepare.js; app.js tapped console.error before LiteRT.js loaded)
  const prep = await import('./prepare.js');
  const mark = prep.consoleMark();
  const row = await (async () => {
  const t0 = performance.now();
  const m = await import('@litertjs/core');
  try {  // the page's app.js loads LiteRT.js at start; wait for it (or load it when the page did not)
    await m.loadLiteRt(new URL('litertjs/core/wasm/', location.href).href);
  } catch (e) {
    if (!/already loading/.test(String(e && e.message))) throw e;
  }
  for (let i = 0; i < 600 && !/ready|prompt/i.test(document.getElementById('status')?.textContent || ''); i++) {
    await new Promise((r) => setTimeout(r, 100));
  }
  const bytes = new Uint8Array(await (await fetch('../' + FILE)).arrayBuffer());
  const t1 = performance.now();
  let model;
  try {
    model = await m.loadAndCompile(bytes, { accelerator: ACC });
  } catch (e) {
    return { ok: false, stage: 'compile', error: String(e && e.message || e), fetch_ms: t1 - t0, compile_ms: performance.now() - t1 };
  }
  const t2 = performance.now();
  if (!RUN) return { ok: true, fully_accelerated: Boolean(model.isFullyAccelerated), fetch_ms: t1 - t0, compile_ms: t2 - t1 };
  try {
    const inputs = model.getInputDetails().map((d) => {
      const n = Array.from(d.shape).reduce((a, b) => a * b, 1);
      return new m.Tensor(d.dtype === 'int32' ? new Int32Array(n) : new Float32Array(n), Array.from(d.shape));
    });
    const dev = ACC === 'webgpu' ? await Promise.all(inputs.map((t) => t.copyTo('webgpu'))) : inputs;
    const outs = await model.run(dev);
    const host = outs[0].accelerator === 'wasm' ? outs[0] : await outs[0].copyTo('wasm');
    const finite = Array.from(host.toTypedArray().slice(0, 4096)).every(Number.isFinite);
    return { ok: true, fully_accelerated: Boolean(model.isFullyAccelerated), finite, fetch_ms: t1 - t0,
             compile_ms: t2 - t1, first_run_ms: performance.now() - t2 };
  } catch (e) {
    return { ok: false, stage: 'run', error: String(e && e.message || e), fetch_ms: t1 - t0, compile_ms: t2 - t1 };
  }
  })();
  return { adapter, prepare_failure: prep.prepareFailure(prep.consoleSince(mark)), ...row };
})()
"""


def probe(bundle: Path, rel: str, accelerator: str, timeout_s: float, run: bool) -> dict:
    row = {"file": rel, "file_mb": round((bundle / rel).stat().st_size / 2**20, 1), "accelerator": accelerator, "ran": run}
    t0 = time.perf_counter()
    with PageServer(bundle, host="127.0.0.1", port=0) as srv, Chromium() as chrome:
        peak = TreePeak(chrome.proc.pid)
        chrome.navigate(srv.url)
        time.sleep(2.0)
        expr = PROBE_JS.replace("FILE", json.dumps(rel)).replace("ACC", json.dumps(accelerator)).replace("RUN", json.dumps(run))
        try:
            res = chrome.send("Runtime.evaluate", {"expression": expr, "awaitPromise": True, "returnByValue": True},
                              session=True, timeout=timeout_s)
            got = res.get("result", {}).get("value") or {"ok": False, "error": json.dumps(res)[:400]}
        except Exception as e:  # an abort can take the page's renderer with it
            got = {"ok": False, "error": str(e)[:400]}
        row.update(got)
        # LiteRT.js can return from loadAndCompile (and run in ~0 ms) when XNNPACK failed to prepare the model:
        # only the console says so, as the page's prepare.js reads it
        if row.get("prepare_failure") and row.get("ok"):
            row.update(ok=False, stage="prepare", error=row["prepare_failure"][:300])
        row["console_tail"] = chrome.console[-6:]
        row["peak_pss_mb"] = peak.stop().get("peak_pss_mb")
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--out", required=True)
    ap.add_argument("--files", help="comma separated, relative to the bundle (default: every component's file)")
    ap.add_argument("--accelerator", default="webgpu", choices=("webgpu", "wasm"))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--run", action="store_true", help="also run each compiled model once on zeros (slow on SwiftShader)")
    a = ap.parse_args(argv)
    bundle = Path(a.bundle)
    man = json.loads((bundle / "manifest.json").read_text())
    files = a.files.split(",") if a.files else [c["path"] for c in man["components"].values()]
    if not (bundle / "web" / "index.html").is_file():
        write_page(PageConfig(bundle=str(bundle), reference=False))
    stale = [f for f in PAGE_FILES if not (bundle / "web" / f).is_file() or (bundle / "web" / f).read_bytes() != (STATIC / f).read_bytes()]
    if stale:  # the probe reads the console through the page's own prepare.js: the page must be this version's
        print(f"{bundle}/web was written by another pocketdiff ({', '.join(stale)} differ): pocketdiff web {bundle} --overwrite", file=sys.stderr)
        return 2
    rows = []
    for rel in files:
        rows.append(probe(bundle, rel, a.accelerator, a.timeout, a.run))
        r = rows[-1]
        print(f"{rel} ({r['file_mb']} MB): ok={r.get('ok')} compile {r.get('compile_ms') or 0:.0f} ms, peak PSS {r.get('peak_pss_mb')} MB"
              + (f", error: {r.get('error')}" if not r.get("ok") else ""), flush=True)
        Path(a.out).write_text(json.dumps({"bundle": str(bundle), "rows": rows, "date": time.strftime("%Y-%m-%d"),
                                           "litertjs": "2.5.3", "gpu": rows[0].get("adapter") or "none (no WebGPU adapter)"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
