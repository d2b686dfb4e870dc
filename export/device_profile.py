"""Device profiles: the memory budgets a phone GPU imposes, checked on every exported graph.

No delegate here reproduces a phone's limits (LiteRT's WebGPU delegate is not a phone's OpenCL one), so the exporter measures each
.tflite against stated budgets instead, at the device's activation width (fp16: 2 bytes):
the largest single activation tensor, and the largest activation input of a conv-like op
(the quantity the cited failures are stated in). The export report lists each component's
figures against the profile, and its heaviest op (non-constant inputs + outputs) for
information; `enforce: true` fails the export naming the component, the tensor / op and its size.

"phone" (the default of configs/sd21/export*.yaml), with its sources:
- conv_input_mb 3.5: Choi et al. (2023) saw the Galaxy S23 GPU delegate fail on a 3x3 conv
  at 32x32 with 1920 -> 640 channels, whose input alone is 32*32*1920*2 B = 3.75 MB, and
  serialized such convs. The budget sits just under that input. `rewrites.conv_budget_mb` with
  `conv_budget_scope: input` splits every conv's input channels to meet it.
- fc_input_mb 2.0: they also saw a FULLY_CONNECTED over 1x4096x320 fail (2.5 MB input) and
  replaced such ops by 1x1 convs, as `rewrites.linear_to_conv` does; the budget sits under it.
- max_tensor_mb 64: the largest tensor we have seen run on the delegate at 512 px is a 64 MB
  attention-map chunk (rewrites.attention_budget_mb 64, H200 Vulkan); no phone figure is
  published for it, so it is our bound, not a measured phone limit.
Not a budget: the activations one op touches in all. An earlier profile capped them at 3.5 MB
for every op, which no SD UNet meets (a 64x64x320 fp16 add touches 7.5 MB), Choi et al.'s
running one included; it is reported as `heaviest_op_mb` only.
Tiling the VAE decoder (runtime/tiled_decode.py) and the conv / attention budgets of
`rewrites` are the tools that bring a graph under the budgets.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np

from pocketdiff.errors import PocketdiffError, require

# conv-like ops: their largest non-constant input is what conv_input_mb bounds (FULLY_CONNECTED: fc_input_mb)
CONV_LIKE = ("CONV_2D", "DEPTHWISE_CONV_2D", "TRANSPOSE_CONV", "FULLY_CONNECTED")
BUDGETS = ("max_tensor_mb", "conv_input_mb", "fc_input_mb")

PROFILES = {
    "none": {"max_tensor_mb": None, "conv_input_mb": None, "fc_input_mb": None},
    "phone": {"max_tensor_mb": 64.0, "conv_input_mb": 3.5, "fc_input_mb": 2.0},
}


@dataclasses.dataclass
class DeviceProfile:
    name: str = "none"  # none | phone (budgets below override the named profile's)
    max_tensor_mb: Optional[float] = None
    conv_input_mb: Optional[float] = None
    fc_input_mb: Optional[float] = None
    activation_bytes: int = 2
    enforce: bool = False  # fail the export when a component is over budget (else: report)

    def __post_init__(self) -> None:
        require(self.name in PROFILES, "device_profile.name", f"must be one of {sorted(PROFILES)}, got {self.name!r}")
        for k in BUDGETS:
            v = getattr(self, k)
            require(v is None or v > 0, f"device_profile.{k}", "must be positive or null")

    def budgets(self) -> dict:
        base = dict(PROFILES[self.name])
        for k in base:
            if getattr(self, k) is not None:
                base[k] = getattr(self, k)
        return base


def graph_memory(path: str | Path, activation_bytes: int = 2, conv_input_mb: float = PROFILES["phone"]["conv_input_mb"]) -> dict:
    """Largest non-constant tensor and heaviest op (non-constant inputs + outputs) of a .tflite;
    the largest activation input of a conv (CONV_2D, DEPTHWISE_CONV_2D, TRANSPOSE_CONV) and of a
    FULLY_CONNECTED; and how many convs take an input over `conv_input_mb` (default: the phone
    profile's), which `rewrites.conv_budget_mb` would serialize."""
    from pocketdiff.runtime.delegate import module_from_location
    from pocketdiff.runtime.tflite_file import TfliteModel

    m = TfliteModel(path)
    g = m.graph
    # weights stored as int8 / fp16 are DEQUANTIZE outputs: constants too, not activations
    dequantized = {int(op.outputs[0]) for op in g.operators or [] if m.op_name(op) == "DEQUANTIZE" and m.is_constant(int(op.inputs[0]))}
    sizes = {}
    for i, t in enumerate(g.tensors):
        if t.shape is None or m.is_constant(i) or i in dequantized:
            continue
        sizes[i] = int(np.prod([int(s) for s in t.shape])) if len(t.shape) else 1
    limit = conv_input_mb * 2**20
    big = max(sizes, key=sizes.get) if sizes else None
    heavy, heavy_n, convs_over = None, 0, 0
    largest = {"conv": (None, 0), "fc": (None, 0)}
    for op in g.operators or []:
        ins = [int(i) for i in (op.inputs if op.inputs is not None else []) if int(i) >= 0]
        ids = ins + [int(i) for i in (op.outputs if op.outputs is not None else []) if int(i) >= 0]
        n = sum(sizes.get(i, 0) for i in ids)
        if n > heavy_n:
            heavy, heavy_n = op, n
        kind = m.op_name(op)
        if kind in CONV_LIKE:
            x = max((sizes.get(i, 0) for i in ins), default=0)
            key = "fc" if kind == "FULLY_CONNECTED" else "conv"
            convs_over += key == "conv" and x * activation_bytes > limit
            if x > largest[key][1]:
                largest[key] = (op, x)
    mb = activation_bytes / 2**20

    def where(op) -> str:
        return (m.op_name(op) + " " + module_from_location(m.tensor_name(int(op.outputs[0])))) if op is not None else ""

    return {
        "largest_conv_input_mb": round(largest["conv"][1] * mb, 3),
        "largest_conv_input": where(largest["conv"][0]),
        "convs_over_conv_input_mb": int(convs_over),
        "largest_fc_input_mb": round(largest["fc"][1] * mb, 3),
        "largest_fc_input": where(largest["fc"][0]),
        "largest_tensor_mb": round(sizes[big] * mb, 3) if big is not None else 0.0,
        "largest_tensor": module_from_location(m.tensor_name(big)) if big is not None else "",
        "largest_tensor_shape": [int(s) for s in g.tensors[big].shape] if big is not None else [],
        "heaviest_op_mb": round(heavy_n * mb, 3),  # information, not a budget (module docstring)
        "heaviest_op": where(heavy),
    }


def check_component(name: str, path: str | Path, profile: DeviceProfile) -> dict:
    """`graph_memory` against the profile's budgets; raises when enforced and over."""
    b = profile.budgets()
    mem = graph_memory(path, profile.activation_bytes, b["conv_input_mb"] or PROFILES["phone"]["conv_input_mb"])
    over = []
    if b["max_tensor_mb"] is not None and mem["largest_tensor_mb"] > b["max_tensor_mb"]:
        over.append(f"largest tensor {mem['largest_tensor_mb']:.1f} MB ({mem['largest_tensor']} {mem['largest_tensor_shape']}) "
                    f"> device_profile.max_tensor_mb={b['max_tensor_mb']}")
    if b["conv_input_mb"] is not None and mem["largest_conv_input_mb"] > b["conv_input_mb"]:
        over.append(f"{mem['convs_over_conv_input_mb']} conv(s) take an input over device_profile.conv_input_mb={b['conv_input_mb']}, "
                    f"the largest {mem['largest_conv_input_mb']:.2f} MB ({mem['largest_conv_input']}); "
                    "rewrites.conv_budget_mb with conv_budget_scope: input splits them")
    if b["fc_input_mb"] is not None and mem["largest_fc_input_mb"] > b["fc_input_mb"]:
        over.append(f"{mem['largest_fc_input']} takes a {mem['largest_fc_input_mb']:.2f} MB input > device_profile.fc_input_mb="
                    f"{b['fc_input_mb']} (rewrites.linear_to_conv makes it a 1x1 conv)")
    mem.update(profile=profile.name, budgets=b, over_budget=over)
    if over and profile.enforce:
        raise PocketdiffError(f"{name}: over the {profile.name!r} device profile: " + "; ".join(over))
    return mem
