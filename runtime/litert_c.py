"""A .tflite on the LiteRT GPU accelerator through LiteRT's C API (ctypes on the wheel's libLiteRt.so).

Why not `ai_edge_litert.compiled_model.CompiledModel`: its `GpuOptions` (ai-edge-litert 2.3) exposes six
switches, while the accelerator reads many more from its options payload, a TOML string under the
identifier "gpu_options" (LiteRT's opaque options: `litert/c/options/litert_gpu_options.cc` serializes
them, the accelerator parses them). The ones that matter on a phone are there: a serialization folder
and model cache key with `serialize_program_cache` (compiled GPU programs kept between launches),
`serialize_external_tensors` (the converted weights kept too), `madvise_original_shared_tensors` (the
file's weight pages given back once uploaded), `convert_weights_on_gpu`. This module builds that
payload and drives the same C functions the Python wrapper calls: environment, model from file,
options, compiled model, managed tensor buffers, run.

Only numpy and ctypes. The library is chosen per process: by default the ai-edge-litert wheel's own
(`ai_edge_litert/libLiteRt.so`, which loads `libLiteRtWebGpuAccelerator.so` from the folder named as the runtime
library dir); for the accelerator's weight cache (run-bundle --weight-cache) litert-lm-api's `litert_lm/liblitert-lm.so`,
LiteRT's C API and the WebGPU accelerator linked into one build (`pip install 'pocketdiff[gpu-cache]'`; the wheels'
separate accelerator crashes on the constant-tensor-sharing path the weight cache needs: benchmarks/weight_cache_repro.py).
One library per process: asking for the other once one is loaded is refused (`LiteRtLibrary.shared`). Options carrying
gpu_cache.TRIAL_OPTION (the weight cache's first compile of a model) compile in a child process first, since that
library aborts the process on some graphs (runtime/sharing_trial.py).
"""
from __future__ import annotations

import ctypes as C
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from pocketdiff.errors import PocketdiffError

MAX_RANK = 8
HW_CPU, HW_GPU = 1 << 0, 1 << 1
LOCK_READ, LOCK_WRITE = 0, 1
ENV_RUNTIME_LIBRARY_DIR = 22
ANY_STRING = 8
# LiteRtElementType -> numpy
ELEMENT_TYPES = {1: np.float32, 2: np.int32, 3: np.uint8, 4: np.int64, 6: np.bool_, 7: np.int16, 9: np.int8, 10: np.float16}
# keys the accelerator's TOML parser takes (ai-edge-litert 2.3's libLiteRtWebGpuAccelerator.so holds each name)
GPU_OPTION_KEYS = {
    "precision": int, "serialization_dir": str, "model_cache_key": str, "serialize_program_cache": bool,
    "serialize_external_tensors": bool, "madvise_original_shared_tensors": bool, "convert_weights_on_gpu": bool,
    "wait_for_weights_conversion_complete": bool, "hint_fully_delegated_to_single_delegate": bool,
    "num_threads_to_upload": int, "prefer_texture_weights": bool, "num_threads_to_compile": int, "disable_shader_optimization": bool,
    "cache_only_compiled_programs": bool, "enable_constant_tensors_sharing": bool,
    "allow_src_quantized_fc_conv_ops": bool, "enable_infinite_float_capping": bool, "benchmark_mode": bool,
}
PRECISION = {"default": 0, "fp16": 1, "fp32": 2}


class _Layout(C.Structure):
    _fields_ = [("rank_bits", C.c_uint32), ("dimensions", C.c_int32 * MAX_RANK), ("strides", C.c_uint32 * MAX_RANK)]


class _RankedTensorType(C.Structure):
    _fields_ = [("element_type", C.c_int), ("layout", _Layout)]


class _Any(C.Structure):
    _fields_ = [("type", C.c_int), ("value", C.c_void_p)]  # the union is 8 bytes at offset 8


class _EnvOption(C.Structure):
    _fields_ = [("tag", C.c_int), ("value", _Any)]


_DESTRUCTOR = C.CFUNCTYPE(None, C.c_void_p)
_KEEP_PAYLOAD = _DESTRUCTOR(lambda _ptr: None)  # the payload buffer is Python's: freed with the model object


