"""run-bundle --pipelined --compile-ahead: the next GPU model compiled in a thread of the runner's own process while the
current stage runs (numpy only).

LiteRT's GPU accelerator compiles one model at a time per process (runtime/overlap.py), so a compile in a thread hides
only what is not another GPU compile: a text encoder on the CPU (`--on-cpu text_encoder`: its CPU variant made or read,
its XNNPACK runs) while the UNet compiles, and the UNet's steps while the decoder's first graph compiles. Unlike
`--overlap-loads` no worker process (interpreter, LiteRT, a Vulkan device: hundreds of MB each) is started, and at most
one model more than `--pipelined` holds is resident at a time: the one compiled ahead.

`CompileAhead` holds one worker thread and the models it was asked for: `submit(names, load)` runs `load(names)` in the
thread; `wait(name)` blocks until the model NAME is loaded there (re-raising what the thread raised) and says whether it
was; `close()` waits for what is in flight.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence


class CompileAhead:
    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-ahead")
        self.pending: dict[str, Future] = {}
        self.asked: list[str] = []  # every model compiled ahead, in order (the report's)

    def in_flight(self, name: str) -> bool:
        return name in self.pending

    def submit(self, names: Sequence[str], load: Callable[[Sequence[str]], None]) -> None:
        """Load NAMES (those not asked for already) in the thread, in order."""
        names = [n for n in names if n not in self.pending]
        if not names:
            return
        future = self.pool.submit(load, names)
        for n in names:
            self.pending[n] = future
        self.asked += names

    def wait(self, name: str) -> Optional[float]:
        """Seconds waited for NAME's load in the thread (None: it was not asked for); its error, raised here."""
        future = self.pending.pop(name, None)
        if future is None:
            return None
        t0 = time.perf_counter()
        future.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the loads in flight (their models are then released by the caller), stop the thread."""
        for future in set(self.pending.values()):
            try:
                future.result()
            except Exception:  # raised already where it was waited for, or the runner is closing after an error
                pass
        self.pending = {}
        self.pool.shutdown(wait=True)


def check_compile_ahead(compile_ahead: bool, policy, accelerator: str) -> bool:
    """--compile-ahead: a pipelined runner on the GPU (not overlapped, streamed or plain: they load otherwise)."""
    from pocketdiff.errors import PocketdiffError

    if compile_ahead and (policy.name != "pipelined" or accelerator != "gpu"):
        raise PocketdiffError("--compile-ahead compiles the next GPU model in a thread while the current stage runs: it needs "
                              "--pipelined and --accelerator gpu, and no --overlap-loads or --stream-unet")
    return bool(compile_ahead)
