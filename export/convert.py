"""torch module -> .tflite through litert-torch, then the weight storage we choose.

litert-torch writes fp32 constants. `store_weights` rewrites them in the flatbuffer:
fp16 storage (DEQUANTIZE to fp32 in the graph, TFLite's float16 format) or int8 codes taken
verbatim from the quantized checkpoint (per-output-channel scales, DEQUANTIZE in the graph),
so the file carries exactly the codes the PTQ produced.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from pocketdiff.errors import PocketdiffError

from .tflite_file import TfliteWeightRewriter

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("fp32", "fp16", "int8")


@contextlib.contextmanager
def _quiet_native_stderr(enabled: bool = True):
    """Silence the converter's C++ logging on fd 2 (kept when conversion fails)."""
    if not enabled:
        yield
        return
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if not ok:
                tmp.seek(0)
                tail = tmp.read()[-4000:].decode(errors="replace")
                log.error("converter output:\n%s", tail)


@contextlib.contextmanager
def converter_quiet(quiet: bool = True):
    """Around a litert-torch conversion: no autograd, its native logs and stdout chatter held back
    (kept when it fails), and torch's own deprecation inside its export (nothing a user can act
    on) not shown."""
    with torch.no_grad(), _quiet_native_stderr(quiet), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
        yield


def to_tflite(module: nn.Module, sample_inputs: Sequence[torch.Tensor], path: Path, quiet: bool = True) -> float:
    """Convert with litert-torch (fp32 weights). Returns the wall time in seconds."""
    import litert_torch

    module = module.eval()
    t0 = time.perf_counter()
    with converter_quiet(quiet):
        edge = litert_torch.convert(module, tuple(sample_inputs))
        edge.export(str(path))
    return time.perf_counter() - t0


@dataclasses.dataclass
class Int8Piece:
    """One quantized weight as it appears in the converted torch module.

    `codes` int8 and `scale` float32 [out] in the module's own layout (Conv2d [O, I, kh, kw],
    Linear [O, I]); `layer` names the checkpoint layer, `rows`/`cols` the slice of it this
    piece holds (serialized convolutions split a layer into pieces)."""

    layer: str
    codes: torch.Tensor
    scale: torch.Tensor
    rows: Optional[tuple[int, int]] = None
    cols: Optional[tuple[int, int]] = None
    scale_factor: float = 1.0  # `scale` already includes this factor (residual rescaling)
    tap: Optional[tuple[int, int]] = None  # (dy, dx): a 1x1 tap of a lowered kxk conv, codes = layer codes[rows, cols, dy, dx]

    def float_weight(self) -> np.ndarray:
        shape = [self.codes.shape[0]] + [1] * (self.codes.dim() - 1)
        return (self.codes.float() * self.scale.float().reshape(shape)).numpy()


