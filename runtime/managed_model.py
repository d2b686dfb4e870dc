"""A bundle's models as managed models, and the loading policies the pipeline chooses between (numpy only).

Apple's ManagedMLModel idea, written here: a `ManagedModel` is one model of the bundle (a component, or one
chunk of a chunked one) that is loaded on use (`get`), released on request (`release`), and keeps the memory
measured at its phases (`phases`: opened, compiled, settled, first_run, steady_run, released; runtime/memory.py).
It does not decide when: the pipeline (run_bundle.BundleRunner) asks its `LoadingPolicy`.

The policies (`loading_policy` picks one from run-bundle's flags and refuses a contradictory set in one line):
- `plain`: every model loaded at the first prompt and kept (the naive app), one LiteRT environment for all;
- `pipelined` (`--pipelined`): each model loaded just before its use and released right after it, one at a
  time, each model (a chunked one's chunks together) in an environment of its own, destroyed with it; with
  `--keep unet` (an app drawing many images) the kept components stay from prompt to prompt and only the others
  load just in time around them;
- `streamed` (`--pipelined --stream-unet`): pipelined, and a chunked UNet's chunks loaded for each step and
  released after it (one chunk in memory at a time);
- `workers` (`--load-workers N`): plain, the models compiled in N worker processes at once
  (runtime/load_workers.py);
- `overlapped` (`--pipelined --overlap-loads`): pipelined, each model (a UNet's chunks together) compiled and run in a
  worker process of its own, the next one compiling while the current one loads or runs, as far as
  `--memory-budget-mb` lets (runtime/overlap.py).

`--pipelined --one-environment`: pipelined (or with `--keep`), but every model in the one LiteRT environment the runner
holds, as plain mode's: no environment (Vulkan device, program cache reader) is made per model, and what a released
model's own release frees goes at once while what only the environment frees stays until the runner closes (issue 66
measured which is which: benchmarks/startup_levers.py `env_probe`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from pocketdiff.errors import PocketdiffError

from .load_workers import check_count

PLAIN, PIPELINED, STREAMED, WORKERS, OVERLAPPED = "plain", "pipelined", "streamed", "workers", "overlapped"


@dataclass(frozen=True)
class LoadingPolicy:
    """When the pipeline loads and releases its models."""

    name: str  # plain | pipelined | streamed | workers | overlapped
    up_front: bool  # every model loaded at the first prompt and kept for every prompt
    release_after_use: bool  # each model released right after its use (one in memory at a time)
    stream_unet: bool  # a chunked UNet's chunks loaded for each step and released after it
    own_environments: bool  # each model (a chunked one's chunks together) in a LiteRT environment of its own
    load_workers: int = 0  # > 0: compiled in that many worker processes
    overlap: bool = False  # each model in a worker process of its own, the next one compiled during the current one
    keep: tuple[str, ...] = ()  # pipelined: components whose models stay resident from prompt to prompt (an app's UNet)

    def releases(self, component: str) -> bool:
        """Whether a model of `component` goes right after its use."""
        return self.release_after_use and component not in self.keep


def loading_policy(accelerator: str, pipelined: bool = False, stream_unet: bool = False,
                   load_workers: Optional[int] = 0, overlap_loads: bool = False, keep: tuple = (),
                   one_environment: bool = False) -> LoadingPolicy:
    """The policy run-bundle's flags ask for; a contradictory set is one line naming the flags.
    `load_workers` None or 0 (the API's default): no workers; the CLI refuses an explicit 0 (run_bundle.main).
    `keep` (pipelined): components kept resident between prompts, the others loaded just in time around them."""
    keep = tuple(keep or ())
    if one_environment and (not pipelined or accelerator != "gpu" or overlap_loads):
        raise PocketdiffError("--one-environment keeps a pipelined runner's models in one LiteRT environment: it needs "
                              "--pipelined and --accelerator gpu, and no --overlap-loads (whose models live in worker processes)")
    own = accelerator == "gpu" and not one_environment
    if keep and (not pipelined or overlap_loads or (stream_unet and "unet" in keep)):
        raise PocketdiffError(f"--keep {','.join(keep)} keeps those models between prompts while the others load just in time: "
                              "it needs --pipelined, and no --overlap-loads (nor --stream-unet with --keep unet)")
    if keep:
        return LoadingPolicy(STREAMED if stream_unet else PIPELINED, False, True, stream_unet, own, keep=keep)
    if overlap_loads and (not pipelined or accelerator != "gpu" or stream_unet or load_workers):
        raise PocketdiffError("--overlap-loads compiles the next model in a worker process while the current one runs: it "
                              "needs --pipelined and --accelerator gpu, and no --stream-unet or --load-workers")
    if overlap_loads:
        return LoadingPolicy(OVERLAPPED, False, True, False, False, overlap=True)
    if stream_unet and not pipelined:
        raise PocketdiffError("--stream-unet loads each UNet chunk for each step: it needs --pipelined (the other models "
                              "are then loaded just in time too)")
    if load_workers and (pipelined or accelerator != "gpu"):
        raise PocketdiffError("--load-workers compiles every model at once in worker processes: it needs --accelerator gpu "
                              "and no --pipelined (which loads one model at a time)")
    if load_workers:
        return LoadingPolicy(WORKERS, True, False, False, False, check_count(load_workers))
    if pipelined:
        return LoadingPolicy(STREAMED if stream_unet else PIPELINED, False, True, stream_unet, own)
    return LoadingPolicy(PLAIN, True, False, False, False)


class ManagedModel:
    """One model of a bundle: `get()` loads it when it is not resident (`open()` -> a compiled model with
    `load_s`), `release()` frees it (`close(model)`), `phases` the memory marks measured for it."""

    def __init__(self, name: str, open: Callable[[], object], close: Callable[[object], None]):
        self.name = name
        self._open, self._close = open, close
        self.model = None
        self.loads = 0  # how many times it was loaded (streamed: once per step)
        self.load_s: list[float] = []  # each load's seconds
        self.phases: list[dict] = []  # the memory marks of its phases (the runner's `_mark` adds them)

    @property
    def loaded(self) -> bool:
        return self.model is not None

    def get(self):
        """The compiled model, loaded now if it is not resident."""
        if self.model is None:
            t0 = time.perf_counter()
            self.model = self._open()
            self.loads += 1
            self.load_s.append(float(getattr(self.model, "load_s", time.perf_counter() - t0)))
        return self.model

    def release(self) -> bool:
        """Free the model (and what it alone held); False when it was not loaded."""
        if self.model is None:
            return False
        model, self.model = self.model, None
        self._close(model)
        return True

    def memory(self) -> dict:
        """What was measured for this model: its loads and its phases' marks (host / GPU memory, runtime/memory.py)."""
        return {"name": self.name, "loads": self.loads, "load_s": list(self.load_s), "phases": list(self.phases)}
