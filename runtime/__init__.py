"""pocketdiff.runtime: run an exported bundle with the bundle's files, numpy, ai-edge-litert,
`tokenizers` and PIL alone -- no torch, no diffusers, nothing from the converter
(pocketdiff.export / train / compress / evaluate; tests/core/test_import_graph.py checks it).
BUNDLE.md states the contract an app implements; web/static/*.js is its second implementation.

Public entry points:
- `bundle.load_manifest(folder)`: read a bundle, paths kept inside it, sha256 and .tflite checked
- `manifest_check.check_bundle(folder)` / `manifest_problems(...)`: every field a runner reads,
  the io contract, sizes, each .tflite's signature (the bundle contract, as code)
- `run_bundle.BundleRunner(folder).run(prompt, seed)` and `run_bundle.generate(...)`: the
  reference runner (tokenize, text encoder, the scheduler + CFG / embedded guidance, decoder);
  `run_bundle.main` is `pocketdiff run-bundle`; `load_workers.LoadWorkers`: its models compiled and run in worker
  processes (`--load-workers N`); `overlap.OverlapLoader`: each model in a worker of its own, the next one compiled
  during the current one, within a budget checked from measured figures (`--overlap-loads`, `--memory-budget-mb`);
  `memory.PeakSampler`: the measured memory of its reports; `file_pages.release_file_pages`: a compiled model's
  .tflite pages given back (the GPU accelerator holds its weights; on by default, `release_file_pages=False` keeps them)
- `schedulers.scheduler_for(manifest["scheduler"])`: the bundle's scheduler (DDIM or LCM) behind diffusers'
  interface (`set_timesteps`, `step`); web/static/schedulers.js is the page's twin
- `tiled_decode.tiled_decode_with_stats`: the tiled VAE decode in numpy
- `verify_bundle.verify_bundle(folder)`: `pocketdiff verify-bundle` (files, io, full delegation,
  golden parity)
- `bundle_images.bundle_info` / `generate_images`: what other stages use (evaluate's `kind: bundle`)
- `delegate.run_on_delegate(model, inputs)`: one .tflite on the LiteRT GPU delegate in a child
  process (the converter's delegate checks use it too)
- `verified_files.HashLedger`: which bundle files passed the checks at an earlier launch (run-bundle's warm start)
- `tflite_file.TfliteModel`, `check_tflite_file`, `sha256_file`: reading a .tflite;
  `parity.metrics` / `check`: the comparison behind a bundle's golden tolerances
"""
