#!/usr/bin/env bash
# Rebuild tests/web/smoke_bundle, the tiny bundle the web page's CI test runs in headless
# Chromium (shipped, so CI does not spend an export on it): the shipped shapes teacher through
# the smoke export recipe, 4 DDIM steps, int8 (RTN) UNet, fp16 text encoder and decoder, every
# component checked on the LiteRT GPU delegate by export itself.
# Then tests/web/smoke_bundle_tiled: the same recipe with a one-pass tiled decoder
# (vae_tiling.scheme one_pass, GroupNorms folded; tile 6, overlap 2, margin 1: 2 x 2 tiles over
# the 8 x 8 latent). Only its files that differ from smoke_bundle's are kept there (the text
# encoder, UNet, time embedding and tokenizer are byte-identical); tests/web/conftest.py puts
# the two together, and the manifest's sha256 refuses a mix from different rebuilds.
# And tests/web/smoke_bundle_chunked: the same recipe with the UNet and the text encoder each in two
# chunks (unet_chunks=2 text_encoder_chunks=2), kept the same way (its manifest, goldens, chunks and
# whatever else differs); and tests/web/smoke_bundle_tiled_stats: a tiled decoder with iterated norm
# statistics (vae_tiling.scheme control_variate, 3 passes, the teacher's GroupNorms kept; same tiles).
# And tests/web/smoke_bundle_tiled_parts: the tiled twin's decoder with its up path in two graphs (vae_tiling.up_parts=2:
# vae_up_tile.0, vae_up_tile.1, each run over every tile in turn).
# And tests/web/smoke_bundle_lowered_decoder: the recipe with the decoder's 3x3 convs lowered to 1x1 taps
# (rewrites.conv_lowering=shifted_1x1, conv_lowering_components [vae_decoder]), which LiteRT.js runs at fp16.
# And tests/web/smoke_bundle_tiny: the block-removed UNet (issue 48's `tiny` preset) from its own resolved recipe
# (tests/web/smoke_bundle_tiny/config.yaml; another model, so it is kept whole, not as a twin).
# Usage: make_web_smoke_bundle.sh [bundle] [tiled] [chunked] [tiled_stats] [tiled_parts] [lowered_decoder] [tiny]
# (default: all seven). A twin
# rebuilt without `bundle` keeps the files that differ from the committed tests/web/smoke_bundle's.
# Rerun after a change to the bundle format (tests/web fail on a manifest they cannot read).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[ $# -gt 0 ] || set -- bundle tiled chunked tiled_stats tiled_parts lowered_decoder tiny
for B in "$@"; do
  case "$B" in bundle|tiled|chunked|tiled_stats|tiled_parts|lowered_decoder|tiny) ;;
    *) echo "make_web_smoke_bundle: unknown bundle $B (bundle, tiled, chunked, tiled_stats, tiled_parts, lowered_decoder, tiny)" >&2; exit 2 ;;
  esac
done
bash scripts/setup.sh
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
RECIPE=(--config configs/smoke/export.yaml steps=4 weights=int8 int8.rtn=true)
declare -A SETS=(
  [bundle]=""
  [tiled]="vae_tiling.enabled=true vae_tiling.scheme=one_pass vae_tiling.passes=1 vae_tiling.fold_norms=true
           vae_tiling.tile=6 vae_tiling.overlap=2 vae_tiling.margin=1 vae_tiling.min_psnr_db=30"
  [tiled_parts]="vae_tiling.enabled=true vae_tiling.scheme=one_pass vae_tiling.passes=1 vae_tiling.fold_norms=true
                 vae_tiling.tile=6 vae_tiling.overlap=2 vae_tiling.margin=1 vae_tiling.min_psnr_db=30 vae_tiling.up_parts=2"
  [chunked]="unet_chunks=2 text_encoder_chunks=2"
  [lowered_decoder]="rewrites.conv_lowering=shifted_1x1 rewrites.conv_lowering_components=[vae_decoder]"
  [tiled_stats]="vae_tiling.enabled=true vae_tiling.scheme=control_variate vae_tiling.passes=3
                 vae_tiling.tile=6 vae_tiling.overlap=2 vae_tiling.margin=1 vae_tiling.min_psnr_db=30"
)
for B in "$@"; do
  if [ "$B" = tiny ]; then  # its own recipe: tests/web/smoke_bundle_tiny/config.yaml (export writes the resolved one)
    cp tests/web/smoke_bundle_tiny/config.yaml "$TMP/tiny.yaml"
    .venv/bin/pocketdiff export --config "$TMP/tiny.yaml" --output "$TMP/$B"
  else
    # shellcheck disable=SC2086  # the sets are words
    .venv/bin/pocketdiff export "${RECIPE[@]}" ${SETS[$B]} --output "$TMP/$B"
  fi
  rm -rf "$TMP/$B/_export" "$TMP/$B/report.json" "$TMP/$B/logs" "$TMP/$B/.pocketdiff-output.json"
done
DST=tests/web/smoke_bundle
if [ -d "$TMP/bundle" ]; then
  find "$DST" -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
  cp -r "$TMP/bundle/." "$DST/"
  echo "rebuilt $DST ($(du -sh "$DST" | cut -f1))"
fi
if [ -d "$TMP/tiny" ]; then
  find tests/web/smoke_bundle_tiny -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
  cp -r "$TMP/tiny/." tests/web/smoke_bundle_tiny/
  echo "rebuilt tests/web/smoke_bundle_tiny ($(du -sh tests/web/smoke_bundle_tiny | cut -f1))"
fi
for B in "$@"; do
  [ "$B" != bundle ] && [ "$B" != tiny ] || continue
  TWIN=tests/web/smoke_bundle_$B
  find "$TWIN" -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
  (cd "$TMP/$B" && find . -type f) | while read -r f; do
    if ! cmp -s "$TMP/$B/$f" "$DST/$f"; then mkdir -p "$(dirname "$TWIN/$f")" && cp "$TMP/$B/$f" "$TWIN/$f"; fi
  done
  echo "rebuilt $TWIN ($(du -sh "$TWIN" | cut -f1), the rest from $DST)"
done
