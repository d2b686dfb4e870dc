#!/usr/bin/env bash
# Here (before a GPU-machine call of scripts/gpu/web_node.sh): node and the npm packages web/node_runner.mjs needs,
# packed small enough to carry beside the bundle: .webnode/node.xz (this machine's node binary, linux-x64, stripped) and
# .webnode/node_modules.tar.xz (web/node_modules with only LiteRT.js's plain and compat wasm, which it picks without
# the threads / jspi options, and Dawn's linux-x64 build of npm webgpu). Carry .webnode (about 30 MiB).
# LAYOUT=NAME (e.g. base, the layer-cut SD-2.1 student): also .devbundle-web/, that one layout of .devbundle/ (benchmarks/
# sd21_bundle.py pack) with an index of it alone and the _shared files it names, so the carry stays under 64 MiB
# however many layouts .devbundle/ holds (base: about 19.5 MiB; with .whl/ and .gl/ about 63 MiB in all).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
[ -f web/node_modules/webgpu/package.json ] || { echo "pack_web_node: web/node_modules is incomplete: bash scripts/setup.sh" >&2; exit 2; }
rm -rf .webnode && mkdir -p .webnode
# node without its symbol table and debug info (Debian's ships both: ~99 MB, 24 MB packed; stripped 22 MB): addons such
# as Dawn's resolve N-API through the dynamic symbols, which strip keeps
NODE_BIN="$(readlink -f "$(command -v node)")"
if command -v strip > /dev/null; then
  STRIPPED=$(mktemp) && trap 'rm -f "$STRIPPED"' EXIT && strip -o "$STRIPPED" "$NODE_BIN" && NODE_BIN=$STRIPPED
fi
xz -T0 -6 -c "$NODE_BIN" > .webnode/node.xz
tar -C web -cJf .webnode/node_modules.tar.xz \
  --exclude='node_modules/@litertjs/core/wasm/litert_wasm_jspi_internal.*' \
  --exclude='node_modules/@litertjs/core/wasm/litert_wasm_threaded_internal.*' \
  --exclude='node_modules/webgpu/dist/darwin-*' --exclude='node_modules/webgpu/dist/win32-*' \
  --exclude='node_modules/webgpu/dist/linux-arm64' node_modules
du -sh .webnode/*
if [ -n "${LAYOUT:-}" ]; then
  rm -rf .devbundle-web && mkdir -p .devbundle-web
  python3 - "$LAYOUT" <<'PY'
import json, os, shutil, sys
layout = sys.argv[1]
index = json.load(open(".devbundle/index.json"))
if layout not in index["layouts"]:
    sys.exit(f"pack_web_node: layout {layout} is not in .devbundle/index.json ({', '.join(index['layouts'])})")
files = index["layouts"][layout]
for e in files.values():
    rel = os.path.join("_shared", e["shared"]) if "shared" in e else e["stored"]
    os.makedirs(os.path.dirname(os.path.join(".devbundle-web", rel)), exist_ok=True)
    shutil.copyfile(os.path.join(".devbundle", rel), os.path.join(".devbundle-web", rel))
json.dump({**index, "layouts": {layout: files}}, open(".devbundle-web/index.json", "w"), indent=1)
PY
  du -sh .devbundle-web
  du -scb .whl .gl .webnode .devbundle-web 2>/dev/null | awk 'END {printf "carry .whl .gl .webnode .devbundle-web: %.1f MiB (limit 64)\n", $1 / 1048576}'
fi
