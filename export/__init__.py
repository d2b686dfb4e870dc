"""pocketdiff.export: mobile bundles that run entirely on the LiteRT GPU delegate.

- `verb`: `pocketdiff export` (Config, run) -- rewrites, conversion, weight storage,
  delegate verification, parity, fp16 scan, bundle
- `run_bundle`: `pocketdiff run-bundle` -- text -> PNG with the bundle and ai-edge-litert only
- `bundle_images`: the interface other stages use (evaluate's `kind: bundle`): `bundle_info`,
  `generate_images` -> float images [N, 3, H, W]
- `rewrites`: the module swaps (Linear -> 1x1 conv, rank-4 GroupNorm, clipped GELU, conv
  serialization, chunked attention, residual-stream rescaling)
- `components`: the three graphs with fixed shapes; `exporter`: one component end to end
- `convert`, `tflite_file`: litert-torch, then fp16 / int8 (bit-exact codes) storage in the flatbuffer
- `int8`: compress's quantized checkpoints -> pieces carried into the .tflite
- `delegate`: the GPU delegate in a child process (lavapipe or the machine's Vulkan driver)
- `parity`, `fp16scan`, `bundle`: metrics and thresholds, overflow scan, manifest checks
"""
