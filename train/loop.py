"""The Accelerate training loop shared by train-teacher, distill and prune's recovery.

Determinism is by construction rather than by saving RNG states: the data order of epoch
`e` is a permutation seeded by (seed, e), and every random draw of optimizer step `s`
(noise, timesteps, caption dropout) comes from a generator seeded by (seed, s). Resuming
from a checkpoint therefore replays exactly what the uninterrupted run would have done,
skipping the batches already seen without loading them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import time
from time import perf_counter  # step timing; `time.time` stays the wall clock of max_time_s
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from pocketdiff.config import off_at_null
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.runtime.memory import host_peak_mb

from .checkpoints import (begin_checkpoint, commit_checkpoint, folder_bytes, list_checkpoints, load_model_state, model_state, read_state,
                          resolve_resume)
from .ema import EMA
from .memory import (
    EMA_DEVICES,
    OPTIMIZER_LIBS,
    OPTIMIZERS,
    GpuMemory,
    apply_memory_cap,
    check_free_space,
    make_optimizer,
    oom_message,
    tensor_bytes,
)
from .batch import BatchPlan, BatchRandom, batch_to_device, step_generator  # noqa: F401  (also this module's API)
from .step_reads import RATE_WARMUP_STEPS, PhaseClock, SharedDeadline, StepReads, read_step, step_profiler  # noqa: F401  (also this module's API)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
MIXED_PRECISION = ("fp32", "fp16", "bf16")  # "fp32" = accelerate's "no" (YAML reads a bare no as false)
DDP_COMM_HOOKS = ("none", "bf16", "fp16")  # gradients all-reduced as they are, or compressed to 16 bits (accelerate's comm hooks)


@dataclasses.dataclass
class LoopConfig:
    """Optimisation settings (the `train:` section of a recipe)."""

    max_steps: int = 1000
    batch_size: int = 16  # global batch per optimizer step, split across processes
    grad_accum: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    mixed_precision: str = "fp32"
    ema_decay: float = 0.0  # 0 disables EMA
    checkpoint_every: int = 100
    checkpoints_total_limit: int = 2
    log_every: int = 10
    nan_policy: str = "stop"  # stop | skip
    tensorboard: bool = False
    max_time_s: float = 0.0  # > 0: stop (with a checkpoint) at the first step past this wall time
    compile_mode: Optional[str] = None  # torch.compile the trained module in place: default | reduce-overhead | max-autotune-no-cudagraphs
    # memory (see pocketdiff.train.memory)
    optimizer: str = "adamw"  # adamw | adamw8bit (8-bit AdamW state from train.optimizer_lib)
    optimizer_lib: str = "torchao"  # adamw8bit's library: torchao (torchao.optim.AdamW8bit) | bitsandbytes
    ema_device: str = "auto"  # auto: the model's device | cpu: the float32 shadow costs no GPU memory
    ema_every: int = 1  # update the EMA every k steps (decay^k per update): a CPU shadow's copy cost / k
    gradient_checkpointing: bool = False  # diffusers' enable_gradient_checkpointing on the trained model
    memory_cap_gib: Optional[float] = None  # cap this process's CUDA allocator (set_per_process_memory_fraction); null: none
    # several processes: bf16 / fp16 halve the bytes of the gradient all-reduce (DDP communication hook); the
    # accelerator a recipe shares between its stages takes it from the section it is made from (distill: progressive)
    ddp_comm_hook: str = "none"
    # several processes: gradients are views into DDP's all-reduce buckets (and zeroed, not freed, between
    # steps) instead of a second copy: one float32 copy of the trained parameters less per GPU (3.5 GB at
    # SD-2.1 size) and no per-parameter copy into the buckets in the backward
    ddp_bucket_view: bool = True
    # > 0: a torch.profiler trace of this many steady steps (after the warm-up and the phase-timed step) of each
    # invocation, per process: OUTPUT/profile/<phase>-rank<r>.json.gz (chrome://tracing, Perfetto) + a .txt table
    profile_steps: int = 0

    def __post_init__(self) -> None:
        require(self.max_steps > 0, "train.max_steps", f"must be positive, got {self.max_steps}")
        require(self.batch_size > 0, "train.batch_size", f"must be positive, got {self.batch_size}")
        require(self.grad_accum > 0, "train.grad_accum", f"must be positive, got {self.grad_accum}")
        require(0 < self.lr < math.inf, "train.lr", f"must be positive and finite, got {self.lr}")
        require(self.mixed_precision in MIXED_PRECISION, "train.mixed_precision", f"must be one of {MIXED_PRECISION}")
        require(0.0 <= self.ema_decay < 1.0, "train.ema_decay", f"must be in [0, 1), got {self.ema_decay}")
        require(self.checkpoint_every > 0, "train.checkpoint_every", "must be positive")
        require(self.nan_policy in ("stop", "skip"), "train.nan_policy", "must be 'stop' or 'skip'")
        require(self.compile_mode is None or self.compile_mode in COMPILE_MODES, "train.compile_mode",
                f"must be null or one of {COMPILE_MODES}, got {self.compile_mode!r}")
        require(self.optimizer in OPTIMIZERS, "train.optimizer", f"must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        require(self.optimizer_lib in OPTIMIZER_LIBS, "train.optimizer_lib", f"must be one of {OPTIMIZER_LIBS}, got {self.optimizer_lib!r}")
        require(self.ema_device in EMA_DEVICES, "train.ema_device", f"must be one of {EMA_DEVICES}, got {self.ema_device!r}")
        require(self.ema_every > 0, "train.ema_every", f"must be positive, got {self.ema_every}")
        self.memory_cap_gib = off_at_null(self.memory_cap_gib, "train.memory_cap_gib")
        require(self.memory_cap_gib is None or (math.isfinite(self.memory_cap_gib) and self.memory_cap_gib > 0),
                "train.memory_cap_gib", f"must be > 0 or null (no cap), got {self.memory_cap_gib}")
        require(self.profile_steps >= 0, "train.profile_steps", f"must be >= 0 (0: off), got {self.profile_steps}")
        require(self.ddp_comm_hook in DDP_COMM_HOOKS, "train.ddp_comm_hook", f"must be one of {DDP_COMM_HOOKS}, got {self.ddp_comm_hook!r}")


def make_accelerator(cfg: LoopConfig, project_dir: Path):
    """The Accelerator for `cfg` ("fp32" is accelerate's "no"); shared by every recipe.
    `project_dir` holds the tensorboard logs (accelerate refuses tensorboard without one)."""
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    hook = DDPCommunicationHookType.NO if cfg.ddp_comm_hook == "none" else DDPCommunicationHookType(cfg.ddp_comm_hook)
    ddp = DistributedDataParallelKwargs(comm_hook=hook, gradient_as_bucket_view=cfg.ddp_bucket_view)
    acc = Accelerator(mixed_precision="no" if cfg.mixed_precision == "fp32" else cfg.mixed_precision,
                      log_with="tensorboard" if cfg.tensorboard else None, project_dir=str(project_dir), kwargs_handlers=[ddp])
    apply_memory_cap(cfg.memory_cap_gib, acc.device)  # before any model reaches the GPU
    return acc


@dataclasses.dataclass
class LoopResult:
    steps: int
    final_loss: float
    losses: list  # (step, loss) pairs logged this run and earlier runs
    ema: Optional[EMA]  # on the main process only (see `use_ema_weights`); None elsewhere and without EMA
    skipped_steps: int
    stopped_early: bool = False
    timing: dict = dataclasses.field(default_factory=dict)  # this invocation: first_step_s, samples_per_s, peak_gpu_mem_gib, ...
    ema_enabled: bool = False  # train.ema_decay > 0: the main process holds an EMA


def use_ema_weights(result: LoopResult, model: torch.nn.Module) -> None:
    """Put the run's EMA weights into `model` on every process (nothing without EMA).

    Only the main process keeps an EMA: DDP keeps the parameters equal on every process, so
    the others' would be copies, each costing its GPU a full transfer of the float32 shadow per
    update (a host shadow: 2 x 3.5 GB over PCIe at SD-2.1 size, on a link the GPUs may share)
    and its host the pinned block. The main process copies its shadow in and broadcasts the
    parameters, so a later stage built from `model` (the next distillation round's teacher) is
    the same on every process.
    """
    if not result.ema_enabled:
        return
    if result.ema is not None:
        result.ema.copy_to(model)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:  # what the EMA averages; frozen parameters are equal everywhere already
                    torch.distributed.broadcast(p.data, src=0)


LossFn = Callable[[torch.nn.Module, dict, BatchRandom], torch.Tensor]
CheckpointHook = Callable[[int, torch.nn.Module, Optional[EMA], float], None]  # (step, model, ema, train_s)
COMPANION_FILE = "companion.safetensors"


class Companion(Protocol):
    """State that trains beside the model without gradients (consistency distillation's target
    network): updated on every process after each optimizer step, saved in each checkpoint."""

    def after_update(self, model: torch.nn.Module) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def checkpoint_bytes(ckpt_dir: Path, model, optimizer, ema, companion=None, trainable_only: bool = False) -> int:
    """Bytes the next checkpoint will take: the newest one's size when there is one, else its tensors'."""
    found = list_checkpoints(ckpt_dir)
    if found:
        return folder_bytes(found[-1])
    return (tensor_bytes(model_state(model, trainable_only)) + tensor_bytes(optimizer.state_dict()["state"])
            + (tensor_bytes(ema.shadow) if ema is not None else 0)
            + (tensor_bytes(companion.state_dict()) if companion is not None else 0) + (1 << 20))


def _save(ckpt_dir, step, model, optimizer, scheduler, ema, losses, skipped, total_limit, extra, companion=None, trainable_only=False):
    found = list_checkpoints(ckpt_dir)
    check_free_space(ckpt_dir, checkpoint_bytes(ckpt_dir, model, optimizer, ema, companion, trainable_only), f"checkpoint-{step}",
                     kept=found[-1] if found else None)
    tmp = begin_checkpoint(ckpt_dir, step)
    # to the host first, then contiguous there: `.contiguous()` on the GPU copied every channels_last weight
    # into new device memory, and the allocator, near its cap, freed and synchronised for steps after the save
    save_file({k: v.detach().cpu().contiguous() for k, v in model_state(model, trainable_only).items()}, str(tmp / "model.safetensors"))
    if ema is not None:
        save_file({k: v.cpu().contiguous() for k, v in ema.shadow.items()}, str(tmp / "ema.safetensors"))
    if companion is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in companion.state_dict().items()}, str(tmp / COMPANION_FILE))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    return commit_checkpoint(tmp, step, {"losses": losses, "skipped_steps": skipped, **extra}, total_limit)


def _load(ckpt: Path, model, optimizer, scheduler, ema, companion=None, trainable_only=False):
    state = read_state(ckpt)
    if ema is not None and not (ckpt / "ema.safetensors").is_file():
        raise PocketdiffError(f"{ckpt}: no ema.safetensors although train.ema_decay > 0")
    if companion is not None and not (ckpt / COMPANION_FILE).is_file():
        raise PocketdiffError(f"{ckpt}: no {COMPANION_FILE} (the target network this training needs)")
    name = "model.safetensors"
    try:  # a damaged file or a checkpoint of another model: one line naming it, not a bare library error
        load_model_state(model, load_file(str(ckpt / name)), trainable_only)
        if ema is not None:
            name = "ema.safetensors"
            ema.shadow = {k: v.float() for k, v in load_file(str(ckpt / name)).items()}
        if companion is not None:
            name = COMPANION_FILE
            companion.load_state_dict(load_file(str(ckpt / name)))
        name = "optimizer.pt"
        opt = torch.load(ckpt / name, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
    except Exception as e:  # noqa: BLE001 - safetensors, pickle and torch raise many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PocketdiffError(f"--resume: {ckpt / name} cannot be loaded ({type(e).__name__}: {first}); "
                              "resume from an older checkpoint or start a new output folder") from None
    return state


def in_default_layout(p: torch.Tensor) -> bool:
    """Exact default strides (a 1x1 conv's channels_last weight still passes is_contiguous())."""
    return p.stride() == torch.empty(p.shape, device="meta").stride()


def use_fused_adamw(params, device) -> bool:
    """Fused AdamW (one kernel instead of several per parameter: small models are launch-bound)
    on CUDA, for parameters in the default layout. It needs every gradient in its parameter's
    layout, which channels_last parameters do not always get (an SD-2.1-size UNet with
    channels_last parameters failed with "must have same dtype, device, and layout"), so those
    keep the default implementation."""
    return torch.device(device).type == "cuda" and all(in_default_layout(p) for p in params)


def param_groups(model: torch.nn.Module, lr: float, lr_scale: dict) -> list[dict]:
    """AdamW param groups of the trainable parameters: one per `lr_scale` prefix that matches
    (lr x its multiplier), the rest at `lr`; empty groups are left out."""
    for prefix, scale in lr_scale.items():
        if not (math.isfinite(scale) and scale > 0):
            raise PocketdiffError(f"learning-rate multiplier for {prefix!r} must be > 0, got {scale}")
    groups = {prefix: [] for prefix in lr_scale}
    rest = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        prefix = next((k for k in lr_scale if name == k or name.startswith(k + ".")), None)
        (groups[prefix] if prefix is not None else rest).append(p)
    out = [{"params": rest, "lr": lr}] if rest else []
    return out + [{"params": ps, "lr": lr * lr_scale[k]} for k, ps in groups.items() if ps]


def train_loop(
    cfg: LoopConfig,
    *,
    model: torch.nn.Module,
    loss_fn: LossFn,
    dataset,
    collate: Callable,
    ckpt_dir: Path,
    seed: int,
    resume: Optional[str] = None,
    desc: str = "train",
    log_path: Optional[Path] = None,
    accelerator=None,
    extra_state: Optional[dict] = None,
    lr_scale: Optional[dict] = None,
    companion: Optional[Companion] = None,
    on_checkpoint: Optional[CheckpointHook] = None,
    trainable_only: bool = False,
) -> LoopResult:
    """Optimise the trainable parameters of `model` on `loss_fn` for `cfg.max_steps` steps.

    `loss_fn(model, batch, rng)` returns the mean loss of one micro-batch; it must draw all
    randomness from `rng` (a `BatchRandom`). Checkpoints go to `ckpt_dir`; `resume` is None,
    "latest" or a checkpoint path. On return the model holds the trained (not EMA) weights
    (`use_ema_weights` puts the EMA's in).
    `lr_scale` maps parameter-name prefixes to learning-rate multipliers (their own AdamW
    param group; the warm-up applies to every group alike).
    `companion` (a `Companion`) is updated after every optimizer step and checkpointed with the model.
    `on_checkpoint(step, model, ema, train_s)` runs on the main process after each checkpoint is saved
    (`train_s`: the training seconds so far, earlier invocations included); its own time counts neither
    there nor in the timing (`timing["paused_s"]`).
    `trainable_only`: checkpoints hold the trainable parameters alone (a LoRA over a frozen model: `model_state`).
    """
    # 1. accelerator, model on its device, optimizer, warm-up schedule, EMA
    acc = accelerator or make_accelerator(cfg, ckpt_dir.parent)
    if cfg.ema_decay > 0 and cfg.ema_decay ** cfg.max_steps > 0.05:
        acc.print(f"[{desc}] warning: train.ema_decay={cfg.ema_decay} over train.max_steps={cfg.max_steps} leaves "
                  f"{cfg.ema_decay ** cfg.max_steps:.0%} of the starting weights in the saved (EMA) weights; "
                  "a shorter run needs a lower ema_decay")
    apply_memory_cap(cfg.memory_cap_gib, acc.device)
    memory = GpuMemory(acc.device)
    memory.reset()
    params, optimizer, scheduler, ema = _optimisation(cfg, model, acc, lr_scale)

    # 2. resume from a checkpoint
    start, losses, skipped, prior_s = 0, [], 0, 0.0
    ckpt = resolve_resume(ckpt_dir, resume)
    if ckpt is not None:
        state = _load(ckpt, model, optimizer, scheduler, ema, companion, trainable_only)
        start, losses, skipped = state["step"], state.get("losses", []), state.get("skipped_steps", 0)
        prior_s = state.get("train_s", 0.0)  # checkpoints of older versions: this invocation's time only
        acc.print(f"[{desc}] resumed from {ckpt} at step {start}")

    # 3. the steps (4. the timing summary: `_Loop.result`)
    loop = _Loop(cfg, acc, memory, model, params, optimizer, scheduler, ema, dataset, collate, loss_fn, ckpt_dir, seed,
                 desc, log_path, extra_state, start, losses, skipped, companion, prior_s=prior_s, on_checkpoint=on_checkpoint,
                 trainable_only=trainable_only)
    loop.run()
    return loop.result()


def _optimisation(cfg: LoopConfig, model: torch.nn.Module, acc, lr_scale: Optional[dict]):
    """Gradient checkpointing, the model on the device (compiled in place), AdamW (or `cfg.optimizer`)
    over its trainable parameters, the warm-up schedule and the EMA: (params, optimizer, scheduler, ema)."""
    if cfg.gradient_checkpointing:
        if not hasattr(model, "enable_gradient_checkpointing"):
            raise PocketdiffError(f"train.gradient_checkpointing: {type(model).__name__} has no enable_gradient_checkpointing")
        model.enable_gradient_checkpointing()
    model.to(acc.device)
    if cfg.compile_mode:  # in place: parameter names and checkpoints stay those of the plain module
        model.compile(mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    groups = param_groups(model, cfg.lr, lr_scale or {})
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise PocketdiffError("the model has no trainable parameters")
    optimizer = make_optimizer(groups, name=cfg.optimizer, lib=cfg.optimizer_lib, lr=cfg.lr, weight_decay=cfg.weight_decay,
                               fused=use_fused_adamw(params, acc.device))
    warm = max(cfg.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    # the main process alone keeps the EMA (use_ema_weights: why, and how the others get its weights)
    ema = (EMA(model, cfg.ema_decay, device="cpu" if cfg.ema_device == "cpu" else None, every=cfg.ema_every)
           if cfg.ema_decay > 0 and acc.is_main_process else None)
    return params, optimizer, scheduler, ema


@dataclasses.dataclass
class _StepTimes:
    """Wall time of the optimizer steps alone (checkpoint saves apart): the first RATE_WARMUP_STEPS
    (compilation, autotuning, first allocations) apart from the steady state; `window` is the span
    since the last log row."""

    first_step_s: Optional[float] = None
    warmup_s: float = 0.0
    steady_s: float = 0.0
    steady_steps: int = 0
    save_s: float = 0.0
    window_s: float = 0.0
    window_steps: int = 0
    slowest_s: float = 0.0  # the slowest steady step (a straggler under DDP shows here)
    slowest_step: Optional[int] = None


class _Loop:
    """One invocation of `train_loop` from its first step on: the distributed model, the data order,
    the log file, progress bar and profiler, and what the steps have done so far."""

    def __init__(self, cfg: LoopConfig, acc, memory: GpuMemory, model, params, optimizer, scheduler, ema, dataset,
                 collate: Callable, loss_fn: LossFn, ckpt_dir: Path, seed: int, desc: str, log_path: Optional[Path],
                 extra_state: Optional[dict], start: int, losses: list, skipped: int, companion: Optional[Companion] = None,
                 prior_s: float = 0.0, on_checkpoint: Optional[CheckpointHook] = None, trainable_only: bool = False):
        self.cfg, self.acc, self.memory, self.model, self.params = cfg, acc, memory, model, params
        self.trainable_only = trainable_only
        self.scheduler, self.ema, self.dataset, self.collate, self.loss_fn = scheduler, ema, dataset, collate, loss_fn
        self.ckpt_dir, self.seed, self.desc, self.extra_state = ckpt_dir, seed, desc, extra_state
        self.companion = companion
        self.start, self.losses, self.skipped = start, losses, skipped
        self.wrapped, self.optimizer = acc.prepare(model, optimizer)
        # freeing the gradients would undo DDP's bucket views (the next backward allocates and copies again)
        self.free_grads = not getattr(self.wrapped, "gradient_as_bucket_view", False)
        if cfg.tensorboard and acc.is_main_process:
            acc.init_trackers(desc)
        self.world, self.rank = acc.num_processes, acc.process_index
        if cfg.batch_size % self.world:
            raise PocketdiffError(f"train.batch_size={cfg.batch_size} is not divisible by the {self.world} processes")
        self.plan = BatchPlan(len(dataset), cfg.batch_size, seed)
        self.log_file = open(log_path, "a", encoding="utf-8") if (log_path and acc.is_main_process) else None
        self.bar = tqdm(total=cfg.max_steps, initial=start, desc=desc, disable=not acc.is_main_process, dynamic_ncols=True)
        self.last_loss = losses[-1][1] if losses else float("nan")
        self.started, self.done, self.stopped_early = time.time(), start, False
        self.prior_s, self.paused_s = prior_s, 0.0  # training seconds of earlier invocations; time in on_checkpoint
        self.on_checkpoint = on_checkpoint
        self.samples_per_step = cfg.batch_size * cfg.grad_accum
        self.times = _StepTimes()
        self.reads = StepReads()
        self.deadline = SharedDeadline(acc, cfg.max_time_s, self.started)  # every process must agree on where to stop
        profile_dir = (log_path.parent if log_path else ckpt_dir.parent) / "profile"  # OUTPUT/profile beside logs.jsonl
        self.profiler = (step_profiler(cfg.profile_steps, RATE_WARMUP_STEPS + 1, profile_dir / f"{desc}-rank{self.rank}", memory.cuda)
                         if cfg.profile_steps and cfg.max_steps - start > RATE_WARMUP_STEPS + 1 else None)

    def run(self) -> None:
        # a collection by Python's collector pauses one process, and under DDP every other one waits for it:
        # the objects built before the loop (models, datasets) are kept out of its scans (`gc.freeze`), and a
        # checkpoint's garbage is collected inside the save, on every process (on four GPUs the slow steps
        # right after a checkpoint went away with this: docs/MEASUREMENTS.md)
        gc.collect()
        gc.freeze()
        try:
            for step in range(self.start, self.cfg.max_steps):
                if not self._step(step):
                    break
        finally:
            gc.unfreeze()
            self._close()

    def _step(self, step: int) -> bool:
        """One optimizer step and what follows it (logs, checkpoint, time limit); False: stop here."""
        cfg = self.cfg
        step_t0 = perf_counter()
        # the first steps of an invocation, phase by phase (synchronised on a GPU; a one-off in
        # them, such as the 13 s second step of the SD-2.1 guided stage, shows its phase)
        phases = PhaseClock(step_t0, sync=self.memory.cuda) if step - self.start <= RATE_WARMUP_STEPS else None  # + the first steady one
        mean, grad_norm = self._forward_backward(step, phases)
        if not self._update(step, mean, grad_norm, phases):
            return True  # skipped (nan_policy: skip)
        done = self.done = step + 1
        log_due = done % cfg.log_every == 0 or done == cfg.max_steps
        save_due = done % cfg.checkpoint_every == 0 or done == cfg.max_steps  # or out of time
        out_of_time = self.deadline.poll()
        if cfg.nan_policy == "stop":
            # read once the whole step is queued (the optimizer's host-side work overlaps the backward on
            # the device), and one step late unless this step is recorded or timed phase by phase
            self.reads.push(step, mean, grad_norm)
            records = phases is not None or log_due or save_due or out_of_time
            for at, loss, bad in self.reads.settle(keep=0 if records else 1):
                self.last_loss = loss
                if bad:  # no checkpoint or log row holds it: they settle first
                    raise PocketdiffError(f"[{self.desc}] non-finite {bad} at step {at}; stopped, last good checkpoint kept in {self.ckpt_dir}")
        self._time_step(done, perf_counter() - step_t0, phases)  # to the end of the host's work on it (a recorded step: of the device's)
        if log_due:
            self._log_row(done)
        self.bar.update(1)
        if self.profiler is not None:
            self.profiler.step()
        if save_due or out_of_time:
            self._save(done)
        if out_of_time and done < cfg.max_steps:
            self.stopped_early = True
            self.acc.print(f"[{self.desc}] train.max_time_s={cfg.max_time_s} reached: stopped at step {done} of {cfg.max_steps}")
            return False
        return True

    def _forward_backward(self, step: int, phases: Optional[PhaseClock]):
        """The step's micro-batches through `loss_fn` and backward, then the gradient clip: (mean loss, grad norm)."""
        cfg, acc = self.cfg, self.acc
        gen = step_generator(self.seed, step, acc.device)
        total = torch.zeros((), device=acc.device)
        for k in range(cfg.grad_accum):
            idx = self.plan.indices(step * cfg.grad_accum + k)[self.rank::self.world]
            batch = batch_to_device(self.collate([self.dataset[i] for i in idx]), acc.device)
            rng = BatchRandom(gen, cfg.batch_size, self.rank, self.world, acc.device)
            ctx = acc.no_sync(self.wrapped) if k < cfg.grad_accum - 1 else contextlib.nullcontext()
            try:
                with ctx, acc.autocast():
                    loss = self.loss_fn(self.wrapped, batch, rng)
                acc.backward(loss / cfg.grad_accum)
            except torch.OutOfMemoryError:
                raise PocketdiffError(oom_message(self.desc, step, cfg.batch_size, cfg.memory_cap_gib, self.ckpt_dir)) from None
            total += loss.detach() / cfg.grad_accum
        if phases:
            phases.mark("forward_backward_s")
        grads = [p.grad for p in self.params if p.grad is not None]
        if cfg.max_grad_norm > 0:
            grad_norm = acc.clip_grad_norm_(self.params, cfg.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        return acc.reduce(total, reduction="mean"), grad_norm

    def _update(self, step: int, mean, grad_norm, phases: Optional[PhaseClock]) -> bool:
        """The optimizer, schedule and EMA step; False when nan_policy skip drops a non-finite step."""
        cfg = self.cfg
        if cfg.nan_policy == "skip":  # decided before the update: the device is synchronised here
            loss_now, bad = read_step(mean, grad_norm)
            if bad:
                self.optimizer.zero_grad(set_to_none=self.free_grads)
                self.skipped += 1
                self.acc.print(f"[{self.desc}] non-finite {bad} at step {step}: step skipped")
                return False
            self.last_loss = loss_now
        if self.ema is not None:
            self.ema.fence()  # the EMA's copies of the previous update have read the parameters
        try:
            self.optimizer.step()
        except torch.OutOfMemoryError:  # the optimizer state is allocated at the first step
            raise PocketdiffError(oom_message(self.desc, step, cfg.batch_size, cfg.memory_cap_gib, self.ckpt_dir)) from None
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=self.free_grads)
        if phases:
            phases.mark("optimizer_s")  # with the gradient clip and the loss reduction
        if self.companion is not None:
            self.companion.after_update(self.acc.unwrap_model(self.wrapped))
        if self.ema is not None:
            self.ema.update(self.acc.unwrap_model(self.wrapped), step + 1)
            if phases:
                phases.mark("ema_s")
        return True

    def _time_step(self, done: int, step_s: float, phases: Optional[PhaseClock]) -> None:
        t = self.times
        if t.first_step_s is None:
            t.first_step_s = step_s
            if self.log_file:
                self.log_file.write(json.dumps({"phase": self.desc, "event": "first_step", "step": done, "first_step_s": round(step_s, 3),
                                                "compiled": bool(self.cfg.compile_mode) or _is_compiled(self.model)}) + "\n")
        if phases and self.log_file:
            self.log_file.write(json.dumps({"phase": self.desc, "event": "step_phases", "step": done, "step_s": round(step_s, 3),
                                            **phases.seconds}) + "\n")
        if done - self.start <= RATE_WARMUP_STEPS:  # warm-up stays out of every rate
            t.warmup_s += step_s
        else:
            t.steady_s, t.steady_steps = t.steady_s + step_s, t.steady_steps + 1
            if step_s > t.slowest_s:
                t.slowest_s, t.slowest_step = step_s, done
            t.window_s, t.window_steps = t.window_s + step_s, t.window_steps + 1

    def _log_row(self, done: int) -> None:
        t = self.times
        self.losses.append([done, self.last_loss])  # settled: this step's
        self.bar.set_postfix(loss=f"{self.last_loss:.4f}")
        if self.log_file:
            self.log_file.write(json.dumps({
                "phase": self.desc, "step": done, "loss": self.last_loss, "lr": self.scheduler.get_last_lr()[0],
                "wall_s": round(time.time() - self.started, 3),
                "samples_per_s": round(self.samples_per_step * t.window_steps / t.window_s, 3) if t.window_steps else None,
                "peak_gpu_mem_gib": self.memory.peak_gib()}) + "\n")
            self.log_file.flush()
        t.window_s, t.window_steps = 0.0, 0
        if self.cfg.tensorboard:
            self.acc.log({f"{self.desc}/loss": self.last_loss}, step=done)

    def train_s(self) -> float:
        """Training seconds so far: this invocation's wall time without on_checkpoint's, plus earlier invocations'."""
        return self.prior_s + time.time() - self.started - self.paused_s

    def _save(self, done: int) -> None:
        acc = self.acc
        save_t0 = perf_counter()
        acc.wait_for_everyone()
        if acc.is_main_process:
            model, train_s = acc.unwrap_model(self.wrapped), self.train_s()
            _save(self.ckpt_dir, done, model, self.optimizer, self.scheduler, self.ema, self.losses,
                  self.skipped, self.cfg.checkpoints_total_limit, {**(self.extra_state or {}), "train_s": train_s}, self.companion,
                  self.trainable_only)
            if self.on_checkpoint is not None:
                hook_t0 = perf_counter()
                self.on_checkpoint(done, model, self.ema, train_s)
                self.paused_s += perf_counter() - hook_t0
                save_t0 += perf_counter() - hook_t0
        gc.collect()
        acc.wait_for_everyone()
        self.times.save_s += perf_counter() - save_t0

    def _close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        self.bar.close()
        if self.log_file:
            self.log_file.close()
        if self.cfg.tensorboard:  # this loop's trackers only: `end_training` would also end the process group,
            for tracker in self.acc.trackers:  # which the next loop sharing `acc` (a distill round, the UNet after the VAE) needs
                tracker.finish()
            self.acc.trackers.clear()

    def result(self) -> LoopResult:
        """The timing summary (printed) and the loop's result."""
        cfg, t, ema, done, start = self.cfg, self.times, self.ema, self.done, self.start
        timing = {
            "steps_run": done - start, "first_step_s": t.first_step_s, "warmup_steps": min(done - start, RATE_WARMUP_STEPS),
            "warmup_s": t.warmup_s, "steady_steps": t.steady_steps,
            "steady_samples_per_s": self.samples_per_step * t.steady_steps / t.steady_s if t.steady_steps else None,
            "slowest_steady_step": t.slowest_step, "slowest_steady_step_s": round(t.slowest_s, 3) if t.slowest_step else None,
            "checkpoint_s": t.save_s, "wall_s": time.time() - self.started, "peak_gpu_mem_gib": self.memory.peak_gib(),
            "train_s": self.train_s(), "paused_s": self.paused_s,  # train_s: earlier invocations' included, on_checkpoint's not
            "host_peak_rss_gb": round((host_peak_mb() or 0.0) / 1024, 3),  # GiB, this process's VmHWM so far
            "processes": self.world, "memory_cap_gib": cfg.memory_cap_gib or None,
            "ema_setup_s": round(ema.setup_s, 3) if ema is not None else None,  # pinning the host EMA's block, before step 1
        }
        self.acc.print(f"[{self.desc}] {timing['steps_run']} steps in {timing['wall_s']:.1f} s (first step {t.first_step_s or 0:.1f} s, "
                       f"warm-up {timing['warmup_steps']} steps {t.warmup_s:.1f} s, "
                       f"steady {timing['steady_samples_per_s'] or 0:.2f} samples/s, checkpoints {t.save_s:.1f} s"
                       + (f", EMA pinning {ema.setup_s:.1f} s" if ema is not None and ema.setup_s else "")
                       + (f", peak GPU {timing['peak_gpu_mem_gib']} GiB)" if self.memory.cuda else ")"))
        return LoopResult(steps=done if self.stopped_early else cfg.max_steps, final_loss=self.last_loss, losses=self.losses,
                          ema=ema, skipped_steps=self.skipped, stopped_early=self.stopped_early, timing=timing,
                          ema_enabled=cfg.ema_decay > 0)


def _is_compiled(model) -> bool:
    return getattr(model, "_compiled_call_impl", None) is not None or any(
        getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