assert C.sizeof(_Layout) == 68 and C.sizeof(_RankedTensorType) == 72 and C.sizeof(_EnvOption) == 24


def gpu_options_toml(options: dict) -> str:
    """The accelerator's "gpu_options" payload; an unknown key or a wrong type is refused by name."""
    lines = []
    for key, value in options.items():
        kind = GPU_OPTION_KEYS.get(key)
        if kind is None:
            raise PocketdiffError(f"gpu option {key!r} is not one the accelerator reads (known: {sorted(GPU_OPTION_KEYS)})")
        if key == "precision" and isinstance(value, str):
            if value not in PRECISION and not value.isdigit():
                raise PocketdiffError(f"gpu option precision: expected one of {sorted(PRECISION)}, got {value!r}")
            value = PRECISION.get(value, int(value) if value.isdigit() else 0)
        if kind is bool:
            if not isinstance(value, bool):
                raise PocketdiffError(f"gpu option {key}: expected true/false, got {value!r}")
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise PocketdiffError(f"gpu option {key}: expected an integer, got {value!r}")
            lines.append(f"{key} = {value}")
        else:
            if '"' in str(value) or "\n" in str(value):
                raise PocketdiffError(f"gpu option {key}: quotes and newlines are not allowed, got {value!r}")
            lines.append(f'{key} = "{value}"')
    return "\n".join(lines) + ("\n" if lines else "")


