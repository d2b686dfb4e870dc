"""Throughput of one progressive-distillation training step: pocketdiff's step vs a plain eager one.

One step = the teacher's two classifier-free-guided DDIM steps (the Salimans & Ho target) +
the student's forward and backward + the optimizer step, on random weights and random latents
(SD-2.1-size UNet by default, 64x64 latents, batch 16; `--arch sdxl`: SDXL base's UNet built from its config,
1024 px = 128x128 latents, conditioned on both text encoders' hidden states, the pooled embedding and the six
time ids (1024, 1024, 0, 0, 1024, 1024)). Variants, measured side by side in one process:

- `eager`: what a plain diffusers-style script does: fp32 teacher weights under bf16 autocast,
  conditional and unconditional teacher passes as separate calls, no channels_last, no
  compile (diffusers' default SDPA attention, as every variant).
- `ours_eager`: pocketdiff's step (`pocketdiff.train.distill_targets`, the code the trainer
  runs) with its switches except compile: teacher weights cast once to bf16, one fused
  cond/uncond batch, channels_last, cudnn.benchmark.
- `ours`: the same plus torch.compile of student and teacher (`--teacher-compile-mode`,
  `--student-compile-mode`); as in the trainer, the compiled student's parameters keep the
  default layout (inductor picks conv layouts itself), so its AdamW is the fused one.
- `ours_wcond`: the step pocketdiff actually runs in progressive rounds after guided
  distillation: the teacher is the w-conditioned student, one pass per teacher step instead of
  a cond/uncond pair (5 instead of 7 forward-equivalents per sample). Same switches as `ours`.
- `ours_guided` (optional): the guided stage's step (round 0 of `pocketdiff distill`): one
  classifier-free-guided teacher evaluation (cond + uncond, 2 passes) at any timestep, the
  student learning its x prediction. Same switches as `ours`.
- `ours_cudnn` (optional): `ours` with attention forced onto cuDNN's fused SDPA kernel
  (`torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`) instead of PyTorch's default
  choice (flash attention 2 on Hopper).
- `ours_lcm` (optional): the consistency stage's step (`distill.method: consistency`, the
  trainer's `pocketdiff.train.consistency_loss.pair_loss`): one classifier-free-guided teacher
  evaluation (cond + uncond) and its skipping DDIM step on the recipes' 10-point grid, the target
  (with the recipes' decay 0 the student itself, no gradient) at the step's end, the student at its
  start, pseudo-Huber loss. Same switches as `ours`.
- `ours_loop` (optional): `ours` through `pocketdiff.train.loop.train_loop` itself (Accelerate
  autocast/backward, gradient-finite check, EMA off), timed between successive steps.

FLOPs are counted once per variant with torch.utils.flop_counter on the eager modules;
TFLOP/s = counted FLOPs of a step / measured step time (`ours_wcond` counts its own smaller
step, so compare it on samples/s).

Memory: `--grad-ckpt`, `--optimizer adamw8bit` (`--optimizer-lib`, as `train.optimizer` / `train.optimizer_lib`), `--memory-cap-gib`
(the process's CUDA allocator capped as `train.memory_cap_gib` does) and `--batches 8,16,24`
(every variant at each batch, ascending; a batch that runs out of memory ends the sweep: the
largest batch per cap). Without `--batches`, a variant that runs out of memory is a row with `oom: true` and the
others still run (at SDXL size the eager step may not fit a batch the product's step fits). `--flops off` skips
the FLOP count (at SDXL size it holds an extra float32 teacher and runs math attention over 4096 tokens; the
`tflops` fields are then null). Every row names its levers (`levers`: teacher dtype, fused cond/uncond,
channels_last, compile, cudnn.benchmark, fused AdamW) and its peak GPU bytes.

    python benchmarks/distill_step.py --out result.json --arch sd21 --device cuda
    python benchmarks/distill_step.py --out sdxl.json --arch sdxl --batch 2 --compile off --flops off \
        --variants eager,ours_eager,ours_wcond,ours_lcm          # scripts/gpu/sdxl_size.sh
    python benchmarks/distill_step.py --out tiny.json --arch tiny --device cpu --iters 2   # quick check
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from _checkout import use_checkout  # noqa: E402

use_checkout()

from pocketdiff.archs import ARCHS, vae_config  # noqa: E402
from pocketdiff.conditioning import drawn_conditioning  # noqa: E402
from pocketdiff.models import default_resolution, perturb_norm_affines, scheduler_config, unet_config  # noqa: E402
from pocketdiff.outputs import write_json  # noqa: E402
from pocketdiff.train.consistency_loss import PairSettings, pair_loss  # noqa: E402
from pocketdiff.train.consistency_targets import TargetNetwork, skipping_plan  # noqa: E402
from pocketdiff.train.distill_targets import (  # noqa: E402
    GuidedTeacher,
    guided_x_target,
    noisy_latents,
    round_plan,
    set_student_layout,
    student_forward,
    two_step_x_target,
    x_space_loss,
)
from pocketdiff.train.guidance_embedding import add_guidance_embedding  # noqa: E402
from pocketdiff.train.loop import in_default_layout, use_fused_adamw  # noqa: E402
from pocketdiff.train.memory import apply_memory_cap, make_optimizer  # noqa: E402

VARIANTS = ("eager", "ours_eager", "ours", "ours_guided", "ours_cudnn", "ours_wcond", "ours_lcm", "ours_loop")
EMBED_DIM = 256  # the student's guidance-embedding width
# ours_lcm: the consistency recipes' settings (configs/sd21/distill_lcm.yaml)
LCM = PairSettings("v_prediction", timestep_scaling=10.0, huber_c=0.001, student_embed=EMBED_DIM)
LCM_SOLVER_STEPS, LCM_TARGET_DECAY = 10, 0.0  # decay 0: the target is the live student (no copy)


def vae_factor(arch: str) -> int:
    """Pixels per latent of `arch`'s VAE (4 for tiny / small / tiny_xl / small_xl, 8 for the SD and SDXL sizes)."""
    return 2 ** (len(vae_config(arch)["block_out_channels"]) - 1)


