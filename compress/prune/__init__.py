"""pocketdiff.compress.prune: structured channel pruning + recovery (`pocketdiff prune`).

Public entry points (importable from here; each lives in the module named beside it):

- `run(Config(...), output_dir)`: the prune verb: select, score, remove channels, recover
  by distillation from the unpruned model, measure (`verb`)
- `prune_unet(unet, PruneSettings(...))`: prune a UNet in memory, returns (pruned, plan) (`verb`)
- `load_pruned_pipeline(folder)` / `load_pruned_unet(folder)`: load what `prune` saved
  (stock diffusers folders whose unet/ names `PrunedUNet2DConditionModel`) (`model`)

Other modules: `graph` (target selection and ResNet-internal channel groups), `stream`
(residual-stream channels shared through residuals and skip concatenations), `importance`
(channel scoring callables), `recovery` (distillation back from the unpruned model).
Attributes load on first use, so loading a pruned model imports no pruning or training code.
"""
from __future__ import annotations

import importlib

_ENTRY_POINTS = {
    "Config": "verb",
    "run": "verb",
    "PruneSettings": "verb",
    "prune_unet": "verb",
    "PrunedUNet2DConditionModel": "model",
    "is_pruned_pipeline": "model",
    "load_pruned_pipeline": "model",
    "load_pruned_unet": "model",
}
__all__ = sorted(_ENTRY_POINTS)


def __getattr__(name: str):
    if name not in _ENTRY_POINTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_ENTRY_POINTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
