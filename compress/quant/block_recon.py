"""One block's reconstruction (BRECQ-style AdaRound): the per-block optimiser. The walk over a
UNet's blocks is `reconstruct`.

Per block: AdaRound quantizers for its layers (scales from `scale_init`, optionally
learned), Adam on the rounding variables for `iters` minibatches of cached block inputs,
minimising the block-output error against the float block (sum over channels, mean over
batch and positions, as BRECQ; optionally Fisher-weighted) plus the annealed rounding
regulariser. The hard-rounded result is then compared, in float32 on all calibration
inputs, with plain RTN (max-abs scale) and with RTN at the searched scale; unless
`fallback` is off the best of the three is kept, so no block ends worse than RTN.

Defaults (500 iterations, Adam lr 3e-2, learned scales, scales initialised by the per-channel
MSE search) come from held-out block-output error, as a fraction of RTN's, on blocks of a
random norm-perturbed tiny UNet with 256 calibration inputs (CPU, float32):

    block / bits            5000 it. lr 1e-3   500 it. lr 1e-2   500 it. lr 3e-2   + learned scales
    transformer W8          0.203              0.236             0.171             0.141
    resnet W8               0.310              0.319             0.337             0.296
    resnet W4               0.310              0.315             0.339             0.277
    transformer W4          -                  0.231             -                 0.136

A short schedule with a large step matches or beats a 10x longer plain one. bf16 autocast
of the optimisation forwards hurt at W8 (0.57 against 0.24 at 500 it. lr 1e-2: the W8
rounding signal is below bf16 noise) but not at W4 (0.311 against 0.339), hence `autocast: auto`.
bf16 keeps 7 mantissa bits, so it rounds the weights themselves about as coarsely as the W8
grid (a step of 1/127 of the largest weight); fp16 keeps 10, as many as TF32 (the default for
CUDA matmuls here) keeps of their inputs, and runs attention in flash kernels. `autocast: fp16`
scales the loss (torch.amp.GradScaler, unscaled before Adam's step) so that the small
block-output gradients do not underflow.

That lr is too large for layers with a large fan-in. Adam moves every rounding variable by
about lr per step whatever its gradient, and a layer's output change adds up over its fan-in.
SD-2.1's blocks with 1280-channel 3x3 convs (fan-in 11,520 to 23,040) ended 1.3-4x above RTN
at 250-500 iterations, while blocks whose layers have fan-ins up to 5,760 improved
(benchmarks/results/calibrate_sd21_sweep_h200.json). On one such block
(up_blocks.0.upsamplers.0, fan-in 11,520; 256 px, CPU, 250 iterations;
benchmarks/calibrate_sd21.py --sweep-lrs) the hard-rounded block error relative to RTN was 3.4x at lr
3e-2, 1.22x at 1.2e-2, 0.74x at 4.8e-3 and 0.77x at 3e-3 (calibration set; held-out 3.6x,
1.46x, 0.89x, 0.86x). Hence `lr_fan_in_ref`: above a fan-in of 4,608 the lr falls as
(4,608 / fan-in)^2, which gives 4.8e-3 at 11,520. SD-2.1 has 47 such layers; the tiny and small
recipes have none (fan-in at most 2,304), so their tuned results are unchanged. On the GPU
over the whole SD-2.1 UNet (W8, 500 iterations) this raised the blocks that keep AdaRound from
33 to 38 of 46; in the other 8 the error still rises as the rounding hardens, and the fallback
keeps RTN or the searched-scale RTN (benchmarks/results/calibrate_sd21_*_lrfan_*.json).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from pocketdiff.errors import require

from .blocks import Block, Captured, _autocast, first_tensor
from .quantizer import AdaRoundQuantizer, LayerSpec, beta_schedule, dequant, rtn, search_scale

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ReconConfig:
    """The `recon:` section: how blocks are reconstructed."""

    method: str = "adaround"  # adaround | rtn (searched scale, round to nearest: no optimisation)
    mode: str = "sequential"  # sequential | independent
    iters: int = 500  # optimisation steps per block
    batch_size: int = 32  # calibration samples per step
    lr: float = 3e-2  # Adam on the rounding variables (short schedule: see the module docstring)
    # layers whose fan-in (inputs per output: in_channels/groups x kernel area) exceeds this get
    # lr x (lr_fan_in_ref / fan_in)^2: Adam moves every rounding variable by about lr per step and
    # the output change adds up over the fan-in (see the module docstring); None: one lr for all
    lr_fan_in_ref: Optional[int] = 4608
    lr_schedule: str = "constant"  # constant | cosine (to lr_min_ratio x lr at the last iteration)
    lr_min_ratio: float = 0.1
    round_weight: float = 0.01  # weight of the rounding regulariser
    warmup: float = 0.2  # fraction of iterations without the regulariser
    beta_start: float = 20.0
    beta_end: float = 2.0
    learn_scale: bool = True  # learn per-channel (per-group) scales jointly: s = s0 * exp(delta), codes stay floor/ceil of W / s0
    scale_lr: float = 1e-3
    loss: str = "mse"  # mse | fisher (diagonal Gauss-Newton weights from random output projections)
    qdrop: float = 0.0  # sequential mode: probability of a float input element instead of the quantized one
    autocast: str = "auto"  # auto | bf16 | fp16 | off: precision of the optimisation forwards (auto: bf16 for
    #   blocks quantized to <= 4 bits on CUDA, else float32/TF32: at W8 the rounding signal is below bf16 noise)
    capture_precision: str = "auto"  # auto (tf32 on CUDA) | fp32 | tf32 | bf16: precision of the capture passes
    cache_dtype: str = "float32"  # float32 | bfloat16 | float16: cached block inputs / targets
    cache_budget_gb: Optional[float] = None  # per capture group; None: 40 % of free device memory (CPU: 4 GB)
    forward_batch: int = 16  # UNet batch of the capture passes
    # stream: cache block inputs / targets on the host (pageable memory); the UNet is on the device only for
    # the capture passes, and each block (with its cached data, when that fits) only while it is reconstructed
    stream: bool = False
    # where streamed (or CPU) caches live: memory | disk (files under the output folder, removed at the end) |
    # auto (memory when one block's cache fits under host_cap_gib beside the rest, else disk)
    host_cache: str = "auto"
    compile: bool = False  # torch.compile the block loss
    compile_mode: Optional[str] = None  # e.g. max-autotune-no-cudagraphs, reduce-overhead (CUDA graphs)
    channels_last: bool = False  # channels_last convs (CUDA, with bf16)
    fallback: bool = True  # keep the best of adaround / rtn / searched-scale rtn per block
    eval_samples: int = 256  # calibration inputs (evenly spaced) on which the candidates are compared
    scale_init: str = "mse"  # mse (clipping-ratio search per channel) | maxabs
    scale_grid: int = 50
    devices: list[str] = field(default_factory=list)  # [] auto; independent mode: one worker per device when > 1
    log_every: int = 0  # loss-curve points per block (0: 20 points)

    def __post_init__(self) -> None:
        require(self.method in ("adaround", "rtn"), "recon.method", f"must be adaround or rtn, got {self.method!r}")
        require(self.mode in ("sequential", "independent"), "recon.mode", f"must be sequential or independent, got {self.mode!r}")
        require(self.iters >= 0, "recon.iters", "must be >= 0")
        require(self.method == "rtn" or self.iters > 0, "recon.iters", "must be > 0 for adaround")
        require(self.batch_size >= 1, "recon.batch_size", "must be >= 1")
        require(self.lr > 0 and self.scale_lr > 0, "recon.lr", "learning rates must be > 0")
        require(self.lr_fan_in_ref is None or self.lr_fan_in_ref >= 1, "recon.lr_fan_in_ref", "must be >= 1 or null")
        require(self.lr_schedule in ("constant", "cosine"), "recon.lr_schedule", "must be constant or cosine")
        require(0 <= self.lr_min_ratio <= 1, "recon.lr_min_ratio", "must be in [0, 1]")
        require(self.round_weight >= 0, "recon.round_weight", "must be >= 0")
        require(0 <= self.warmup < 1, "recon.warmup", "must be in [0, 1)")
        require(self.beta_start >= self.beta_end > 0, "recon.beta_start", "need beta_start >= beta_end > 0")
        require(self.loss in ("mse", "fisher"), "recon.loss", f"must be mse or fisher, got {self.loss!r}")
        require(0 <= self.qdrop < 1, "recon.qdrop", "must be in [0, 1)")
        require(self.qdrop == 0 or self.mode == "sequential", "recon.qdrop", "needs mode=sequential (independent mode has float inputs only)")
        require(self.autocast in ("auto", "bf16", "fp16", "off"), "recon.autocast", "must be auto, bf16, fp16 or off")
        require(self.capture_precision in ("auto", "fp32", "tf32", "bf16"), "recon.capture_precision", "must be auto, fp32, tf32 or bf16")
        require(self.cache_dtype in DTYPES, "recon.cache_dtype", f"must be one of {list(DTYPES)}")
        require(self.cache_budget_gb is None or self.cache_budget_gb > 0, "recon.cache_budget_gb", "must be > 0")
        require(self.forward_batch >= 1, "recon.forward_batch", "must be >= 1")
        require(self.host_cache in ("auto", "memory", "disk"), "recon.host_cache", "must be auto, memory or disk")
        require(self.scale_init in ("mse", "maxabs"), "recon.scale_init", "must be mse or maxabs")
        require(self.scale_grid >= 1, "recon.scale_grid", "must be >= 1")
        require(self.eval_samples >= 1, "recon.eval_samples", "must be >= 1")


@dataclass
class LayerResult:
    codes: torch.Tensor
    scale: torch.Tensor
    method: str  # adaround | rtn | rtn_mse


@dataclass
class BlockResult:
    name: str
    kind: str
    layers: dict[str, LayerResult]
    stats: dict


# ----------------------------------------------------------------------- precision helpers


def optimisation_autocast(opts: ReconConfig, device, bits: int = 8) -> Optional[torch.dtype]:
    """Autocast dtype of the optimisation forwards. Measured (tiny UNet transformer block, W8,
    500 iterations): bf16 autocast left 0.57x the RTN block error against 0.24x in float32, so
    `auto` uses bf16 only for blocks at <= 4 bits (on CUDA)."""
    dev = torch.device(device)
    if opts.autocast == "off" or (opts.autocast == "auto" and (dev.type != "cuda" or bits > 4)):
        return None
    if opts.autocast == "fp16":
        return torch.float16
    return torch.bfloat16


class precision:
    """Context: TF32 on / off for CUDA matmuls and convs (restored on exit)."""

    def __init__(self, tf32: bool):
        self.tf32 = tf32

    def __enter__(self):
        self.saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def capture_settings(opts: ReconConfig, device) -> tuple[bool, Optional[torch.dtype]]:
    """(tf32, autocast dtype) of the capture passes."""
    cuda = torch.device(device).type == "cuda"
    p = opts.capture_precision
    if p == "auto":
        p = "tf32" if cuda else "fp32"
    return (p == "tf32"), (torch.bfloat16 if p == "bf16" else None)


# ----------------------------------------------------------------------- per-layer inits


def layer_inits(weights: dict[str, torch.Tensor], specs: dict[str, LayerSpec], opts: ReconConfig, device) -> tuple[dict, dict]:
    """(rtn: name -> (codes, scale) at max-abs scale, init: name -> searched (or max-abs) scale)."""
    rtn_res, init = {}, {}
    for name, w in weights.items():
        w = w.to(device)
        spec = specs[name]
        codes, scale = rtn(w, spec)
        rtn_res[name] = (codes.cpu(), scale.cpu())
        init[name] = (search_scale(w, spec, grid=opts.scale_grid) if opts.scale_init == "mse" else scale).cpu()
    return rtn_res, init


# ----------------------------------------------------------------------- block functions


def _key(local: str) -> str:
    return f"{local}.weight" if local else "weight"


def unit_output(unit, wmap: dict[str, torch.Tensor], args, kwargs) -> torch.Tensor:
    overrides = {_key(local): wmap[g] for local, g in unit.layers.items() if g in wmap}
    return first_tensor(torch.func.functional_call(unit.module, overrides, args, kwargs, strict=False))


def _mix(q_args, fp_args, p: float, gen: torch.Generator):
    """QDrop: each floating input element is the float one with probability p, else the quantized one."""
    from torch.utils import _pytree as pytree

    ql, spec = pytree.tree_flatten(q_args)
    fl, _ = pytree.tree_flatten(fp_args)
    out = []
    for a, b in zip(ql, fl):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.shape == b.shape and a.dim() >= 1:
            mask = torch.rand(a.shape, generator=gen, device=gen.device) < p
            out.append(torch.where(mask, b, a))
        else:
            out.append(a)
    return pytree.tree_unflatten(out, spec)


def _rec_loss(out: torch.Tensor, tgt: torch.Tensor, fisher: Optional[torch.Tensor]) -> torch.Tensor:
    d = (out.float() - tgt.float()) ** 2
    if fisher is not None:
        w = fisher.to(d.dtype)
        d = d * w.reshape(*w.shape, *([1] * (d.dim() - w.dim())))
    if d.dim() == 1:
        return d.mean()
    return d.sum(dim=1).mean()


@torch.no_grad()
def block_mse(block: Block, caps: Sequence[Captured], targets: Sequence[torch.Tensor], wmap: dict, device, batch: int = 32,
              rows: Optional[torch.Tensor] = None, tf32: bool = False) -> float:
    """Mean squared error per element of the block's outputs vs `targets` (float32; TF32 only
    when asked), over all calibration rows or the given `rows`."""
    sq, count = 0.0, 0
    with precision(tf32):
        for u, cap, tgt in zip(block.units, caps, targets):
            all_rows = torch.arange(cap.n()) if rows is None else rows
            n = len(all_rows)
            for s in range(0, n, batch):
                idx = all_rows[s:s + batch]
                args, kwargs = cap.inputs(idx, device, torch.float32)
                out = unit_output(u, wmap, args, kwargs).float()
                t = tgt[idx.to(tgt.device)].to(device).float()
                sq += float(((out - t) ** 2).double().sum())
                count += t.numel()
    return sq / max(count, 1)


def rounding_lr(opts: ReconConfig, weight_shape: Sequence[int]) -> float:
    """Adam learning rate of one layer's rounding variables: `opts.lr`, scaled down by
    (lr_fan_in_ref / fan_in)^2 for layers whose fan-in exceeds `opts.lr_fan_in_ref`."""
    fan_in = math.prod(int(d) for d in weight_shape[1:])
    if opts.lr_fan_in_ref is None or fan_in <= opts.lr_fan_in_ref:
        return opts.lr
    return opts.lr * (opts.lr_fan_in_ref / fan_in) ** 2


@torch.no_grad()
def _target_power(targets: Sequence[torch.Tensor], chunk: int = 64) -> float:
    sq = sum(float((t[i:i + chunk].double() ** 2).sum()) for t in targets for i in range(0, t.shape[0], chunk))
    return sq / max(1, sum(t.numel() for t in targets))


# ----------------------------------------------------------------------- one block


def reconstruct_block(
    block: Block,
    caps: Sequence[Captured],
    targets: Sequence[torch.Tensor],
    weights: dict[str, torch.Tensor],
    specs: dict[str, LayerSpec],
    rtn_res: dict,
    init_scales: dict,
    opts: ReconConfig,
    device,
    *,
    fp_caps: Optional[Sequence[Captured]] = None,
    fisher: Optional[Sequence[Optional[torch.Tensor]]] = None,
    seed: int = 0,
    progress: Optional[Callable[[int, float], None]] = None,
) -> BlockResult:
    """Quantize one block; `caps` are its (possibly quantized-prefix) inputs, `targets` the
    float outputs, per unit. `progress(iteration, loss)` is called at every loss-curve point.

    1. the candidates without optimisation: RTN at max-abs scales and at the initial (searched) scales
    2. AdaRound (method adaround, iters > 0): rounding variables optimised against the block's outputs
    3. the candidate kept (AdaRound, or the lowest calibration error with `fallback`), per layer
    """
    device = torch.device(device)
    t0 = time.time()
    names = block.layers
    for u in block.units:
        u.module.requires_grad_(False)
    rtn_w = {g: dequant(*rtn_res[g], specs[g]).to(device) for g in names}
    init_codes = {g: rtn(weights[g].to(device), specs[g], init_scales[g].to(device)) for g in names}
    init_w = {g: dequant(c, s, specs[g]).to(device) for g, (c, s) in init_codes.items()}
    stats: dict = {"layers": len(names), "params": int(sum(weights[g].numel() for g in names)), "samples": caps[0].n() if caps else 0}
    stats["target_power"] = _target_power(targets)
    n_all = caps[0].n() if caps else 0
    rows = None
    if n_all > opts.eval_samples:
        rows = torch.linspace(0, n_all - 1, opts.eval_samples).round().long()
    tf32 = capture_settings(opts, device)[0]

    def evaluate(wmap):
        return block_mse(block, caps, targets, wmap, device, rows=rows, tf32=tf32)

    # 1. candidates without optimisation
    stats["mse_rtn_calib"] = evaluate(rtn_w)
    stats["mse_init_calib"] = evaluate(init_w)
    candidates = {"rtn": stats["mse_rtn_calib"], "rtn_mse": stats["mse_init_calib"]}
    quantizers: dict[str, AdaRoundQuantizer] = {}

    # 2. AdaRound
    if opts.method == "adaround" and opts.iters > 0 and names:
        quantizers = {g: AdaRoundQuantizer(weights[g].to(device), specs[g], init_scales[g].to(device), opts.learn_scale) for g in names}
        curve = _optimise_rounding(block, caps, targets, quantizers, weights, specs, opts, device, stats,
                                   fp_caps=fp_caps, fisher=fisher, seed=seed, progress=progress)
        hard = {g: q.hard_weight() for g, q in quantizers.items()}
        stats["mse_adaround_calib"] = evaluate(hard)
        stats["soft_fraction"] = float(sum(q.soft_fraction() * q.v.numel() for q in quantizers.values()) / max(1, sum(q.v.numel() for q in quantizers.values())))
        stats["curve"] = curve
        candidates["adaround"] = stats["mse_adaround_calib"]

    # 3. the kept candidate
    if opts.method == "adaround" and quantizers and not opts.fallback:
        chosen = "adaround"
    else:
        chosen = min(candidates, key=lambda k: (candidates[k], k != "adaround"))
    layers = {}
    for g in names:
        if chosen == "adaround":
            q = quantizers[g]
            layers[g] = LayerResult(q.codes().cpu(), q.scale().detach().float().cpu(), "adaround")
        elif chosen == "rtn_mse":
            c, s = init_codes[g]
            layers[g] = LayerResult(c.cpu(), s.cpu(), "rtn_mse")
        else:
            c, s = rtn_res[g]
            layers[g] = LayerResult(c.cpu(), s.cpu(), "rtn")
    stats["chosen"] = chosen
    stats["mse_recon_calib"] = candidates[chosen]
    stats["time_s"] = round(time.time() - t0, 3)
    stats["iters"] = opts.iters if quantizers else 0
    return BlockResult(block.name, block.kind, layers, stats)


def _rounding_optimizer(quantizers: dict[str, AdaRoundQuantizer], weights: dict[str, torch.Tensor], opts: ReconConfig,
                        stats: dict):
    """Adam over the rounding variables (one group per learning rate; the scales too with learn_scale),
    and the cosine schedule when asked (else None)."""
    by_lr: dict[float, list] = {}
    for g, q in quantizers.items():
        by_lr.setdefault(rounding_lr(opts, weights[g].shape), []).append(q.v)
    groups = [{"params": vs, "lr": lr} for lr, vs in by_lr.items()]
    stats["rounding_lr"] = sorted(by_lr)
    if opts.learn_scale:
        groups.append({"params": [q.log_scale for q in quantizers.values()], "lr": opts.scale_lr})
    optim = torch.optim.Adam(groups)
    sched = None
    if opts.lr_schedule == "cosine":
        lo, total = opts.lr_min_ratio, max(1, opts.iters - 1)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda i: lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * min(i, total) / total)))
    return optim, sched


def _optimise_rounding(block: Block, caps, targets, quantizers: dict[str, AdaRoundQuantizer], weights: dict, specs: dict,
                       opts: ReconConfig, device, stats: dict, *, fp_caps, fisher, seed: int, progress) -> list:
    """`opts.iters` steps of reconstruction loss (+ rounding regulariser once beta is set) on random
    calibration batches (QDrop-mixed inputs with `fp_caps`); returns the loss curve [it, rec, reg]."""
    optim, sched = _rounding_optimizer(quantizers, weights, opts, stats)
    gen = torch.Generator("cpu").manual_seed(seed)
    drop_gen = torch.Generator(device).manual_seed(seed + 1)
    ac = optimisation_autocast(opts, device, min(specs[g].bits for g in block.layers))
    scaler = torch.amp.GradScaler(device.type) if ac == torch.float16 else None  # fp16: keep small gradients
    n = caps[0].n()
    bs = min(opts.batch_size, n)
    every = max(1, opts.iters // (opts.log_every or 20))
    curve = []
    fisher = list(fisher) if fisher is not None else [None] * len(block.units)

    def loss_fn(wmap, inputs, tgts, fws):
        rec = 0.0
        for u, (args, kwargs), tgt, fw in zip(block.units, inputs, tgts, fws):
            rec = rec + _rec_loss(unit_output(u, wmap, args, kwargs), tgt, fw)
        return rec

    step_fn = loss_fn
    if opts.compile:
        torch._dynamo.reset()  # one compilation per block; keeps dynamo's recompile limit out of the way
        step_fn = torch.compile(loss_fn, mode=opts.compile_mode, dynamic=False)
    cl = opts.channels_last and device.type == "cuda"
    with precision(device.type == "cuda"):
        for it in range(opts.iters):
            idx = torch.randint(0, n, (bs,), generator=gen)
            inputs = _batch_inputs(caps, fp_caps, idx, opts, device, drop_gen, cl)
            tgts = [t[idx.to(t.device)].to(device, non_blocking=True) for t in targets]
            fws = [None if f is None else f[idx.to(f.device)].to(device) for f in fisher]
            wmap = {g: q.soft_weight() for g, q in quantizers.items()}
            with _autocast(device, ac):
                rec = step_fn(wmap, inputs, tgts, fws)
            beta = beta_schedule(it, opts.iters, opts.warmup, opts.beta_start, opts.beta_end)
            loss = rec
            reg = None
            if beta is not None and opts.round_weight > 0:
                reg = opts.round_weight * sum(q.round_loss(beta) for q in quantizers.values())
                loss = loss + reg
            optim.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optim)
                scaler.update()
            else:
                loss.backward()
                optim.step()
            if sched is not None:
                sched.step()
            if it % every == 0 or it == opts.iters - 1:
                curve.append([it, float(rec.detach()), float(reg.detach()) if reg is not None else 0.0])
                if progress is not None:
                    progress(it, curve[-1][1])
    return curve


def _batch_inputs(caps, fp_caps, idx: torch.Tensor, opts: ReconConfig, device, drop_gen: torch.Generator, cl: bool) -> list:
    """Each unit's (args, kwargs) for the rows `idx`: QDrop-mixed with the float inputs when asked, channels-last on CUDA."""
    inputs = []
    for ui, cap in enumerate(caps):
        args, kwargs = cap.inputs(idx, device, torch.float32)
        if fp_caps is not None and opts.qdrop > 0:
            args, kwargs = _mix((args, kwargs), fp_caps[ui].inputs(idx, device, torch.float32), opts.qdrop, drop_gen)
        if cl:
            args = tuple(a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args)
        inputs.append((args, kwargs))
    return inputs


def rest_block_result(block: Block, weights, specs, rtn_res, init_scales) -> BlockResult:
    """Layers outside every block: RTN at the searched scale, no reconstruction."""
    layers = {}
    for g in block.layers:
        c, s = rtn(weights[g], specs[g], init_scales[g])
        layers[g] = LayerResult(c, s, "rtn_mse")
    return BlockResult(block.name, block.kind, layers, {"chosen": "rtn_mse", "layers": len(layers), "time_s": 0.0, "iters": 0})
