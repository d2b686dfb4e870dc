"""pocketdiff.demo: `pocketdiff demo`, the whole chain (distill, calibrate, prune, evaluate,
export, run-bundle) on the embedded default.

A stage of its own (top-level `demo/`, mapped by pyproject): it orchestrates the other
stages, so it lives outside the core, which knows no stage.

Public entry points: `run_demo(out, smoke)` -> report dict; `main(args)` for the CLI.
"""
from .chain import main, run_demo

__all__ = ["main", "run_demo"]
