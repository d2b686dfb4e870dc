"""Device profiles: the memory budgets a phone GPU imposes, checked on every exported graph.

No delegate here reproduces a phone's limits (DESIGN.md), so the exporter measures each
.tflite against stated budgets instead: the largest single activation tensor, and the
activations one op touches (its non-constant inputs + outputs), both at the device's
activation width (fp16: 2 bytes). The export report lists each component's largest tensor
and heaviest op against the profile; `enforce: true` fails the export naming the component,
the tensor / op and its size.

"phone" (the default of configs/sd21/export.yaml), with its sources:
- op_activation_mb 3.5: Choi et al. (2023) saw the Galaxy S23 GPU delegate fail on a 3x3 conv
  at 32x32 with 1920 -> 640 channels, whose input alone is 32*32*1920*2 B = 3.75 MB, and on a
  FULLY_CONNECTED over 1x4096x320 (2.5 MB in + 2.5 MB out); they serialized such ops. The
  budget sits just under the smallest failing op input they report.
- max_tensor_mb 64: the largest tensor we have seen run on the delegate at 512 px is a 64 MB
  attention-map chunk (rewrites.attention_budget_mb 64, H200 Vulkan); no phone figure is
  published for it, so it is our bound, not a measured phone limit.
Tiling the VAE decoder (export/tiled_decode.py) and the conv / attention budgets of
`rewrites` are the tools that bring a graph under the budgets.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np

from pocketdiff.errors import PocketdiffError, require

# ops whose large activation inputs Choi et al. saw fail on the Galaxy S23 delegate, and the input
# size of their failing conv (32 x 32 x 1920 at fp16); reported per component beside the budgets
CONV_LIKE = ("CONV_2D", "DEPTHWISE_CONV_2D", "TRANSPOSE_CONV", "FULLY_CONNECTED")
CHOI_FAILING_CONV_INPUT_BYTES = 32 * 32 * 1920 * 2

PROFILES = {
    "none": {"max_tensor_mb": None, "op_activation_mb": None},
    "phone": {"max_tensor_mb": 64.0, "op_activation_mb": 3.5},
}


@dataclasses.dataclass
class DeviceProfile:
    name: str = "none"  # none | phone (budgets below override the named profile's)
    max_tensor_mb: Optional[float] = None
    op_activation_mb: Optional[float] = None
    activation_bytes: int = 2
    enforce: bool = False  # fail the export when a component is over budget (else: report)

    def __post_init__(self) -> None:
        require(self.name in PROFILES, "device_profile.name", f"must be one of {sorted(PROFILES)}, got {self.name!r}")
        for k in ("max_tensor_mb", "op_activation_mb"):
            v = getattr(self, k)
            require(v is None or v > 0, f"device_profile.{k}", "must be positive or null")

    def budgets(self) -> dict:
        base = dict(PROFILES[self.name])
        for k in base:
            if getattr(self, k) is not None:
                base[k] = getattr(self, k)
        return base


def graph_memory(path: str | Path, activation_bytes: int = 2) -> dict:
    """Largest non-constant tensor and heaviest op (non-constant inputs + outputs) of a .tflite; and,
    for conv-like ops, the largest activation input and how many convs take an input at least as
    large as Choi et al.'s failing one (what `rewrites.conv_budget_mb` serializes)."""
    from .delegate import module_from_location
    from .tflite_file import TfliteModel

    m = TfliteModel(path)
    g = m.graph
    # weights stored as int8 / fp16 are DEQUANTIZE outputs: constants too, not activations
    dequantized = {int(op.outputs[0]) for op in g.operators or [] if m.op_name(op) == "DEQUANTIZE" and m.is_constant(int(op.inputs[0]))}
    sizes = {}
    for i, t in enumerate(g.tensors):
        if t.shape is None or m.is_constant(i) or i in dequantized:
            continue
        sizes[i] = int(np.prod([int(s) for s in t.shape])) if len(t.shape) else 1
    big = max(sizes, key=sizes.get) if sizes else None
    heavy, heavy_n, conv, conv_n, convs_over = None, 0, None, 0, 0
    for op in g.operators or []:
        ins = [int(i) for i in (op.inputs if op.inputs is not None else []) if int(i) >= 0]
        ids = ins + [int(i) for i in (op.outputs if op.outputs is not None else []) if int(i) >= 0]
        n = sum(sizes.get(i, 0) for i in ids)
        if n > heavy_n:
            heavy, heavy_n = op, n
        if m.op_name(op) in CONV_LIKE:
            x = max((sizes.get(i, 0) for i in ins), default=0)
            convs_over += x * activation_bytes > CHOI_FAILING_CONV_INPUT_BYTES
            if x > conv_n:
                conv, conv_n = op, x
    mb = activation_bytes / 2**20
    return {
        # the figure Choi et al.'s failing conv is stated in (its input alone), for conv-like ops
        "largest_conv_input_mb": round(conv_n * mb, 3),
        "largest_conv_input": (m.op_name(conv) + " " + module_from_location(m.tensor_name(int(conv.outputs[0])))) if conv is not None else "",
        "convs_over_choi_failing_input": int(convs_over),
        "largest_tensor_mb": round(sizes[big] * mb, 3) if big is not None else 0.0,
        "largest_tensor": module_from_location(m.tensor_name(big)) if big is not None else "",
        "largest_tensor_shape": [int(s) for s in g.tensors[big].shape] if big is not None else [],
        "heaviest_op_mb": round(heavy_n * mb, 3),
        "heaviest_op": (m.op_name(heavy) + " " + module_from_location(m.tensor_name(int(heavy.outputs[0])))) if heavy is not None else "",
    }


def check_component(name: str, path: str | Path, profile: DeviceProfile) -> dict:
    """`graph_memory` against the profile's budgets; raises when enforced and over."""
    mem = graph_memory(path, profile.activation_bytes)
    b = profile.budgets()
    over = []
    if b["max_tensor_mb"] is not None and mem["largest_tensor_mb"] > b["max_tensor_mb"]:
        over.append(f"largest tensor {mem['largest_tensor_mb']:.1f} MB ({mem['largest_tensor']} {mem['largest_tensor_shape']}) "
                    f"> device_profile.max_tensor_mb={b['max_tensor_mb']}")
    if b["op_activation_mb"] is not None and mem["heaviest_op_mb"] > b["op_activation_mb"]:
        over.append(f"op {mem['heaviest_op']} touches {mem['heaviest_op_mb']:.1f} MB > device_profile.op_activation_mb={b['op_activation_mb']}")
    mem.update(profile=profile.name, budgets=b, over_budget=over)
    if over and profile.enforce:
        raise PocketdiffError(f"{name}: over the {profile.name!r} device profile: " + "; ".join(over))
    return mem