def build_unet(arch: str, latent: int, seed: int = 0):
    from diffusers import UNet2DConditionModel

    factor = vae_factor(arch)
    cfg = unet_config(arch, resolution=latent * factor, vae_factor=factor)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**cfg)
    perturb_norm_affines(unet, seed)
    return unet


def make_student(base_unet, embed_dim: int, device):
    """The w-conditioned student: a copy of `base_unet` with a (zero) guidance embedding, in train mode."""
    return add_guidance_embedding(copy.deepcopy(base_unet), embed_dim).to(device).train()


def teacher_unet_for(name: str, base_unet, embed_dim: int):
    """The variant's teacher UNet (on the CPU, fp32): a copy of `base_unet`, or for `ours_wcond` a
    w-conditioned copy with a small random guidance embedding (the guided student of a later round)."""
    if name == "ours_wcond":
        teacher_unet = add_guidance_embedding(copy.deepcopy(base_unet), embed_dim)
        with torch.no_grad():
            teacher_unet.time_embedding.cond_proj.weight.normal_(std=0.01)
        return teacher_unet
    return copy.deepcopy(base_unet)


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Batch:
    """Random latents / text embeddings / draws for one step (fixed across variants)."""

    def __init__(self, unet, batch: int, latent: int, steps: int, device, seed: int = 0, pixels: int | None = None):
        from diffusers import DDIMScheduler

        g = torch.Generator().manual_seed(seed)
        ch = unet.config.in_channels
        self.sched = DDIMScheduler(**{**scheduler_config("v_prediction"), "timestep_spacing": "trailing"})
        self.plan = round_plan(self.sched, steps, 2 * steps)
        k = torch.randint(0, steps, (batch,), generator=g)
        self.t, self.t_mid = self.plan.t[k].to(device), self.plan.t_mid[k].to(device)
        self.a_t, self.a_mid, self.a_prev = (v[k].to(device) for v in (self.plan.a_t, self.plan.a_mid, self.plan.a_prev))
        x0 = torch.randn(batch, ch, latent, latent, generator=g)
        eps = torch.randn(batch, ch, latent, latent, generator=g)
        self.z = noisy_latents(x0, eps, self.a_t.cpu()).to(device)
        draw = lambda v: 0.5 * torch.randn(v.shape, generator=g)  # noqa: E731  (every field of the UNet family's conditioning)
        pixels = pixels or latent * 8
        self.cond = drawn_conditioning(unet, batch, draw, pixels).to(device)  # SDXL: the pipeline's time ids of `pixels`
        self.uncond = drawn_conditioning(unet, 1, draw, pixels).to(device)
        self.w = (1.0 + 7.0 * torch.rand(batch, generator=g)).to(device)
        # ours_lcm: a pair (t_hi -> t_lo) of the skipping grid per sample, z at t_hi
        lcm = skipping_plan(self.sched, LCM_SOLVER_STEPS)
        n = torch.randint(0, len(lcm.t_hi), (batch,), generator=g)
        self.hi = (lcm.t_hi[n].to(device), lcm.a_hi[n].to(device))
        self.lo = (lcm.t_lo[n].to(device), lcm.a_lo[n].to(device))
        self.z_hi = noisy_latents(x0, eps, lcm.a_hi[n]).to(device)


