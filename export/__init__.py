"""pocketdiff.export: mobile bundles that run entirely on the LiteRT GPU delegate (the converter).

- `verb`: `pocketdiff export` (Config, run) -- rewrites, conversion, weight storage,
  delegate verification, parity, fp16 scan, bundle
- `rewrites`: the module swaps (Linear -> 1x1 conv, rank-4 GroupNorm, clipped GELU, conv
  serialization, chunked attention, residual-stream rescaling)
- `components`: the three graphs with fixed shapes; `exporter`: one component end to end
- `convert`, `tflite_file`: litert-torch, then fp16 / int8 (bit-exact codes) storage in the flatbuffer
- `int8`: compress's quantized checkpoints -> pieces carried into the .tflite
- `tiled_vae`, `tiled_export`: the VAE decoder as a head + a tile graph, and its parity
- `parity`, `fp16scan`, `bundle`, `device_profile`: thresholds, overflow scan, the manifest
  writer, a phone profile's budgets

What runs a bundle -- the manifest contract and its checks, the reference runner, the decode
paths, verify-bundle, the GPU delegate in a child process -- is `pocketdiff.runtime`; export
imports it (to check what it wrote), never the other way round.
"""
