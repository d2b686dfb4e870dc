#!/usr/bin/env bash
# The web page's needs (idempotent, quick when done): the pinned LiteRT.js npm package into
# web/node_modules (copied into every bundle's web/ page by `pocketdiff web`, never loaded
# from a CDN) beside Dawn's Node bindings (npm webgpu, for web/node_runner.mjs: the page's
# pipeline on a GPU without a browser), and Chromium for the page's headless check (Debian package `chromium`).
# Without root or apt, a missing Chromium is reported and the browser tests skip, saying why.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WANT="$(sed -n 's/.*"@litertjs\/core": "\([0-9.]*\)".*/\1/p' web/package.json)"
have_litertjs() {
  [ -f web/node_modules/@litertjs/core/package.json ] &&
    grep -q "\"version\": \"$WANT\"" web/node_modules/@litertjs/core/package.json &&
    [ -f web/node_modules/@litertjs/wasm-utils/dist/bundle.js ] &&
    [ -f web/node_modules/webgpu/package.json ]
}
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else return 1; fi; }
apt_install() {
  command -v apt-get >/dev/null || return 1
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1 && return 0
  as_root apt-get update >/dev/null 2>&1 || return 1
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1
}
if ! have_litertjs; then
  if ! command -v npm >/dev/null; then
    echo "setup_web: installing npm (Debian package) ..." >&2
    apt_install npm || { echo "setup_web: npm is missing and could not be installed; install Node.js + npm, then rerun" >&2; exit 1; }
  fi
  echo "setup_web: npm ci of @litertjs/core@$WANT and webgpu into web/node_modules ..." >&2
  npm ci --prefix web --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null
  have_litertjs || { echo "setup_web: web/node_modules/@litertjs is incomplete after npm ci" >&2; exit 1; }
fi
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && ! command -v google-chrome >/dev/null && [ -z "${POCKETDIFF_CHROMIUM:-}" ]; then
  echo "setup_web: installing chromium (Debian package, for the page's headless check) ..." >&2
  apt_install chromium || echo "setup_web: could not install chromium (needs root and apt); the browser tests will skip" >&2
fi
