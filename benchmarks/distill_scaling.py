"""Multi-GPU (DDP) weak scaling of one progressive-distillation step.

The step of `distill_step.py` (`ours` / `ours_wcond`: the teacher's two guided DDIM steps + the
student's forward and backward + the optimizer step, random weights and latents, SD-2.1-size
UNet by default) run as the trainer runs it on several processes: the student and its
optimizer go through `accelerator.prepare` (DDP: one gradient all-reduce per step), the frozen
teacher is not prepared (each process holds its own copy), autocast comes from accelerate's
`mixed_precision` (bf16 on CUDA), the trainer's student layout and AdamW, optional torch.compile (`--compile`:
student and teacher, about 150 s per process on an SD-2.1 UNet).

Weak scaling: every process runs `--batch` samples (its own random draws), the global batch is
N x batch. After `--warmup` steps, `--iters` steps are timed between two barriers (each rank's
CUDA work synchronised), so step_s is the step time of the slowest rank. With N > 1 the same
step is then timed inside `accelerator.no_sync` (no gradient all-reduce): the difference is the
share of a step that communication costs on top of computation.

    accelerate launch --num_processes 2 benchmarks/distill_scaling.py --out n2.json --arch sd21
    python benchmarks/distill_scaling.py --out n1.json --arch tiny --iters 2      # one process, quick check
    python benchmarks/distill_scaling.py --merge n1.json n2.json n4.json --out scaling.json

The merge mode puts the per-N files together with speedup (global samples/s over the 1-process
file's) and efficiency (speedup / N). Rank 0 writes the JSON (atomically; it is written after
the synchronised timing and rewritten after the no_sync one, `complete` says which).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import distill_step as ds  # noqa: E402  (puts pocketdiff on the path: the checkout's or the installed one)

from pocketdiff.outputs import read_json, write_json  # noqa: E402
from pocketdiff.train.distill_targets import GuidedTeacher, set_student_layout  # noqa: E402
from pocketdiff.train.loop import use_fused_adamw  # noqa: E402

VARIANTS = ("ours", "ours_wcond")
COMPARED = ("arch", "latent", "variant", "batch_per_process", "student_steps", "mixed_precision", "compiled", "channels_last")


def _timed(step, n: int, acc, device):
    """Time `n` calls of `step` between two barriers; returns (seconds per step on this rank including
    the closing barrier, i.e. set by the slowest rank; seconds per step of this rank's own work; loss)."""
    acc.wait_for_everyone()
    ds.sync(device)
    t0 = time.perf_counter()
    loss = None
    for _ in range(n):
        loss = step()
    ds.sync(device)
    own = (time.perf_counter() - t0) / n
    acc.wait_for_everyone()
    return (time.perf_counter() - t0) / n, own, loss


def measure(args) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    cpu_forced = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    on_cuda = torch.cuda.is_available() and not cpu_forced
    mp = args.mixed_precision if args.mixed_precision != "auto" else ("bf16" if on_cuda else "no")
    acc = Accelerator(mixed_precision=mp)
    device, n, rank = acc.device, acc.num_processes, acc.process_index
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp)
    if args.latent is None:
        args.latent = ds.default_resolution(args.arch) // (4 if args.arch in ("tiny", "small") else 8)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True

    def say(msg):
        acc.print(f"[distill_scaling N={n}] {msg}", flush=True)

    t_build = time.perf_counter()
    base = ds.build_unet(args.arch, args.latent)  # same seed on every rank (DDP broadcasts rank 0's student anyway)
    embed = ds.EMBED_DIM
    student = ds.make_student(base, embed, device)
    flops = fwd = None
    if args.flops and acc.is_main_process:  # before compile / prepare, on the plain modules; the others wait in prepare
        amp = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype is not None else (lambda: torch.autocast(device.type, enabled=False))
        scratch = torch.optim.SGD(student.parameters(), lr=0.0)  # the step's update, leaving the weights as they are
        flops, fwd = ds.step_flops(args.variant, base, ds.teacher_unet_for(args.variant, base, embed), student, scratch,
                                   min(2, args.batch), args.latent, args.steps, device, amp, seed=args.seed)
    b = ds.Batch(base, args.batch, args.latent, args.steps, device, seed=args.seed + rank)  # each rank its own samples
    teacher = GuidedTeacher(ds.teacher_unet_for(args.variant, base, embed), "v_prediction", dtype=amp_dtype or torch.float32,
                            fused_cfg=True, channels_last=args.channels_last, device=device,
                            compile_mode=args.compile_mode if args.compile else None)
    uncond = None if args.variant == "ours_wcond" else b.uncond
    params = sum(p.numel() for p in base.parameters())
    del base
    set_student_layout(student, args.channels_last, args.compile)
    if args.compile:  # as the trainer: the module is compiled before DDP wraps it
        student.compile(mode=None if args.compile_mode == "default" else args.compile_mode)
    # the trainer's optimizer (the committed 1/2/4-GPU figure predates this: fused AdamW with channels_last parameters)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-6, fused=use_fused_adamw(student.parameters(), device))
    wrapped, opt = acc.prepare(student, opt)
    say(f"built and prepared in {time.perf_counter() - t_build:.1f} s ({type(wrapped).__name__}, backend {acc.state.backend})")

    def step():
        return ds.ours_step(teacher, wrapped, opt, b, acc.autocast, embed, args.channels_last, uncond)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first, _, _ = _timed(step, 1, acc, device)
    say(f"first step {first:.1f} s")
    if args.warmup > 1:
        _timed(step, args.warmup - 1, acc, device)
    step_s, own_s, loss = _timed(step, args.iters, acc, device)
    global_batch = n * args.batch
    per_rank = gather_object([{"device": ds.device_name(device), "step_s": step_s, "own_step_s": own_s,
                               "loss": float(loss.detach()),
                               "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}])
    result = {
        "benchmark": "distill_scaling", "complete": False, "arch": args.arch, "latent": args.latent, "params": params,
        "variant": args.variant, "num_processes": n, "distributed_type": str(acc.distributed_type).split(".")[-1],
        "backend": acc.state.backend, "devices": [r["device"] for r in per_rank],
        "batch_per_process": args.batch, "global_batch": global_batch, "student_steps": args.steps,
        "mixed_precision": mp, "compiled": bool(args.compile), "channels_last": args.channels_last,
        "step_s": step_s, "step_s_per_rank": [r["step_s"] for r in per_rank],
        "own_step_s_per_rank": [r["own_step_s"] for r in per_rank],
        "first_step_s": first, "samples_per_s": global_batch / step_s, "samples_per_s_per_gpu": args.batch / step_s,
        "no_sync_step_s": None, "comm_share": None,
        "flops_per_sample": flops, "unet_forward_flops_per_sample": fwd,
        "forward_equivalents_per_sample": flops / fwd if flops and fwd else None,
        "tflops_per_s_per_gpu": flops * args.batch / step_s / 1e12 if flops else None,
        "loss_per_rank": [r["loss"] for r in per_rank], "peak_mem_gib_per_rank": [r["peak_mem_gib"] for r in per_rank],
        "torch": torch.__version__, "diffusers": __import__("diffusers").__version__, "accelerate": __import__("accelerate").__version__,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "merge")},
    }
    say(f"{step_s * 1e3:.1f} ms/step, {result['samples_per_s']:.2f} samples/s "
        f"({result['samples_per_s_per_gpu']:.2f} per process, global batch {global_batch})")
    if acc.is_main_process:  # kept even if the no_sync part below is cut short
        write_json(args.out, result)

    if n > 1 and args.no_sync_iters > 0:
        with acc.no_sync(wrapped):
            _timed(step, 1, acc, device)
            ns, _, _ = _timed(step, args.no_sync_iters, acc, device)
        result["no_sync_step_s"] = ns
        result["comm_share"] = max(0.0, 1.0 - ns / step_s)
        say(f"no_sync {ns * 1e3:.1f} ms/step: all-reduce share {result['comm_share']:.1%}")
    result["complete"] = True
    if acc.is_main_process:
        write_json(args.out, result)
    acc.wait_for_everyone()
    acc.end_training()
    return result


def merge(paths: list[str], out: str) -> dict:
    runs = []
    for p in paths:
        r = read_json(p, "distill_scaling --merge")
        if r.get("benchmark") != "distill_scaling":
            raise SystemExit(f"{p} is not a distill_scaling result")
        runs.append((p, r))
    runs.sort(key=lambda pr: pr[1]["num_processes"])
    base_path, base = next(((p, r) for p, r in runs if r["num_processes"] == 1), (None, None))
    rows = []
    for p, r in runs:
        row = {k: r.get(k) for k in ("num_processes", "devices", "batch_per_process", "global_batch", "step_s", "samples_per_s",
                                     "samples_per_s_per_gpu", "no_sync_step_s", "comm_share", "tflops_per_s_per_gpu",
                                     "first_step_s", "peak_mem_gib_per_rank", "complete")}
        if base is not None:
            row["speedup"] = r["samples_per_s"] / base["samples_per_s"]
            row["efficiency"] = row["speedup"] / r["num_processes"]
            row["step_time_ratio"] = r["step_s"] / base["step_s"]
        row["file"] = str(p)
        rows.append(row)
    mismatched = {k: sorted({json.dumps(r.get(k)) for _, r in runs}) for k in COMPARED}
    mismatched = {k: [json.loads(v) for v in vals] for k, vals in mismatched.items() if len(vals) > 1}
    first = runs[0][1] if runs else {}
    result = {
        "benchmark": "distill_scaling_merged",
        "scaling": "weak: each process runs batch_per_process samples, global batch = N x batch_per_process; "
                   "speedup = global samples/s over the 1-process run's, efficiency = speedup / N",
        **{k: first.get(k) for k in COMPARED}, "params": first.get("params"), "torch": first.get("torch"),
        "baseline": base_path, "mismatched": mismatched, "runs": rows,
    }
    write_json(out, result)
    print(f"{'N':>3} {'global batch':>12} {'ms/step':>9} {'samples/s':>10} {'speedup':>8} {'efficiency':>10} {'all-reduce':>10}")
    for row in rows:
        sp, eff, cs = row.get("speedup"), row.get("efficiency"), row.get("comm_share")
        print(f"{row['num_processes']:>3} {row['global_batch']:>12} {row['step_s'] * 1e3:>9.1f} {row['samples_per_s']:>10.2f} "
              f"{'-' if sp is None else f'{sp:.2f}x':>8} {'-' if eff is None else f'{eff:.0%}':>10} {'-' if cs is None else f'{cs:.0%}':>10}")
    if mismatched:
        print(f"warning: the runs differ in {mismatched}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON result file (rank 0 writes it)")
    p.add_argument("--merge", nargs="+", metavar="RUN_JSON", help="merge per-N result files into --out instead of measuring")
    p.add_argument("--arch", default="sd21", choices=("tiny", "small", "sd15", "sd21"))
    p.add_argument("--variant", default="ours", choices=VARIANTS)
    p.add_argument("--batch", type=int, default=16, help="samples per process (global batch = N x batch)")
    p.add_argument("--latent", type=int, default=None, help="latent side (default: the arch's: sd21 64, tiny 8)")
    p.add_argument("--steps", type=int, default=32, help="the student's step count (teacher: twice that)")
    p.add_argument("--iters", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one includes cudnn autotuning / compilation)")
    p.add_argument("--no-sync-iters", type=int, default=None, help="timed steps without gradient all-reduce (N > 1; default --iters, 0: skip)")
    p.add_argument("--mixed-precision", default="auto", choices=("auto", "bf16", "fp16", "no"), help="accelerate's (auto: bf16 on CUDA, no on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile student and teacher (about 150 s per process on SD-2.1)")
    p.add_argument("--compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"))
    p.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    p.add_argument("--no-flops", dest="flops", action="store_false", help="skip counting FLOPs (rank 0, a few seconds)")
    p.add_argument("--seed", type=int, default=0, help="rank r draws its batch with seed + r")
    args = p.parse_args(argv)
    if args.merge:
        merge(args.merge, args.out)
        return 0
    if min(args.batch, args.iters, args.warmup) < 1:
        p.error("--batch, --iters and --warmup must be at least 1")
    if args.no_sync_iters is None:
        args.no_sync_iters = args.iters
    measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