def parse_gpu_option(text: str) -> tuple[str, object]:
    """`KEY=VALUE` (run-bundle --gpu-option) -> (key, typed value); refused by name when unknown or mistyped."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    kind = GPU_OPTION_KEYS.get(key)
    if not sep or kind is None:
        raise PocketdiffError(f"--gpu-option {text!r}: expected KEY=VALUE with KEY one of {sorted(GPU_OPTION_KEYS)}")
    raw = raw.strip()
    if kind is bool:
        if raw.lower() not in ("true", "false"):
            raise PocketdiffError(f"--gpu-option {key}: expected true or false, got {raw!r}")
        return key, raw.lower() == "true"
    if kind is int and key != "precision":
        try:
            return key, int(raw)
        except ValueError:
            raise PocketdiffError(f"--gpu-option {key}: expected an integer, got {raw!r}") from None
    return key, raw


DEFAULT_LIBRARY = "ai-edge-litert"  # the wheel's libLiteRt.so + libLiteRtWebGpuAccelerator.so
SINGLE_BUILD = "litert-lm"  # litert-lm-api's liblitert-lm.so: C API and accelerator in one build (the weight cache)
SINGLE_BUILD_FILE = "liblitert-lm.so"
SINGLE_BUILD_ENV = "POCKETDIFF_LITERT_LM_LIB"  # a path to such a library instead of the installed litert_lm's
GPU_CACHE_EXTRA = "pip install 'pocketdiff[gpu-cache]'"


def _library_dir() -> Path:
    import ai_edge_litert

    return Path(ai_edge_litert.__file__).resolve().parent


def single_build_path() -> Path:
    """litert-lm-api's liblitert-lm.so: $POCKETDIFF_LITERT_LM_LIB, else found in the installed `litert_lm` package
    (located, not imported); a one-line PocketdiffError naming the pip extra when there is none."""
    override = os.environ.get(SINGLE_BUILD_ENV)
    if override:
        if not Path(override).is_file():
            raise PocketdiffError(f"{SINGLE_BUILD_ENV}={override}: not a file (expected a {SINGLE_BUILD_FILE})")
        return Path(override).resolve()
    try:
        spec = importlib.util.find_spec("litert_lm")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(folder) / SINGLE_BUILD_FILE).is_file():
            return (Path(folder) / SINGLE_BUILD_FILE).resolve()
    raise PocketdiffError(f"the GPU weight cache needs litert-lm-api's {SINGLE_BUILD_FILE} (LiteRT's C API and GPU "
                          f"accelerator in one build), which is not installed: {GPU_CACHE_EXTRA}")


class LiteRtLibrary:
    """The C functions, with argument types; one library per process (`shared(which)`)."""

    _shared: Optional["LiteRtLibrary"] = None

    @classmethod
    def shared(cls, which: Optional[str] = None) -> "LiteRtLibrary":
        """This process's library: WHICH (DEFAULT_LIBRARY or SINGLE_BUILD) loaded at the first call; None: the one
        loaded already, else the default. Asking for the other one once one is loaded is refused."""
        if which not in (None, DEFAULT_LIBRARY, SINGLE_BUILD):
            raise PocketdiffError(f"LiteRT library {which!r}: expected {DEFAULT_LIBRARY!r} or {SINGLE_BUILD!r}")
        if cls._shared is None:
            if which == SINGLE_BUILD:
                path = single_build_path()
                cls._shared = cls(path.parent, path.name, SINGLE_BUILD)
            else:
                cls._shared = cls(_library_dir())
        elif which is not None and cls._shared.which != which:
            why = "the GPU weight cache" if which == SINGLE_BUILD else "a run without the weight cache asked for it"
            raise PocketdiffError(f"this process loaded LiteRT's C API from {cls._shared.which} ({cls._shared.path}); "
                                  f"{which} ({why}) cannot be loaded beside it: one LiteRT library per process, start "
                                  "another process (or pass the same weight-cache choice)")
        return cls._shared

    def __init__(self, folder: Path, file: str = "libLiteRt.so", which: str = DEFAULT_LIBRARY):
        self.folder, self.which = folder, which
        self.path = folder / file
        # the wheel's runtime is global (its accelerator library binds to it); the single build needs no such partner,
        # and kept local its TfLite symbols do not meet those of ai-edge-litert's Python modules (CPU models)
        self.lib = C.CDLL(str(self.path), mode=C.RTLD_GLOBAL if which == DEFAULT_LIBRARY else C.RTLD_LOCAL)
        P, I, S = C.c_void_p, C.c_int, C.c_size_t
        pp = C.POINTER(C.c_void_p)
        sigs = {
            "LiteRtCreateEnvironment": [I, C.POINTER(_EnvOption), pp],
            "LiteRtDestroyEnvironment": [P],
            "LiteRtCreateModelFromFile": [P, C.c_char_p, pp],
            "LiteRtDestroyModel": [P],
            "LiteRtCreateOptions": [pp],
            "LiteRtDestroyOptions": [P],
            "LiteRtSetOptionsHardwareAccelerators": [P, I],
            "LiteRtCreateOpaqueOptions": [C.c_char_p, P, P, pp],
            "LiteRtAddOpaqueOptions": [P, P],
            "LiteRtCreateCompiledModel": [P, P, P, pp],
            "LiteRtDestroyCompiledModel": [P],
            "LiteRtCompiledModelIsFullyAccelerated": [P, C.POINTER(C.c_bool)],
            "LiteRtGetNumModelSignatures": [P, C.POINTER(S)],
            "LiteRtGetModelSignature": [P, S, pp],
            "LiteRtGetSignatureKey": [P, C.POINTER(C.c_char_p)],
            "LiteRtGetNumSignatureInputs": [P, C.POINTER(S)],
            "LiteRtGetNumSignatureOutputs": [P, C.POINTER(S)],
            "LiteRtGetSignatureInputName": [P, S, C.POINTER(C.c_char_p)],
            "LiteRtGetSignatureOutputName": [P, S, C.POINTER(C.c_char_p)],
            "LiteRtGetSignatureInputTensorByIndex": [P, S, pp],
            "LiteRtGetSignatureOutputTensorByIndex": [P, S, pp],
            "LiteRtGetRankedTensorType": [P, C.POINTER(_RankedTensorType)],
            "LiteRtGetCompiledModelInputBufferRequirements": [P, S, S, pp],
            "LiteRtGetCompiledModelOutputBufferRequirements": [P, S, S, pp],
            "LiteRtCreateManagedTensorBufferFromRequirements": [P, C.POINTER(_RankedTensorType), P, pp],
            "LiteRtDestroyTensorBuffer": [P],
            "LiteRtLockTensorBuffer": [P, pp, I],
            "LiteRtUnlockTensorBuffer": [P],
            "LiteRtRunCompiledModel": [P, S, S, pp, S, pp],  # 2.3: with the buffer counts
        }
        for name, args in sigs.items():
            fn = getattr(self.lib, name)
            fn.argtypes = args
            fn.restype = None if name.startswith("LiteRtDestroy") else C.c_int

    def call(self, name: str, *args, what: str = "") -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise PocketdiffError(f"LiteRT {name} failed with status {status}{': ' + what if what else ''}")


class Environment:
    """One LiteRT environment (one GPU device) that every model of a runner shares."""

    def __init__(self, lib: Optional[LiteRtLibrary] = None, library: Optional[str] = None):
        self.lib = lib or LiteRtLibrary.shared(library)  # library: LiteRtLibrary.shared's choice
        self._dir = C.c_char_p(str(self.lib.folder).encode())
        opt = _EnvOption(ENV_RUNTIME_LIBRARY_DIR, _Any(ANY_STRING, C.cast(self._dir, C.c_void_p)))
        self.handle = C.c_void_p()
        self.lib.call("LiteRtCreateEnvironment", 1, C.byref(opt), C.byref(self.handle), what="environment")

    def close(self) -> None:
        if self.handle:
            self.lib.lib.LiteRtDestroyEnvironment(self.handle)
            self.handle = C.c_void_p()


@dataclass
class TensorSpec:
    name: str
    shape: tuple
    dtype: np.dtype


class CompiledModel:
    """A .tflite compiled for the GPU accelerator with a `gpu_options` dict (see GPU_OPTION_KEYS);
    signature 0; `run(feeds)` -> outputs in the signature's order."""

    def __init__(self, path: str | Path, env: Environment, gpu_options: Optional[dict] = None, accelerator: str = "gpu",
                 on_phase: Optional[Callable[[str], None]] = None):
        self.lib, self.env = env.lib, env
        L = self.lib
        self.path = str(path)
        self.model, self.options, self.compiled = C.c_void_p(), C.c_void_p(), C.c_void_p()
        self._payload = None
        self.in_bufs: list = []
        self.out_bufs: list = []
        from .gpu_cache import TRIAL_OPTION

        gpu_options = dict(gpu_options or {})
        trial = gpu_options.pop(TRIAL_OPTION, None)  # the weight cache's first compile of this model: a child's first
        if trial and accelerator == "gpu":
            from .sharing_trial import first_compile

            gpu_options = first_compile(self.path, gpu_options, trial, self.lib)
        try:
            L.call("LiteRtCreateModelFromFile", env.handle, self.path.encode(), C.byref(self.model), what=self.path)
            if on_phase:
                on_phase("opened")
            L.call("LiteRtCreateOptions", C.byref(self.options))
            L.call("LiteRtSetOptionsHardwareAccelerators", self.options, (HW_GPU | HW_CPU) if accelerator == "gpu" else HW_CPU)
            if accelerator == "gpu" and gpu_options:
                self._payload = C.create_string_buffer(gpu_options_toml(gpu_options).encode())
                opaque = C.c_void_p()
                L.call("LiteRtCreateOpaqueOptions", b"gpu_options", C.cast(self._payload, C.c_void_p),
                       C.cast(_KEEP_PAYLOAD, C.c_void_p), C.byref(opaque))
                L.call("LiteRtAddOpaqueOptions", self.options, opaque)  # the options own it from here
            L.call("LiteRtCreateCompiledModel", env.handle, self.model, self.options, C.byref(self.compiled), what=self.path)
            self.inputs, self.outputs = self._signature()
            self.in_bufs = [self._buffer(i, s, True) for i, s in enumerate(self.inputs)]
            self.out_bufs = [self._buffer(i, s, False) for i, s in enumerate(self.outputs)]
            if on_phase:
                on_phase("compiled")
        except BaseException:
            self.close()
            raise

    def _signature(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        L, S = self.lib, C.c_size_t
        sig = C.c_void_p()
        L.call("LiteRtGetModelSignature", self.model, 0, C.byref(sig))
        specs = []
        for kind in ("Input", "Output"):
            n = S()
            L.call(f"LiteRtGetNumSignature{kind}s", sig, C.byref(n))
            row = []
            for i in range(n.value):
                name, tensor, tt = C.c_char_p(), C.c_void_p(), _RankedTensorType()
                L.call(f"LiteRtGetSignature{kind}Name", sig, i, C.byref(name))
                L.call(f"LiteRtGetSignature{kind}TensorByIndex", sig, i, C.byref(tensor))
                L.call("LiteRtGetRankedTensorType", tensor, C.byref(tt))
                rank = tt.layout.rank_bits & 0x7F
                if tt.element_type not in ELEMENT_TYPES:
                    raise PocketdiffError(f"{self.path}: {kind.lower()} {name.value.decode()} has element type {tt.element_type}, not one the runner reads")
                row.append(TensorSpec(name.value.decode(), tuple(tt.layout.dimensions[:rank]), np.dtype(ELEMENT_TYPES[tt.element_type])))
            specs.append(row)
        return specs[0], specs[1]

    def _buffer(self, index: int, spec: TensorSpec, is_input: bool) -> C.c_void_p:
        L = self.lib
        req, buf, tt = C.c_void_p(), C.c_void_p(), _RankedTensorType()
        which = "Input" if is_input else "Output"
        L.call(f"LiteRtGetCompiledModel{which}BufferRequirements", self.compiled, 0, index, C.byref(req))
        tensor, sig = C.c_void_p(), C.c_void_p()
        L.call("LiteRtGetModelSignature", self.model, 0, C.byref(sig))
        L.call(f"LiteRtGetSignature{which}TensorByIndex", sig, index, C.byref(tensor))
        L.call("LiteRtGetRankedTensorType", tensor, C.byref(tt))
        L.call("LiteRtCreateManagedTensorBufferFromRequirements", self.env.handle, C.byref(tt), req, C.byref(buf), what=spec.name)
        return buf

    def fully_accelerated(self) -> bool:
        flag = C.c_bool(False)
        self.lib.call("LiteRtCompiledModelIsFullyAccelerated", self.compiled, C.byref(flag))
        return bool(flag.value)

    def _host(self, buf, mode: int) -> int:
        addr = C.c_void_p()
        self.lib.call("LiteRtLockTensorBuffer", buf, C.byref(addr), mode, what=self.path)
        return addr.value

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        """Inputs in the signature's order (shapes and dtypes as `inputs` says) -> outputs likewise."""
        if len(feeds) != len(self.inputs):
            raise PocketdiffError(f"{self.path}: {len(feeds)} inputs given, the model takes {len(self.inputs)}")
        for buf, spec, arr in zip(self.in_bufs, self.inputs, feeds):
            arr = np.ascontiguousarray(arr, dtype=spec.dtype)
            if arr.shape != spec.shape:
                raise PocketdiffError(f"{self.path}: input {spec.name} has shape {list(arr.shape)}, the model takes {list(spec.shape)}")
            C.memmove(self._host(buf, LOCK_WRITE), arr.ctypes.data, arr.nbytes)
            self.lib.call("LiteRtUnlockTensorBuffer", buf)
        ins = (C.c_void_p * len(self.in_bufs))(*[b.value for b in self.in_bufs])
        outs = (C.c_void_p * len(self.out_bufs))(*[b.value for b in self.out_bufs])
        self.lib.call("LiteRtRunCompiledModel", self.compiled, 0, len(self.in_bufs), ins, len(self.out_bufs), outs, what=self.path)
        results = []
        for buf, spec in zip(self.out_bufs, self.outputs):
            arr = np.empty(spec.shape, spec.dtype)
            C.memmove(arr.ctypes.data, self._host(buf, LOCK_READ), arr.nbytes)
            self.lib.call("LiteRtUnlockTensorBuffer", buf)
            results.append(arr)
        return results

    def close(self) -> None:
        lib = self.lib.lib
        for buf in self.in_bufs + self.out_bufs:
            lib.LiteRtDestroyTensorBuffer(buf)
        self.in_bufs, self.out_bufs = [], []
        if self.compiled:
            lib.LiteRtDestroyCompiledModel(self.compiled)
            self.compiled = C.c_void_p()
        if self.options:
            lib.LiteRtDestroyOptions(self.options)
            self.options = C.c_void_p()
        if self.model:
            lib.LiteRtDestroyModel(self.model)
            self.model = C.c_void_p()
        self._payload = None
