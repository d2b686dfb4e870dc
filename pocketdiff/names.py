"""One name per concept, for every stage and the runtime (no torch: the runtime imports it).

- prediction types: what a sampler converts (`PREDICTION_TYPES`); what a model is built or
  distilled to predict, and what a DDIM bundle runs (`MODEL_PREDICTION_TYPES`, a subset);
- guidance modes: `cfg` (two UNet passes), `embedded` (a guidance-distilled student takes w as
  an input: one pass), `none`;
- consistency distillation is `consistency` (`method: consistency`, the CLI, the core's
  `consistency_sampling`); `lcm` is only the manifest's `scheduler.type` token and diffusers'
  LCMScheduler, formats that existing bundles and student folders fix. Its grid size is
  `solver_steps` (configs and code); `original_inference_steps` only where those formats name it;
- float precisions: `fp32`, `fp16`, `bf16`;
- a memory cap is off at null.
"""
from __future__ import annotations

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
MODEL_PREDICTION_TYPES = PREDICTION_TYPES[:2]
GUIDANCE_MODES = ("cfg", "embedded", "none")
PRECISIONS = ("fp32", "fp16", "bf16")

# old value -> the name above (accepted in configs with one deprecation line: pocketdiff.config.renamed_value)
OLD_GUIDANCE_MODES = {"w_conditioned": "embedded"}
OLD_PRECISIONS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