def optimizer_step(student, opt, loss) -> None:
    """Both steps' update: backward, the gradient clipped at norm 1, the optimizer's step, gradients dropped."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def eager_step(teacher, student, opt, b: Batch, amp, embed_dim):
    """The plain loop: separate cond/uncond teacher calls, autocast over fp32 weights, no tricks."""
    from pocketdiff.sampling import ddim_step

    with amp():
        with torch.no_grad():
            def guided(z, t):
                c = teacher(z, t, **b.cond.unet_kwargs()).sample.float()
                u = teacher(z, t, **b.uncond.expand(len(b.cond)).unet_kwargs()).sample.float()
                return u + b.w.view(-1, 1, 1, 1) * (c - u)
            z_mid = ddim_step(b.z, guided(b.z, b.t), b.a_t, b.a_mid, "v_prediction")
            z_prev = ddim_step(z_mid, guided(z_mid, b.t_mid), b.a_mid, b.a_prev, "v_prediction")
            from pocketdiff.train.distill_targets import x_from_two_steps
            target = x_from_two_steps(b.z, z_prev, b.a_t, b.a_prev)
        out = student_forward(student, b.z, b.t, b.cond, b.w, False, embed_dim)
        loss = x_space_loss(out, b.z, b.a_t, target, "v_prediction")
    optimizer_step(student, opt, loss)
    return loss


def ours_step(teacher: GuidedTeacher, student, opt, b: Batch, amp, embed_dim, channels_last, uncond, guided: bool = False,
              lcm_target: TargetNetwork | None = None):
    with amp():
        if lcm_target is not None:  # the consistency stage (its own pair of timesteps and latents)
            settings = dataclasses.replace(LCM, channels_last=channels_last, student_embed=embed_dim)
            loss = pair_loss(student, teacher, lcm_target, settings, b.z_hi, b.hi, b.lo, b.cond, uncond.expand(len(b.cond)), b.w)
        else:
            if guided:  # round 0: one guided teacher evaluation at t
                target = guided_x_target(teacher, b.z, b.t, b.a_t, b.cond, uncond.expand(len(b.cond)), b.w)
            else:
                target = two_step_x_target(teacher, b.z, b.t, b.t_mid, b.a_t, b.a_mid, b.a_prev, b.cond, uncond, b.w)
            out = student_forward(student, b.z, b.t, b.cond, b.w, channels_last, embed_dim)
            loss = x_space_loss(out, b.z, b.a_t, target, "v_prediction")
    optimizer_step(student, opt, loss)
    if lcm_target is not None:  # as train_loop's companion: after every optimizer step
        lcm_target.after_update(student)
    return loss


def count_flops(fn) -> int:
    """FLOPs of `fn` with attention on SDPA's math path (plain matmuls, counted on every device;
    fused CPU attention kernels are invisible to the counter)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        fn()
    return int(counter.get_total_flops())


