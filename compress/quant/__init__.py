"""pocketdiff.compress.quant: int8 / int4 weight quantization (`pocketdiff calibrate`).

Public entry points (importable from here; each lives in the module named beside it):

- `run(Config(...), output_dir)`: the calibrate verb, block-wise reconstruction PTQ
  (BRECQ + AdaRound) of a diffusers pipeline (`calibrate`)
- `load_quantized_pipeline(folder)`: a calibrate output back as a pipeline (`calibrate_outputs`)
- `reconstruct_unet(unet, specs, calib, ReconConfig(...))`: the whole-UNet reconstruction
  walk on its own (`reconstruct`)
- `save_quantized` / `load_quantized` / `dequantized_state_dict`, `QuantRecipe`,
  `LayerRecipe`: the quantized checkpoint format (int8 codes + per-channel scales +
  JSON recipe) that export reads (`int8_format`)

Other modules: `calibrate_config` (the verb's `Config`), `calibrate_outputs` (the files calibrate
writes: checkpoint names, recipes, pipeline folders), `block_recon` (one block's
reconstruction: `ReconConfig`, the per-block optimiser), `quantizer` (layer selection, RTN,
scale search, AdaRound), `blocks` (reconstruction blocks and their captured inputs),
`calib_data` (calibration inputs from the model's own sampling trajectories), `metrics`
(float-vs-quantized comparisons).
Attributes load on first use, so reading the checkpoint format imports no optimiser code.
"""
from __future__ import annotations

from pocketdiff.lazy import lazy_attributes

_ENTRY_POINTS = {
    "Config": "calibrate_config",
    "run": "calibrate",
    "load_quantized_pipeline": "calibrate_outputs",
    "ReconConfig": "block_recon",
    "reconstruct_unet": "reconstruct",
    "LayerRecipe": "int8_format",
    "QuantRecipe": "int8_format",
    "save_quantized": "int8_format",
    "load_quantized": "int8_format",
    "dequantized_state_dict": "int8_format",
}
__all__ = sorted(_ENTRY_POINTS)
__getattr__, __dir__ = lazy_attributes(globals(), _ENTRY_POINTS)