def _layouts(arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The ways litert-torch may lay a torch weight out in the flatbuffer."""
    out = [("same", arr)]
    if arr.ndim == 4:
        out.append(("ohwi", arr.transpose(0, 2, 3, 1)))
    if arr.ndim == 2:
        out.append(("o11i", arr.reshape(arr.shape[0], 1, 1, arr.shape[1])))
    return out


def _key(arr: np.ndarray) -> tuple:
    a = np.ascontiguousarray(arr, dtype=np.float32)
    return (tuple(a.shape), hashlib.sha1(a.tobytes()).hexdigest())


def _apply_layout(codes: np.ndarray, layout: str) -> np.ndarray:
    if layout == "ohwi":
        return codes.transpose(0, 2, 3, 1)
    if layout == "o11i":
        return codes.reshape(codes.shape[0], 1, 1, codes.shape[1])
    return codes


def _channel_factor(expected: np.ndarray, actual: np.ndarray, rtol: float = 1e-5) -> Optional[np.ndarray]:
    """Per-output-channel f with actual == f * expected (to fp32 rounding), else None."""
    if expected.shape != actual.shape:
        return None
    e = expected.reshape(expected.shape[0], -1).astype(np.float64)
    a = actual.reshape(actual.shape[0], -1).astype(np.float64)
    if np.any((e == 0) != (a == 0)):
        return None
    f = np.ones(e.shape[0])
    for row in range(e.shape[0]):
        nz = e[row] != 0
        if not nz.any():
            continue
        r = a[row, nz] / e[row, nz]
        med = float(np.median(r))
        if med == 0 or not np.all(np.abs(r - med) <= rtol * abs(med) + 1e-30):
            return None
        f[row] = med
    return f


def store_weights(
    src: Path,
    dst: Path,
    weights: str,
    int8_pieces: Sequence[Int8Piece] = (),
    float_storage: str = "fp16",
) -> dict:
    """Rewrite the constants of `src` (litert-torch fp32 output) into `dst`.

    weights="fp32": copy; "fp16": every weight fp16; "int8": the given pieces as int8 codes,
    the remaining float constants stored as `float_storage` (fp16 or fp32). Raises
    PocketdiffError naming the layer when a quantized weight cannot be found in the graph.
    """
    if weights not in WEIGHT_FORMATS:
        raise PocketdiffError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    model = TfliteWeightRewriter(src)
    info: dict = {"int8_tensors": 0, "fp16_tensors": 0, "int8_map": {}}
    if weights == "int8":
        if not int8_pieces:
            raise PocketdiffError("int8 export: no quantized layers to carry (is the checkpoint for this component empty?)")
        wanted: dict[tuple, list[tuple[int, str]]] = {}
        for i, piece in enumerate(int8_pieces):
            for layout, arr in _layouts(piece.float_weight()):
                wanted.setdefault(_key(arr), []).append((i, layout))
        found: dict[int, list[tuple[int, str]]] = {}
        for t in model.weight_tensors():
            data = model.tensor_data(t)
            hits = wanted.get(_key(data))
            if not hits:
                continue
            for i, layout in hits:
                if list(_apply_layout(int8_pieces[i].codes.numpy(), layout).shape) == list(data.shape):
                    found.setdefault(i, []).append((t, layout))
                    break
        # The converter may fold a constant multiplier into a weight (the attention scale into
        # to_q / to_k): match those up to a per-output-channel factor, carry the codes unchanged
        # and put the factor into the int8 scale.
        factors: dict[int, np.ndarray] = {}
        unmatched = [i for i in range(len(int8_pieces)) if i not in found]
        if unmatched:
            taken = {t for hits in found.values() for t, _ in hits}
            by_shape: dict[tuple, list[int]] = {}
            for t in model.weight_tensors():
                if t not in taken:
                    by_shape.setdefault(tuple(int(s) for s in model.graph.tensors[t].shape), []).append(t)
            for i in unmatched:
                piece = int8_pieces[i]
                for layout, arr in _layouts(piece.float_weight()):
                    for t in by_shape.get(tuple(arr.shape), []):
                        if t in taken:
                            continue
                        f = _channel_factor(arr, model.tensor_data(t))
                        if f is not None:
                            found[i] = [(t, layout)]
                            factors[i] = f
                            taken.add(t)
                            break
                    if i in found:
                        break
        missing = [int8_pieces[i].layer for i in range(len(int8_pieces)) if i not in found]
        if missing:
            raise PocketdiffError(
                f"int8 export: the weights of {len(missing)} quantized layer(s) were not found in the converted "
                f"graph (the converter transformed them): {', '.join(missing[:8])}"
            )
        model.begin_edit()
        done = set()
        for i, hits in found.items():
            piece = int8_pieces[i]
            for t, layout in hits:
                if t in done:
                    continue
                done.add(t)
                codes = np.ascontiguousarray(_apply_layout(piece.codes.numpy(), layout))
                scale = piece.scale.numpy().astype(np.float32)
                factor = factors.get(i)
                if factor is not None:
                    scale = (scale.astype(np.float64) * factor).astype(np.float32)
                new_index = model.store_int8(t, codes, scale, axis=0)
                info["int8_map"].setdefault(piece.layer, []).append(
                    {
                        "tensor": model.tensor_name(new_index),
                        "layout": layout,
                        "rows": piece.rows,
                        "cols": piece.cols,
                        "scale_factor": (1.0 if factor is None else float(np.median(factor))) * piece.scale_factor,
                        **({} if piece.tap is None else {"tap": list(piece.tap)}),
                    }
                )
        model.end_edit()
        info["int8_tensors"] = len(done)
        if float_storage == "fp16":
            int8_float_outputs = {int(op.outputs[0]) for op in model.graph.operators if model.op_name(op) == "DEQUANTIZE"}
            info["fp16_tensors"] = model.store_weights_fp16(exclude=int8_float_outputs)
    elif weights == "fp16":
        info["fp16_tensors"] = model.store_weights_fp16()
    model.save(dst)
    return info