def with_cudnn_attention(fn):
    """`fn` with SDPA forced onto cuDNN's fused attention kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return fn()
    return run


def step_flops(name, base_unet, teacher_unet, student, opt, nb: int, latent: int, steps: int, device, amp, seed: int = 0,
               lcm_target: TargetNetwork | None = None, pixels: int | None = None):
    """(FLOPs of one step of variant `name` per sample, FLOPs of one UNet forward per sample):
    eager fp32 modules, math attention, counted on a batch of `nb` (every op is per sample); the
    optimizer step is not counted. `teacher_unet` is copied; `student`'s gradients are cleared."""
    small = Batch(base_unet, nb, latent, steps, device, seed, pixels=pixels)
    flop_teacher = GuidedTeacher(copy.deepcopy(teacher_unet), "v_prediction", dtype=torch.float32, device=device)
    uncond = None if name == "ours_wcond" else small.uncond
    per_sample = count_flops(lambda: ours_step(flop_teacher, student, opt, small, amp, EMBED_DIM, False, uncond,
                                               guided=name == "ours_guided", lcm_target=lcm_target)) // nb
    kw = {"timestep_cond": torch.zeros(1, EMBED_DIM, device=device)} if name == "ours_wcond" else {}
    with torch.no_grad():
        fwd = count_flops(lambda: flop_teacher.unet(small.z[:1], small.t[:1], **small.cond[:1].unet_kwargs(), **kw))
    opt.zero_grad(set_to_none=True)
    return per_sample, fwd


KERNEL_KINDS = (  # (label, substrings of a kernel name), first match wins; the rest is "other"
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul/conv", ("gemm", "conv", "cutlass", "sm90", "xmma", "wgmma", "nhwc", "implicit")),
    ("optimizer", ("adam", "multi_tensor")),
    ("norm/elementwise (triton)", ("triton",)),
    ("norm/elementwise (eager)", ("elementwise", "norm", "reduce", "vectorized", "copy", "cat")),
)


