"""pocketdiff.compress.prune: structured channel pruning + recovery (`pocketdiff prune`).

Public entry points (importable from here; each lives in the module named beside it):

- `run(Config(...), output_dir)`: the prune verb: select, score, remove channels, recover
  by distillation from the unpruned model, measure (`verb`; the recipe in `config`,
  its `prune:` section in `settings`)
- `prune_unet(unet, PruneSettings(...))`: prune a UNet in memory, returns (pruned, plan)
  (`pruning`)
- `load_pruned_pipeline(folder)` / `load_pruned_unet(folder)`: load what `prune` saved
  (stock diffusers folders whose unet/ names `PrunedUNet2DConditionModel`) (`model`)

Other modules: `blocks` (block removal, BK-SDM: the `blocks:` section, the slim stock UNet from the teacher's
kept blocks, its block map and feature pairs; the config change itself is `pocketdiff.unet_blocks`), `targets` (conv profile, target selection), `graph` (ResNet-internal channel
groups), `stream` (residual-stream channels shared through residuals and skip
concatenations, traced), `importance` (channel scoring callables), `allocation` (how many
and which channels each group or stream keeps), `slicing` (the surgery), `recovery`
(distillation back from the unpruned model), `measure` (probes, FD / CLIP, plots).
Attributes load on first use, so loading a pruned model imports no pruning or training code.
"""
from __future__ import annotations

from pocketdiff.lazy import lazy_attributes

_ENTRY_POINTS = {
    "Config": "config",
    "run": "verb",
    "PruneSettings": "settings",
    "prune_unet": "pruning",
    "PrunedUNet2DConditionModel": "model",
    "is_pruned_pipeline": "model",
    "load_pruned_pipeline": "model",
    "load_pruned_unet": "model",
}
__all__ = sorted(_ENTRY_POINTS)
__getattr__, __dir__ = lazy_attributes(globals(), _ENTRY_POINTS)
