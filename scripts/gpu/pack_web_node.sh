#!/usr/bin/env bash
# Here (before a GPU-machine call of scripts/gpu/web_node.sh): node and the npm packages web/node_runner.mjs needs,
# packed small enough to carry beside the bundle: .webnode/node.xz (this machine's node binary, linux-x64) and
# .webnode/node_modules.tar.xz (web/node_modules with only LiteRT.js's plain and compat wasm, which it picks without
# the threads / jspi options, and Dawn's linux-x64 build of npm webgpu). Carry .webnode (about 40 MB).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
[ -f web/node_modules/webgpu/package.json ] || { echo "pack_web_node: web/node_modules is incomplete: bash scripts/setup.sh" >&2; exit 2; }
rm -rf .webnode && mkdir -p .webnode
xz -T0 -6 -c "$(readlink -f "$(command -v node)")" > .webnode/node.xz
tar -C web -cJf .webnode/node_modules.tar.xz \
  --exclude='node_modules/@litertjs/core/wasm/litert_wasm_jspi_internal.*' \
  --exclude='node_modules/@litertjs/core/wasm/litert_wasm_threaded_internal.*' \
  --exclude='node_modules/webgpu/dist/darwin-*' --exclude='node_modules/webgpu/dist/win32-*' \
  --exclude='node_modules/webgpu/dist/linux-arm64' node_modules
du -sh .webnode/*