def profile_steps(step, n: int, device) -> dict:
    """Where the GPU time of `n` steps goes: the 25 kernels with the most device time, and the
    share of each kernel kind (KERNEL_KINDS) and of idle time between kernels."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    t0 = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(n):
            step()
        sync(device)
    wall = (time.perf_counter() - t0) / n
    if cuda:
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:  # CPU: the leaf aten ops stand in for kernels (a quick check of this code, not a measurement)
        kernels = [e for e in prof.key_averages() if e.key.startswith("aten::") and e.self_cpu_time_total > 0]
    secs = {e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6 / n for e in kernels}
    busy = sum(secs.values())
    kinds: dict[str, float] = {}
    for key, t in secs.items():
        kind = next((label for label, keys in KERNEL_KINDS if any(k in key.lower() for k in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + t
    top = sorted(kernels, key=lambda e: -secs[e.key])[:25]
    return {
        "profiled_steps": n, "step_s_under_profiler": wall, "kernel_s_per_step": busy,
        "gpu_idle_share": max(0.0, 1.0 - busy / wall),
        "share_by_kind": {k: v / busy for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])} if busy else {},
        "top_kernels": [{"name": e.key[:160], "s_per_step": secs[e.key], "calls_per_step": e.count / n} for e in top],
    }


def measure(name, args, base_unet, device, amp_dtype):
    """Build the variant's models, count FLOPs, warm up, time `args.iters` steps."""
    amp = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype is not None else (lambda: torch.autocast(device.type, enabled=False))
    embed_dim = EMBED_DIM
    student = make_student(base_unet, embed_dim, device)
    if args.grad_ckpt:
        student.enable_gradient_checkpointing()
    # ours_lcm: the target network starts as the student, before its layout changes (as in the trainer)
    lcm_target = TargetNetwork(student, LCM_TARGET_DECAY, device=device) if name == "ours_lcm" else None
    ours = name != "eager"
    compile_it = name in ("ours", "ours_guided", "ours_cudnn", "ours_wcond", "ours_lcm", "ours_loop") and args.compile
    if ours:  # the trainer's student layout and optimizer; eager: default layout, PyTorch's default AdamW (foreach)
        set_student_layout(student, args.channels_last, compile_it)
    fused = (ours or args.fused_adam) and use_fused_adamw(student.parameters(), device)
    if args.optimizer == "adamw8bit":
        opt = make_optimizer([{"params": list(student.parameters()), "lr": 1e-6}], name="adamw8bit", lib=args.optimizer_lib,
                             lr=1e-6, weight_decay=0.0, fused=False)
    else:
        opt = torch.optim.AdamW(student.parameters(), lr=1e-6, **({"fused": True} if fused else {}))
    pixels = args.latent * vae_factor(args.arch)
    b = Batch(base_unet, args.batch, args.latent, args.steps, device, pixels=pixels)
    teacher_unet = teacher_unet_for(name, base_unet, embed_dim)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = ours
    teacher_dtype = (amp_dtype or torch.float32) if ours else torch.float32
    uncond = None if name == "ours_wcond" else b.uncond
    per_sample, fwd = None, None
    if args.flops:
        per_sample, fwd = step_flops(name, base_unet, teacher_unet, student, opt, min(2, args.batch), args.latent, args.steps, device,
                                     amp, lcm_target=lcm_target, pixels=pixels)
    flops = per_sample * args.batch if per_sample else None
    levers = {"teacher_dtype": str(teacher_dtype).replace("torch.", ""), "fused_cond_uncond": ours,
              "channels_last": ours and args.channels_last, "compiled": compile_it, "cudnn_benchmark": ours and device.type == "cuda",
              "fused_adamw": fused and args.optimizer == "adamw", "optimizer": args.optimizer, "grad_ckpt": args.grad_ckpt,
              "autocast": str(amp_dtype).replace("torch.", "") if amp_dtype else "off"}
    if ours:
        teacher = GuidedTeacher(teacher_unet, "v_prediction", dtype=teacher_dtype, fused_cfg=True,
                                channels_last=args.channels_last, device=device,
                                compile_mode=args.teacher_compile_mode if compile_it else None)
        if compile_it:
            student.compile(mode=None if args.student_compile_mode == "default" else args.student_compile_mode)
        step = lambda: ours_step(teacher, student, opt, b, amp, embed_dim, args.channels_last, uncond,  # noqa: E731
                                 guided=name == "ours_guided", lcm_target=lcm_target)
        if name == "ours_cudnn":
            step = with_cudnn_attention(step)
    else:
        teacher = teacher_unet.to(device).requires_grad_(False).eval()
        step = lambda: eager_step(teacher, student, opt, b, amp, embed_dim)  # noqa: E731

    if name == "ours_loop":
        return measure_loop(args, student, teacher, b, device, flops, amp_dtype, embed_dim, uncond)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    t0 = time.perf_counter()
    loss = step()
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(max(args.warmup - 1, 0)):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        loss = step()
    sync(device)
    dt = (time.perf_counter() - t0) / args.iters
    result = {
        "variant": name, "step_s": dt, "samples_per_s": args.batch / dt, "tflops_per_s": flops / dt / 1e12 if flops else None,
        "flops_per_step": flops, "flops_per_sample": flops / args.batch if flops else None,
        "unet_forward_tflop_per_sample": fwd / 1e12 if fwd else None,
        "forward_equivalents_per_sample": flops / args.batch / fwd if flops else None, "first_step_s": first,
        "loss": float(loss.detach()), "teacher_passes_per_step": 2 if name in ("ours_wcond", "ours_lcm") else 4,
        "target_network_passes_per_step": 1 if name == "ours_lcm" else 0,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "peak_mem_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
        "compiled": compile_it, "fused_adam": fused and args.optimizer == "adamw", "optimizer": args.optimizer,
        "grad_ckpt": args.grad_ckpt, "batch": args.batch, "levers": levers,
        "channels_last_params": not all(in_default_layout(p) for p in student.parameters()),
    }
    if args.profile:
        result["profile"] = profile_steps(step, args.profile, device)
    del teacher, student, opt, step, lcm_target
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def measure_loop(args, student, teacher, b: Batch, device, flops, amp_dtype, embed_dim, uncond):
    """`ours` through train_loop: time between successive loss_fn calls = one whole loop step."""
    from accelerate import Accelerator

    from pocketdiff.train.loop import LoopConfig, train_loop

    stamps = []

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return args.batch * 4

        def __getitem__(self, i):
            return {"i": torch.tensor(i)}

    def loss_fn(model, batch, rng):
        sync(device)
        stamps.append(time.perf_counter())
        target = two_step_x_target(teacher, b.z, b.t, b.t_mid, b.a_t, b.a_mid, b.a_prev, b.cond, uncond, b.w)
        out = student_forward(model, b.z, b.t, b.cond, b.w, args.channels_last, embed_dim)
        return x_space_loss(out, b.z, b.a_t, target, "v_prediction")

    mp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp_dtype, "no")
    acc = Accelerator(mixed_precision=mp)
    n = args.warmup + args.iters + 1
    with tempfile.TemporaryDirectory() as tmp:
        cfg = LoopConfig(max_steps=n, batch_size=args.batch, lr=1e-6, checkpoint_every=10**9, log_every=10**9,
                         **({"mixed_precision": mp} if mp != "no" else {}))
        train_loop(cfg, model=student, loss_fn=loss_fn, dataset=Data(), collate=lambda items: {"i": torch.stack([x["i"] for x in items])},
                   ckpt_dir=Path(tmp) / "ckpt", seed=0, accelerator=acc, desc="bench")
    steps = [b2 - a2 for a2, b2 in zip(stamps[args.warmup:-1], stamps[args.warmup + 1:])]
    dt = sum(steps) / len(steps)
    return {"variant": "ours_loop", "step_s": dt, "samples_per_s": args.batch / dt, "tflops_per_s": flops / dt / 1e12 if flops else None,
            "flops_per_step": flops, "first_step_s": stamps[1] - stamps[0], "teacher_passes_per_step": 2 if uncond is None else 4,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None, "compiled": args.compile}


