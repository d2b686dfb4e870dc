"""fp16 overflow scan: which ops of a model leave the fp16 range on real inputs.

Forward hooks on every leaf module of the text encoder, UNet and VAE decoder while the
pipeline samples calibration prompts (DDIM, classifier-free guidance), with fp16 emulation
(each module's output is rounded to fp16, so an overflow becomes inf and propagates as it
would on the device). Per module it records the largest |output| and, where an op computes
intermediate sums the output does not show, those too:

- Conv2d / Linear: the accumulation bound max sum_i |w_i x_i| (no partial sum can exceed it)
- GroupNorm / LayerNorm: the largest squared deviation (x - mean)^2 and sum of squares
- GELU (tanh form): 0.044715 |x|^3
- attention: the QK^T logits before and after the 1/sqrt(d) scale

and names the rewrite that removes each overflow where one exists (fp16-safe norms, clipped
GELU, q scaled before the matmul); what is left (activations themselves above 65504) needs
the residual-stream rescaling or real trained weights.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pocketdiff.errors import PocketdiffError

FP16_MAX = 65504.0
# blocks whose outputs are the residual stream of a UNet / VAE decoder
STREAM_BLOCKS = ("ResnetBlock2D", "Transformer2DModel", "Downsample2D", "Upsample2D")


def _amax(t: torch.Tensor) -> float:
    t = t.detach()
    if t.numel() == 0:
        return 0.0
    v = t.abs().float().nan_to_num(nan=float("inf")).max().item()
    return float(v)


def _is_leaf(m: nn.Module) -> bool:
    return next(iter(m.children()), None) is None


def _is_gelu(m: nn.Module) -> bool:
    return isinstance(m, nn.GELU) or type(m).__name__ in ("GELUActivation", "NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation")


class Fp16Scanner:
    def __init__(self, emulate: bool = True, accumulation: bool = True):
        self.emulate = emulate
        self.accumulation = accumulation
        self.stats: dict[str, dict] = {}
        self.order: list[str] = []
        self.first_overflow: Optional[str] = None
        self._hooks: list = []
        self._qk: dict[int, dict] = {}

    # ------------------------------------------------------------------ recording
    def _rec(self, name: str, key: str, value: float, kind: str) -> None:
        s = self.stats.get(name)
        if s is None:
            s = self.stats[name] = {"kind": kind}
            self.order.append(name)
        s[key] = max(s.get(key, 0.0), value)
        if value > FP16_MAX and self.first_overflow is None:
            self.first_overflow = f"{name} ({key} {value:.3g})"

    def _leaf_hook(self, name: str):
        def hook(mod, inputs, output):
            if not isinstance(output, torch.Tensor):
                return None
            kind = type(mod).__name__
            x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
            self._rec(name, "max_abs", _amax(output), kind)
            with torch.no_grad():
                if self.accumulation and x is not None and isinstance(mod, nn.Conv2d):
                    b = F.conv2d(x.abs().float(), mod.weight.abs().float(), None, mod.stride, mod.padding, mod.dilation, mod.groups)
                    self._rec(name, "accumulation", _amax(b), kind)
                elif self.accumulation and x is not None and isinstance(mod, nn.Linear):
                    b = x.abs().float() @ mod.weight.abs().float().t()
                    self._rec(name, "accumulation", _amax(b), kind)
                elif x is not None and isinstance(mod, nn.GroupNorm):
                    g = x.float().reshape(x.shape[0], mod.num_groups, -1)
                    d2 = (g - g.mean(-1, keepdim=True)) ** 2
                    self._rec(name, "square", _amax(d2), kind)
                    self._rec(name, "sum_squares", _amax(d2.sum(-1)), kind)
                elif x is not None and isinstance(mod, nn.LayerNorm):
                    d2 = (x.float() - x.float().mean(-1, keepdim=True)) ** 2
                    self._rec(name, "square", _amax(d2), kind)
                    self._rec(name, "sum_squares", _amax(d2.sum(-1)), kind)
                elif x is not None and _is_gelu(mod):
                    self._rec(name, "cube", 0.044715 * _amax(x) ** 3, kind)
            if self.emulate and output.is_floating_point():
                return output.to(torch.float16).to(output.dtype)
            return None

        return hook

    def _gelu_proj_hook(self, name: str, gated: bool):
        def hook(mod, inputs, output):
            gate = output.chunk(2, dim=-1)[1] if gated else output
            self._rec(name, "cube", 0.044715 * _amax(gate) ** 3, "GEGLU" if gated else "GELU")
            return None

        return hook

    def _attention_hooks(self, name: str, attn: nn.Module) -> None:
        key = id(attn)
        store = self._qk.setdefault(key, {})

        def grab(which):
            def hook(mod, inputs, output):
                store[which] = output.detach()
            return hook

        def done(mod, inputs, output):
            q, k = store.pop("q", None), store.pop("k", None)
            if q is None or k is None or q.dim() != 3:
                return None
            h = int(attn.heads)
            B, Lq, C = q.shape
            d = C // h
            qh = q.float().reshape(B, Lq, h, d).transpose(1, 2)
            kh = k.float().reshape(B, k.shape[1], h, d).transpose(1, 2)
            worst = 0.0
            for qc in torch.split(qh, 1024, dim=2):  # bounded memory
                worst = max(worst, _amax(qc @ kh.transpose(-1, -2)))
            self._rec(name, "logits_unscaled", worst, "Attention")
            self._rec(name, "logits", worst * float(attn.scale), "Attention")
            return None

        self._hooks.append(attn.to_q.register_forward_hook(grab("q")))
        self._hooks.append(attn.to_k.register_forward_hook(grab("k")))
        self._hooks.append(attn.register_forward_hook(done))

    def _stream_hook(self, name: str):
        def hook(mod, inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor):
                self._rec(name, "stream", _amax(out), type(mod).__name__)
            return None

        return hook

    def attach(self, module: nn.Module, prefix: str) -> None:
        for name, m in module.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            if type(m).__name__ in STREAM_BLOCKS:
                self._hooks.append(m.register_forward_hook(self._stream_hook(full)))
            if type(m).__name__ == "Attention" and hasattr(m, "to_q") and hasattr(m, "heads"):
                self._attention_hooks(full, m)
            if type(m).__name__ in ("GELU", "GEGLU") and isinstance(getattr(m, "proj", None), nn.Module) and not isinstance(m, nn.GELU):
                self._hooks.append(m.proj.register_forward_hook(self._gelu_proj_hook(full, type(m).__name__ == "GEGLU")))
            if _is_leaf(m) and not isinstance(m, (nn.Dropout, nn.Identity)):
                self._hooks.append(m.register_forward_hook(self._leaf_hook(full)))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ report
    def report(self, rewrites=None) -> dict:
        entries = []
        worst_ratio = []
        for name in self.order:
            s = self.stats[name]
            values = {k: v for k, v in s.items() if k != "kind"}
            over = {k: v for k, v in values.items() if v > FP16_MAX}
            peak = max(values.values()) if values else 0.0
            worst_ratio.append((peak, name, s["kind"]))
            if not over:
                continue
            entries.append({"module": name, "kind": s["kind"], "over": over, "mitigated_by": _mitigation(s["kind"], over, rewrites)})
        worst_ratio.sort(reverse=True)
        peaks: dict[str, dict] = {}
        for name in self.order:
            for key, value in self.stats[name].items():
                if key != "kind" and value > peaks.get(key, {}).get("value", -1.0):
                    peaks[key] = {"value": value, "module": name}
        unmitigated = [e for e in entries if not e["mitigated_by"]]
        return {
            "fp16_max": FP16_MAX,
            "emulated": self.emulate,
            "modules_scanned": len(self.order),
            "components": sorted({n.split(".", 1)[0] for n in self.order}),  # the models watched (text_encoder_2 for SDXL)
            "overflowing_ops": len(entries),
            "unmitigated": len(unmitigated),
            "first_overflow": self.first_overflow,
            "max_abs": max((s.get("max_abs", 0.0) for s in self.stats.values()), default=0.0),
            "worst": [{"module": n, "kind": k, "peak": p} for p, n, k in worst_ratio[:10]],
            "peaks": peaks,
            "stats": {n: {k: v for k, v in self.stats[n].items()} for n in self.order if "stream" in self.stats[n]},
            "ops": entries,
        }


def _mitigation(kind: str, over: dict, rewrites) -> list[str]:
    """Which configured rewrite removes each overflowing quantity (empty: none does)."""
    if rewrites is None:
        return []
    fixes = []
    remaining = set(over)
    if kind == "GroupNorm" and rewrites.group_norm and rewrites.group_norm_fp16_safe:
        remaining -= {"square", "sum_squares"}
        fixes.append("rewrites.group_norm_fp16_safe")
    if kind in ("GELU", "GELUActivation", "NewGELUActivation") or "GELU" in kind:
        if rewrites.clipped_gelu:
            remaining -= {"cube"}
            fixes.append("rewrites.clipped_gelu")
    if kind == "Attention" and rewrites.attention:
        remaining -= {"logits_unscaled"}
        fixes.append("rewrites.attention (q scaled before QK^T)")
    return fixes if not remaining else []


def residual_scale_for(peak: float, target: float = FP16_MAX / 16) -> float:
    """The power of two that brings a residual-stream peak down to `target` (1.0 when it fits). The peak must be a
    float32 magnitude (`scan_pipeline` measures without fp16 emulation for `residual_scale_auto`): an emulated stream
    that left the fp16 range reads inf."""
    if not math.isfinite(peak):
        raise PocketdiffError(f"rewrites.residual_scale_auto: the residual stream's peak is {peak} (an fp16-emulated "
                              "scan); set rewrites.residual_scale to a power of two by hand")
    if not peak > target:
        return 1.0
    return 2.0 ** -math.ceil(math.log2(peak / target))


def stream_peaks(report: dict) -> dict[str, float]:
    """Largest residual-stream value per component prefix ('unet', 'vae_decoder') of a scan."""
    out: dict[str, float] = {}
    for name, s in report.get("stats", {}).items():
        if "stream" in s:
            comp = name.split(".", 1)[0]
            out[comp] = max(out.get(comp, 0.0), s["stream"])
    return out


@torch.no_grad()
def scan_pipeline(pipe, prompts: list[str], steps: int = 4, guidance_scale: float = 7.5, resolution: Optional[int] = None,
                  seed: int = 0, rewrites=None, emulate: bool = True) -> dict:
    """Sample `prompts` with the pipeline under the scanner; the report of `Fp16Scanner`. With
    `rewrites.residual_scale_auto` the scan runs without fp16 emulation: the stream peaks it picks the scale from
    must be float32 magnitudes (emulated, a stream past 65504 reads inf, e.g. SDXL's VAE decoder); every op past
    the fp16 range is still flagged, by its float32 value."""
    from pocketdiff.sampling import generate

    if rewrites is not None and getattr(rewrites, "residual_scale_auto", False):
        emulate = False
    scanner = Fp16Scanner(emulate=emulate)
    scanner.attach(pipe.text_encoder, "text_encoder")
    if getattr(pipe, "text_encoder_2", None) is not None:  # the SDXL family's second text encoder
        scanner.attach(pipe.text_encoder_2, "text_encoder_2")
    scanner.attach(pipe.unet, "unet")
    scanner.attach(pipe.vae.decoder, "vae_decoder")
    if getattr(pipe.vae, "post_quant_conv", None) is not None:
        scanner.attach(pipe.vae.post_quant_conv, "vae_decoder.post_quant_conv")
    try:
        images = generate(pipe, prompts, steps=steps, guidance_scale=guidance_scale, seed=seed, resolution=resolution)
    finally:
        scanner.detach()
    rep = scanner.report(rewrites)
    rep["prompts"] = list(prompts)
    rep["steps"] = steps
    rep["images_finite"] = bool(torch.isfinite(images).all())
    return rep
