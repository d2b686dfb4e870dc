"""Graph rewrites as module swaps, applied to a copy of a component before conversion.

Each rewrite replaces torch modules by numerically equivalent ones that convert into
delegate-friendly TFLite (Choi et al. 2023; measured in docs/MEASUREMENTS.md):

- `Conv1x1Linear`: nn.Linear as a 1x1 Conv2D. Tokens become the conv's batch
  ([N, C, 1, 1]), which in TFLite's NHWC layout is a plain reshape: no transpose chain.
  Needed for int8 (litert's DEQUANTIZE -> FULLY_CONNECTED does not compile on the delegate).
- `RankFourGroupNorm`: GroupNorm computed on rank-4 tensors with explicit moments and a
  per-channel affine (no BROADCAST_TO, no rank-5 tensors), laid out NHWC so the converter's
  layout pass cancels the permutes; optional fp16-safe moments (pre-scaled by the group's
  max |x - mean| so squares cannot overflow).
- `ClippedGELU` / `ClippedGEGLU`: tanh-GELU whose tanh argument is computed on the input
  clamped to [-M, M] (M=10, the paper's clip): x^3 cannot overflow fp16 and the value is
  unchanged (tanh has saturated long before |x| = 10).
- `SerializedConv2d`: a Conv2D split into input-channel (preferred) and/or output-channel
  pieces when its activations exceed a per-device budget; the smallest factor that fits.
- `SplitAttention`: diffusers Attention with explicit rank-4 matmuls, the softmax scale
  applied to q before the matmul, and queries processed in chunks so that the attention
  map never exceeds a memory budget.
- Time embedding outside the graph: see `components.UNetGraph(external_time_embedding=True)`.
- Residual-stream rescaling for fp16 range (`rewrites.residual_scale`): export/residual_scale.py.

Every module created here carries `pd_source` = (name of the original layer, rows, cols), so
int8 codes can be sliced for the pieces and found again in the .tflite.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError, require

from .conv_lowering import LOWERINGS, applies_to, lower_convs
from .residual_scale import rescale_residual_stream

GELU_CLIP = 10.0
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclasses.dataclass
class RewriteConfig:
    """Which module swaps run before conversion (each can be switched off)."""

    linear_to_conv: bool = True
    group_norm: bool = True  # rank-4 broadcast-free GroupNorm (NHWC layout)
    group_norm_fp16_safe: bool = True  # moments pre-scaled by max|x - mean|
    clipped_gelu: bool = True
    gelu_clip: float = GELU_CLIP
    attention: bool = True  # SplitAttention (explicit matmuls, q pre-scaled, chunking)
    attention_budget_mb: Optional[float] = None  # max attention map per chunk (fp16 bytes); None: no chunking
    conv_budget_mb: Optional[float] = None  # max activation per conv piece (fp16 bytes); None: no serialization
    conv_budget_scope: str = "input_output"  # what must fit: input_output (each piece's input and output) | input (its input: device_profile.conv_input_mb)
    conv_split: str = "input"  # preferred split: input | output
    time_embedding_outside: bool = True  # UNet time embedding computed outside the graph (a table in the bundle)
    residual_scale: Optional[float] = None  # fp16: scale the UNet / VAE-decoder residual stream by this power of two (e.g. 0.125)
    residual_scale_auto: bool = False  # pick the power of two per component from the fp16 scan's stream peak
    activation_bytes: int = 2  # bytes per activation element on the device (fp16)
    # none | shifted_1x1: every kxk Conv2d (after serialization: piece by piece) as k*k accumulated 1x1 convs over
    # shifted slices of one padded input (export/conv_lowering.py): no Winograd copy on the GPU, and with
    # int8.gpu_weights: direct its int8 weights stay int8 there
    conv_lowering: str = "none"
    conv_lowering_components: list = dataclasses.field(default_factory=lambda: ["unet"])  # which components' convs
    conv_lowering_strided: bool = True  # also the stride-2 downsamplers (strided slices); false keeps them kxk

    def __post_init__(self) -> None:
        require(self.conv_lowering in LOWERINGS, "rewrites.conv_lowering", f"must be one of {', '.join(LOWERINGS)}, got {self.conv_lowering!r}")
        for c in self.conv_lowering_components:
            require(c in ("text_encoder", "unet", "vae_decoder"), "rewrites.conv_lowering_components",
                    f"unknown component {c!r}; choose from text_encoder, unet, vae_decoder")
        require(self.gelu_clip > 0, "rewrites.gelu_clip", f"must be positive, got {self.gelu_clip}")
        require(self.attention_budget_mb is None or self.attention_budget_mb > 0, "rewrites.attention_budget_mb", "must be positive or null")
        require(self.conv_budget_mb is None or self.conv_budget_mb > 0, "rewrites.conv_budget_mb", "must be positive or null")
        require(self.conv_split in ("input", "output"), "rewrites.conv_split", f"must be input or output, got {self.conv_split!r}")
        require(self.conv_budget_scope in ("input_output", "input"), "rewrites.conv_budget_scope",
                f"must be input_output or input, got {self.conv_budget_scope!r}")
        require(self.activation_bytes in (2, 4), "rewrites.activation_bytes", "must be 2 (fp16) or 4 (fp32)")
        if self.residual_scale is not None:
            require(self.residual_scale > 0 and math.log2(self.residual_scale).is_integer(), "rewrites.residual_scale",
                    f"must be a power of two (exact in the weights and int8 scales), got {self.residual_scale}")

    @classmethod
    def none(cls) -> "RewriteConfig":
        return cls(
            linear_to_conv=False, group_norm=False, group_norm_fp16_safe=False, clipped_gelu=False,
            attention=False, time_embedding_outside=False,
        )


def _source(module: nn.Module, name: str) -> tuple:
    return getattr(module, "pd_source", (name, None, None))


# --------------------------------------------------------------------------------------
# Linear -> 1x1 Conv2D
# --------------------------------------------------------------------------------------

class Conv1x1Linear(nn.Module):
    """y = Linear(x) for x [..., in], computed as a 1x1 Conv2D over [N, in, 1, 1]."""

    def __init__(self, linear: nn.Linear, name: str = ""):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.conv = nn.Conv2d(linear.in_features, linear.out_features, 1, bias=linear.bias is not None)
        with torch.no_grad():
            self.conv.weight.copy_(linear.weight.detach().reshape(linear.out_features, linear.in_features, 1, 1))
            if linear.bias is not None:
                self.conv.bias.copy_(linear.bias.detach())
        self.conv.pd_source = _source(linear, name)
        if hasattr(linear, "pd_weight_factor"):
            self.conv.pd_weight_factor = linear.pd_weight_factor

    @property
    def weight(self) -> torch.Tensor:  # diffusers peeks at .weight.dtype
        return self.conv.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.conv(x.reshape(-1, self.in_features, 1, 1))
        return y.reshape(*lead, self.out_features)


# --------------------------------------------------------------------------------------
# GroupNorm
# --------------------------------------------------------------------------------------

class RankFourGroupNorm(nn.Module):
    """nn.GroupNorm on [B, C, H, W] (or [B, C, L]) with rank-4 intermediates and no broadcast ops.

    Layout: NHWC ([B, H*W, G, C/G]); the permutes cancel against the converter's own NCHW ->
    NHWC transposes. `fp16_safe`: the deviations are divided by the group's max |x - mean|
    before squaring (GroupNorm is scale-invariant, so the result is the same), so the sum of
    squares stays <= the group size instead of overflowing fp16 for |x - mean| > 256.
    """

    def __init__(self, gn: nn.GroupNorm, fp16_safe: bool = False):
        super().__init__()
        self.num_groups, self.num_channels, self.eps = gn.num_groups, gn.num_channels, float(gn.eps)
        self.fp16_safe = fp16_safe
        self.affine = gn.affine
        if gn.affine:
            self.weight = nn.Parameter(gn.weight.detach().clone())
            self.bias = nn.Parameter(gn.bias.detach().clone())
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        B, C = shape[0], shape[1]
        spatial = shape[2:]
        G = self.num_groups
        if len(spatial) == 2:
            h = x.permute(0, 2, 3, 1)
        elif len(spatial) == 1:
            h = x.permute(0, 2, 1)
        else:
            raise PocketdiffError(f"RankFourGroupNorm expects rank 3 or 4 input, got {list(shape)}")
        n = 1
        for s in spatial:
            n *= int(s)
        h = h.reshape(B, n, G, C // G)
        mean = h.mean(dim=(1, 3), keepdim=True)
        d = h - mean
        if self.fp16_safe:
            k = d.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-2)
            inv_k = 1.0 / k
            dk = d * inv_k
            var = (dk * dk).mean(dim=(1, 3), keepdim=True)
            y = dk * torch.rsqrt(var + self.eps * inv_k * inv_k)
        else:
            var = (d * d).mean(dim=(1, 3), keepdim=True)
            y = d * torch.rsqrt(var + self.eps)
        y = y.reshape(B, *spatial, C)
        if self.affine:
            y = y * self.weight + self.bias
        if len(spatial) == 2:
            return y.permute(0, 3, 1, 2)
        return y.permute(0, 2, 1)


# --------------------------------------------------------------------------------------
# GELU
# --------------------------------------------------------------------------------------

def clipped_gelu(x: torch.Tensor, clip: float = GELU_CLIP) -> torch.Tensor:
    """tanh-GELU with the tanh argument computed on clamp(x, -clip, clip)."""
    xc = x.clamp(-clip, clip)
    inner = _SQRT_2_OVER_PI * (xc + 0.044715 * xc * xc * xc)
    return 0.5 * x * (1.0 + torch.tanh(inner))


class ClippedGELU(nn.Module):
    """Replaces nn.GELU / transformers' GELU activations (optionally with diffusers' GELU proj)."""

    def __init__(self, clip: float = GELU_CLIP, proj: Optional[nn.Module] = None):
        super().__init__()
        self.clip = float(clip)
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.proj is not None:
            x = self.proj(x)
        return clipped_gelu(x, self.clip)


class ClippedGEGLU(nn.Module):
    """diffusers GEGLU (proj -> value * gelu(gate)) with the clipped GELU."""

    def __init__(self, geglu: nn.Module, clip: float = GELU_CLIP):
        super().__init__()
        self.proj = geglu.proj
        self.clip = float(clip)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        h = self.proj(hidden_states)
        value, gate = h.chunk(2, dim=-1)
        return value * clipped_gelu(gate, self.clip)


# --------------------------------------------------------------------------------------
# Conv serialization
# --------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_conv_split(
    in_elems: int, out_elems: int, c_in: int, c_out: int, budget_elems: int, prefer: str = "input",
    bound_output: bool = True,
) -> Optional[tuple[int, int]]:
    """Smallest (k_in, k_out) (by pieces k_in * k_out) such that one piece's input
    (in_elems / k_in) and, with `bound_output`, its output (out_elems / k_out) fit the budget;
    ties go to the preferred split. (1, 1) when the conv already fits; None when nothing fits."""
    best = None
    for k_in in _divisors(c_in):
        if in_elems // k_in > budget_elems:
            continue
        for k_out in _divisors(c_out):
            if bound_output and out_elems // k_out > budget_elems:
                continue
            pref = (k_out > 1) if prefer == "input" else (k_in > 1)
            key = (k_in * k_out, pref, k_in + k_out)
            if best is None or key < best[0]:
                best = (key, (k_in, k_out))
            break  # larger k_out for this k_in only costs more
    return None if best is None else best[1]


class SerializedConv2d(nn.Module):
    """Conv2d computed as k_in x k_out smaller convs: inputs split by channel and summed,
    outputs split by channel and concatenated. Bias is added once per output piece."""

    def __init__(self, conv: nn.Conv2d, k_in: int, k_out: int, name: str = ""):
        super().__init__()
        if conv.groups != 1:
            raise PocketdiffError(f"{name}: grouped convolutions are not serialized")
        C_in, C_out = conv.in_channels, conv.out_channels
        if C_in % k_in or C_out % k_out:
            raise PocketdiffError(f"{name}: split {k_in}x{k_out} does not divide {C_in}->{C_out} channels")
        self.k_in, self.k_out = k_in, k_out
        self.in_size, self.out_size = C_in // k_in, C_out // k_out
        src_name, src_rows, src_cols = _source(conv, name)
        r0 = src_rows[0] if src_rows else 0
        c0 = src_cols[0] if src_cols else 0
        self.pieces = nn.ModuleList()
        for j in range(k_out):
            for i in range(k_in):
                p = nn.Conv2d(
                    self.in_size, self.out_size, conv.kernel_size, stride=conv.stride, padding=conv.padding,
                    dilation=conv.dilation, bias=(conv.bias is not None and i == 0), padding_mode=conv.padding_mode,
                )
                rows = (j * self.out_size, (j + 1) * self.out_size)
                cols = (i * self.in_size, (i + 1) * self.in_size)
                with torch.no_grad():
                    p.weight.copy_(conv.weight.detach()[rows[0] : rows[1], cols[0] : cols[1]])
                    if p.bias is not None:
                        p.bias.copy_(conv.bias.detach()[rows[0] : rows[1]])
                p.pd_source = (src_name, (r0 + rows[0], r0 + rows[1]), (c0 + cols[0], c0 + cols[1]))
                if hasattr(conv, "pd_weight_factor"):
                    p.pd_weight_factor = conv.pd_weight_factor
                self.pieces.append(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = torch.split(x, self.in_size, dim=1) if self.k_in > 1 else (x,)
        outs = []
        for j in range(self.k_out):
            acc = None
            for i in range(self.k_in):
                y = self.pieces[j * self.k_in + i](xs[i])
                acc = y if acc is None else acc + y
            outs.append(acc)
        return torch.cat(outs, dim=1) if self.k_out > 1 else outs[0]


# --------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------

def attention_chunks(batch_heads: int, q_len: int, k_len: int, budget_bytes: Optional[float], bytes_per: int = 2) -> int:
    """Number of query chunks so one chunk's attention map fits the budget."""
    if budget_bytes is None:
        return 1
    per_query = batch_heads * k_len * bytes_per
    rows = max(1, int(budget_bytes // per_query))
    return max(1, math.ceil(q_len / rows))


def _paired_query_attention(q, kt, v, n: int):
    """Single-head attention ([1, 1, L, d] operands) as n batched matmuls over pairs of query
    chunks: a matmul whose operands have no batch dimension above 1 becomes a FULLY_CONNECTED op
    with the keys as its weights (the VAE's mid-block attention: a 4 MB input at 512 px, over the
    phone profile's fc_input_mb). Two query halves against a stacked copy of k and v keep
    BATCH_MATMUL, with the same attention map per op as n chunks."""
    L = q.shape[2]
    size = L // (2 * n)
    kt2, v2 = torch.cat([kt, kt], dim=1), torch.cat([v, v], dim=1)
    outs = []
    for i in range(n):
        qp = q[:, :, 2 * i * size:(2 * i + 2) * size].reshape(1, 2, size, q.shape[-1])  # [1, 2, size, d]
        o = torch.matmul(torch.softmax(torch.matmul(qp, kt2), dim=-1), v2)  # [1, 2, size, dv]
        outs.append(o.reshape(1, 1, 2 * size, o.shape[-1]))
    return outs[0] if n == 1 else torch.cat(outs, dim=2)


class SplitAttention(nn.Module):
    """diffusers `Attention` (SD self/cross-attention and the VAE's spatial attention) with
    explicit rank-4 matmuls, q scaled before QK^T, and query chunks under a memory budget."""

    def __init__(self, attn: nn.Module, budget_bytes: Optional[float] = None, bytes_per: int = 2):
        super().__init__()
        if getattr(attn, "spatial_norm", None) is not None or getattr(attn, "norm_q", None) is not None:
            raise PocketdiffError("SplitAttention: spatial_norm / qk-norm attention is not supported")
        if getattr(attn, "norm_cross", None) is not None or getattr(attn, "add_k_proj", None) is not None:
            raise PocketdiffError("SplitAttention: cross-norm / added-kv attention is not supported")
        self.to_q, self.to_k, self.to_v = attn.to_q, attn.to_k, attn.to_v
        self.to_out = attn.to_out[0]
        self.group_norm = attn.group_norm
        self.heads = int(attn.heads)
        self.scale = float(attn.scale)
        self.residual_connection = bool(attn.residual_connection)
        self.rescale_output_factor = float(attn.rescale_output_factor)
        self.budget_bytes = budget_bytes
        self.bytes_per = bytes_per
        self.last_chunks = 1

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if attention_mask is not None:
            raise PocketdiffError("SplitAttention: attention masks are not supported in exported UNets")
        residual = hidden_states
        spatial = hidden_states.dim() == 4
        if spatial:
            B, C, H, W = hidden_states.shape
            if self.group_norm is not None:  # GroupNorm over [B, C, H, W] == over [B, C, H*W]
                hidden_states = self.group_norm(hidden_states)
            hidden_states = hidden_states.permute(0, 2, 3, 1).reshape(B, H * W, C)
        elif self.group_norm is not None:
            hidden_states = self.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q = self.to_q(hidden_states) * self.scale
        k = self.to_k(context)
        v = self.to_v(context)
        B, Lq, inner = q.shape
        Lk = k.shape[1]
        h = self.heads
        d = inner // h
        q = q.reshape(B, Lq, h, d).permute(0, 2, 1, 3)  # [B, h, Lq, d]
        kt = k.reshape(B, Lk, h, d).permute(0, 2, 3, 1)  # [B, h, d, Lk]
        v = v.reshape(B, Lk, h, v.shape[-1] // h).permute(0, 2, 1, 3)  # [B, h, Lk, dv]
        n = attention_chunks(B * h, Lq, Lk, self.budget_bytes, self.bytes_per)
        if B * h == 1:  # query pairs need 2 n | Lq: the next such n (smaller maps), so no chunk becomes a FULLY_CONNECTED
            n = next((m for m in range(n, 4 * n + 1) if Lq % (2 * m) == 0), n)
        self.last_chunks = n
        if B * h == 1 and Lq % (2 * n) == 0:
            out = _paired_query_attention(q, kt, v, n)
        elif n == 1:
            out = torch.matmul(torch.softmax(torch.matmul(q, kt), dim=-1), v)
        else:
            size = math.ceil(Lq / n)
            outs = [torch.matmul(torch.softmax(torch.matmul(qc, kt), dim=-1), v) for qc in torch.split(q, size, dim=2)]
            out = torch.cat(outs, dim=2)
        out = out.permute(0, 2, 1, 3).reshape(B, Lq, -1)
        out = self.to_out(out)
        if spatial:
            out = out.reshape(B, H, W, -1).permute(0, 3, 1, 2)
        if self.residual_connection:
            out = out + residual
        if self.rescale_output_factor != 1.0:
            out = out / self.rescale_output_factor
        return out


# --------------------------------------------------------------------------------------
# Applying
# --------------------------------------------------------------------------------------

def swap_modules(root: nn.Module, match: Callable[[str, nn.Module], bool], make: Callable[[str, nn.Module], nn.Module]) -> list[str]:
    """Replace every submodule for which match(name, module) holds by make(name, module).
    Returns the names replaced. Children of replaced modules are not visited."""
    replaced = []

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            full = f"{prefix}.{child_name}" if prefix else child_name
            if match(full, child):
                setattr(parent, child_name, make(full, child))
                replaced.append(full)
            else:
                visit(child, full)

    visit(root, "")
    return replaced


def _is_diffusers_attention(m: nn.Module) -> bool:
    return type(m).__name__ == "Attention" and hasattr(m, "to_q") and hasattr(m, "to_out") and hasattr(m, "heads")


def _is_gelu_activation(m: nn.Module) -> bool:
    name = type(m).__name__
    if isinstance(m, nn.GELU):
        return True
    # transformers' exact / tanh GELU activations (not QuickGELU: sigmoid-based, fp16-safe)
    return name in ("GELUActivation", "NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation")


def record_conv_shapes(module: nn.Module, sample_inputs) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (input shape, output shape) of every Conv2d in one forward pass."""
    shapes: dict[str, tuple[list[int], list[int]]] = {}
    hooks = []
    for name, m in module.named_modules():
        if isinstance(m, nn.Conv2d):
            def hook(mod, inp, out, name=name):
                shapes[name] = (list(inp[0].shape), list(out.shape))
            hooks.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            module(*sample_inputs)
    finally:
        for h in hooks:
            h.remove()
    return shapes


def apply_rewrites(module: nn.Module, cfg: RewriteConfig, sample_inputs=None, component: Optional[str] = None) -> dict:
    """Apply the configured swaps to `module` in place. Returns a report of what changed.

    Order: attention (it reuses the projections), GELU, GroupNorm, Linear -> conv, then conv
    serialization (needs activation shapes, hence `sample_inputs`), then the kxk -> 1x1 lowering of
    `component` (None: any) when `rewrites.conv_lowering` asks for it.
    """
    report: dict = {}
    for name, m in module.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)) and not hasattr(m, "pd_source"):
            m.pd_source = (name, None, None)
    if cfg.residual_scale is not None and cfg.residual_scale != 1.0:
        stream = getattr(module, "unet", None)
        if stream is None:
            stream = getattr(module, "decoder", None)
        if stream is not None:  # the text encoder has no such stream
            report["residual_scale"] = {"scale": cfg.residual_scale, **rescale_residual_stream(stream, cfg.residual_scale)}
    if cfg.attention:
        budget = None if cfg.attention_budget_mb is None else cfg.attention_budget_mb * 2**20
        names = swap_modules(module, lambda n, m: _is_diffusers_attention(m), lambda n, m: SplitAttention(m, budget, cfg.activation_bytes))
        report["attention"] = len(names)
    if cfg.clipped_gelu:
        n_geglu = swap_modules(module, lambda n, m: type(m).__name__ == "GEGLU" and hasattr(m, "proj"), lambda n, m: ClippedGEGLU(m, cfg.gelu_clip))
        n_gelu_proj = swap_modules(
            module,
            lambda n, m: type(m).__name__ == "GELU" and hasattr(m, "proj") and not isinstance(m, nn.GELU),
            lambda n, m: ClippedGELU(cfg.gelu_clip, proj=m.proj),
        )
        n_gelu = swap_modules(module, lambda n, m: _is_gelu_activation(m), lambda n, m: ClippedGELU(cfg.gelu_clip))
        report["clipped_gelu"] = len(n_geglu) + len(n_gelu_proj) + len(n_gelu)
    if cfg.group_norm:
        names = swap_modules(module, lambda n, m: isinstance(m, nn.GroupNorm), lambda n, m: RankFourGroupNorm(m, cfg.group_norm_fp16_safe))
        report["group_norm"] = len(names)
    if cfg.linear_to_conv:
        names = swap_modules(module, lambda n, m: isinstance(m, nn.Linear), lambda n, m: Conv1x1Linear(m, n))
        report["linear_to_conv"] = len(names)
    if cfg.conv_budget_mb is not None:
        if sample_inputs is None:
            raise PocketdiffError("conv serialization needs sample inputs to measure activations")
        budget_elems = int(cfg.conv_budget_mb * 2**20 // cfg.activation_bytes)
        shapes = record_conv_shapes(module, sample_inputs)
        inputs_only = cfg.conv_budget_scope == "input"
        plan: dict[str, tuple[int, int]] = {}
        for name, (ishape, oshape) in shapes.items():
            in_elems, out_elems = _numel(ishape), _numel(oshape)
            if (in_elems if inputs_only else max(in_elems, out_elems)) <= budget_elems:
                continue
            split = choose_conv_split(in_elems, out_elems, ishape[1], oshape[1], budget_elems, cfg.conv_split,
                                      bound_output=not inputs_only)
            if split is None:
                one_in = in_elems // max(1, ishape[1])
                smallest = (one_in if inputs_only else max(one_in, out_elems // max(1, oshape[1]))) * cfg.activation_bytes / 2**20
                raise PocketdiffError(
                    f"conv {name}: activations {ishape} -> {oshape} cannot be split under rewrites.conv_budget_mb={cfg.conv_budget_mb} "
                    f"(conv_budget_scope {cfg.conv_budget_scope}; the smallest reachable piece, one channel, is {smallest:.3g} MB)"
                )
            plan[name] = split
        swap_modules(module, lambda n, m: n in plan, lambda n, m: SerializedConv2d(m, *plan[n], name=n))
        report["serialized_convs"] = {n: list(s) for n, s in plan.items()}
    if cfg.conv_lowering != "none":
        if applies_to(component, cfg.conv_lowering_components):
            report["conv_lowering"] = {"mode": cfg.conv_lowering, **lower_convs(module, cfg.conv_lowering_strided)}
    return report


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def attention_chunk_report(module: nn.Module) -> dict[str, int]:
    """name -> query chunks used in the last forward, for chunked SplitAttention modules."""
    return {n: m.last_chunks for n, m in module.named_modules() if isinstance(m, SplitAttention) and m.last_chunks > 1}