def measure_or_oom(name, args, base_unet, device, amp_dtype) -> dict:
    """`measure`, or a row {variant, batch, oom: true} when the variant runs out of GPU memory (its models freed)."""
    try:
        return measure(name, args, base_unet, device, amp_dtype)
    except torch.OutOfMemoryError:
        pass  # outside the handler, so that the traceback's frames (and the variant's tensors) are gone
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"variant": name, "batch": args.batch, "oom": True, "peak_mem_gib": None}


def batch_sweep(args, variants, base, device, amp_dtype, result) -> list[dict]:
    """Every variant at each of `args.batches` (ascending) until one runs out of memory."""
    rows = []
    for batch in sorted(int(x) for x in args.batches.split(",") if x.strip()):
        args.batch = batch
        for name in variants:
            print(f"[distill_step] {name} batch {batch} ...", flush=True)
            try:
                r = measure(name, args, base, device, amp_dtype)
            except torch.OutOfMemoryError:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append({"variant": name, "batch": batch, "oom": True})
                print(f"[distill_step] {name} batch {batch}: out of memory (cap {args.memory_cap_gib or 'none'} GiB)", flush=True)
                return rows
            rows.append({"variant": name, "batch": batch, "oom": False, "samples_per_s": r["samples_per_s"],
                         "peak_mem_gib": r["peak_mem_gib"], "first_step_s": r["first_step_s"]})
            result["variants"][f"{name}@{batch}"] = r
            print(f"[distill_step] {name} batch {batch}: {r['samples_per_s']:.2f} samples/s, peak {r['peak_mem_gib']} GiB", flush=True)
            result["batch_sweep"] = rows
            write_json(args.out, result)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--arch", default="sd21", choices=ARCHS, help="sdxl: SDXL base's UNet (1024 px, 128x128 latents)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--latent", type=int, default=None, help="latent side (default: the arch's: sd21 64, sdxl 128, tiny 8)")
    p.add_argument("--steps", type=int, default=32, help="the student's step count (teacher: twice that)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default="eager,ours_eager,ours,ours_wcond", help=f"comma list of {VARIANTS}")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help="autocast / teacher dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="torch.compile in ours / ours_wcond (auto: on for CUDA)")
    p.add_argument("--teacher-compile-mode", default="default", choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    p.add_argument("--student-compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"))
    p.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in the student (every variant)")
    p.add_argument("--fused-adam", action="store_true", help="AdamW(fused=True) in eager too (the ours variants use it on CUDA, as the trainer's loop does)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adamw8bit"), help="adamw8bit: as train.optimizer=adamw8bit")
    p.add_argument("--optimizer-lib", default="bitsandbytes", choices=("bitsandbytes", "torchao"),
                   help="adamw8bit's library (train.optimizer_lib); torchao compiles a kernel per parameter shape on the first step")
    p.add_argument("--memory-cap-gib", type=float, default=0.0, help="cap the CUDA allocator (train.memory_cap_gib)")
    p.add_argument("--batches", default="", help="comma list: every variant at each batch, ascending, until one runs out of memory")
    p.add_argument("--flops", default="on", choices=("on", "off"), help="count each variant's FLOPs (off: tflops fields null)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile N steps per variant: top kernels and time share by kernel kind")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[dtype]
    if args.latent is None:
        args.latent = default_resolution(args.arch) // vae_factor(args.arch)
    if args.latent < 1 or args.batch < 1 or args.iters < 1:
        p.error(f"--latent, --batch and --iters must be >= 1 (got {args.latent}, {args.batch}, {args.iters})")
    args.flops = args.flops == "on"
    args.compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {VARIANTS}")

    if args.memory_cap_gib:
        apply_memory_cap(args.memory_cap_gib, device)
    base = build_unet(args.arch, args.latent)
    result = {
        "benchmark": "distill_step", "arch": args.arch, "latent": args.latent, "batch": args.batch,
        "student_steps": args.steps, "dtype": dtype, "device": device_name(device),
        "torch": torch.__version__, "diffusers": __import__("diffusers").__version__, "params": sum(q.numel() for q in base.parameters()),
        "attention_processor": type(next(iter(base.attn_processors.values()))).__name__ if base.attn_processors else None,
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "variants": {},
    }
    if args.batches:
        result["batch_sweep"] = batch_sweep(args, variants, base, device, amp_dtype, result)
        write_json(args.out, result)
        return 0
    for name in variants:  # the JSON is rewritten after every variant: a run cut short keeps what it measured
        print(f"[distill_step] {name} ...", flush=True)
        r = measure_or_oom(name, args, base, device, amp_dtype)
        result["variants"][name] = r
        if r.get("oom"):
            print(f"[distill_step] {name}: out of memory at batch {args.batch}", flush=True)
        else:
            tflops = f", {r['tflops_per_s']:.1f} TFLOP/s" if r["tflops_per_s"] else ""
            print(f"[distill_step] {name}: {r['samples_per_s']:.2f} samples/s{tflops}, peak {r['peak_mem_gib']} GiB "
                  f"(first step {r['first_step_s']:.1f} s)", flush=True)
        ref = result["variants"].get("eager", {}).get("samples_per_s")
        if ref:
            result["speedup_vs_eager"] = {k: v["samples_per_s"] / ref for k, v in result["variants"].items() if not v.get("oom")}
        write_json(args.out, result)  # atomic: a run killed mid-write keeps the previous variants
    print(json.dumps(result.get("speedup_vs_eager", {}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
