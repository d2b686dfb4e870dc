"""Run a .tflite on the LiteRT GPU delegate (WebGPU over Vulkan) and report what it did.

The delegate is the judge of GPU compatibility (the TFLite analyzer's gpu_compatibility
check says "compatible" for every model). `run_on_delegate` compiles a model with `CompiledModel` + `HardwareAccelerator.GPU`,
records `is_fully_accelerated()`, the delegate's log of rejected ops (with its reasons and
the tensor locations, i.e. the torch modules they came from), and runs inference on fixed
inputs at the delegate's default precision (fp16) and with `GpuOptions(enforce_f32=True)`.

The Vulkan loader reads VK_ICD_FILENAMES / LD_LIBRARY_PATH when the delegate library is
loaded, so each run happens in a child process (`python -m pocketdiff.runtime._delegate_worker`)
started with `delegate_env()`: on a machine with an NVIDIA driver the system's Vulkan driver,
else the Mesa lavapipe unpacked by `scripts/setup_vulkan.sh` into `<repo>/.vulkan/`. A child
process also isolates crashes (models carrying STABLEHLO_COMPOSITE segfault the delegate).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from pocketdiff.errors import PocketdiffError

PRECISIONS = ("fp16", "fp32")
LAVAPIPE_PERF = "nopt"  # GALLIVM_PERF for lavapipe: skip LLVM's optimisation passes (see delegate_env)
_SETUP_HINT = "run `bash scripts/setup_vulkan.sh` (Mesa lavapipe into .vulkan/) or install a Vulkan GPU driver"


# --------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------

def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def vulkan_dir() -> Path:
    return Path(os.environ.get("POCKETDIFF_VULKAN_DIR", repo_root() / ".vulkan"))


_SYSTEM_ICD_DIRS = ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d")


def _nvidia_icds() -> list[str]:
    found = []
    for d in _SYSTEM_ICD_DIRS:
        p = Path(d)
        if p.is_dir():
            found += [str(f) for f in sorted(p.glob("nvidia*.json"))]
    return found


def has_nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or bool(_nvidia_icds())


def _system_has_libvulkan() -> bool:
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu"):
        if Path(d, "libvulkan.so.1").exists():
            return True
    return False


def _lavapipe_libdir(vk: Path) -> str:
    """The unpacked Mesa library folder (found again if .vulkan/ was moved or copied)."""
    libdir_file = vk / "libdir"
    libdir = libdir_file.read_text().strip() if libdir_file.is_file() else ""
    if libdir and Path(libdir, "libvulkan.so.1").exists():
        return libdir
    for lvp in sorted((vk / "root").glob("**/libvulkan_lvp.so")) if (vk / "root").is_dir() else []:
        return str(lvp.parent)
    return libdir if libdir and Path(libdir).is_dir() else ""


def _lavapipe_icd(vk: Path, libdir: str) -> Optional[Path]:
    """vk/lvp_icd.json, rewritten when it points at a library that is not there any more."""
    icd = vk / "lvp_icd.json"
    if not libdir or not Path(libdir, "libvulkan_lvp.so").exists():
        return icd if icd.is_file() else None
    lib = str(Path(libdir, "libvulkan_lvp.so"))
    try:
        current = json.loads(icd.read_text())["ICD"]["library_path"] if icd.is_file() else None
    except (ValueError, KeyError, TypeError):
        current = None
    if current != lib:
        text = json.dumps({"file_format_version": "1.0.1", "ICD": {"library_path": lib, "api_version": "1.3.0"}}, indent=4)
        try:
            icd.write_text(text)
        except OSError:
            icd = Path(tempfile.gettempdir()) / f"pocketdiff_lvp_icd_{os.getuid()}.json"
            icd.write_text(text)
    return icd


def delegate_env(base: Optional[dict] = None, driver: Optional[str] = None) -> tuple[dict, str]:
    """(environment for a delegate child process, driver name).

    `driver`: "system" (the machine's Vulkan driver, e.g. NVIDIA), "lavapipe" (the project's
    unpacked Mesa), or None/"auto" (env POCKETDIFF_VULKAN, else system when an NVIDIA driver is
    present, else lavapipe). Raises PocketdiffError when lavapipe is needed but missing.
    """
    env = dict(os.environ if base is None else base)
    driver = driver or os.environ.get("POCKETDIFF_VULKAN", "auto")
    if driver not in ("auto", "system", "lavapipe"):
        raise PocketdiffError(f"POCKETDIFF_VULKAN must be auto, system or lavapipe, got {driver!r}")
    if driver == "auto":
        driver = "system" if has_nvidia_driver() else "lavapipe"
    vk = vulkan_dir()
    libdir = _lavapipe_libdir(vk)
    if driver == "system":
        icds = _nvidia_icds()
        if icds and "VK_ICD_FILENAMES" not in env:
            env["VK_ICD_FILENAMES"] = os.pathsep.join(icds)
        if not _system_has_libvulkan() and libdir:  # loader only, from our unpacked libvulkan1
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
        return env, "system"
    icd = _lavapipe_icd(vk, libdir)
    if icd is None or not libdir:
        raise PocketdiffError(f"no Vulkan driver for the LiteRT GPU delegate: {icd} missing; {_SETUP_HINT}")
    env["VK_ICD_FILENAMES"] = str(icd)
    env.pop("VK_DRIVER_FILES", None)
    # lavapipe JIT-compiles every shader with LLVM on the CPU; without its optimisation passes
    # compiling takes about half the CPU time (tiny text encoder, cold shader cache: 22.7 -> 11.7 s)
    # and the check is the same (same delegate, ops and parity thresholds; the shaders only run
    # slower, which matters nowhere on an emulated GPU). Set GALLIVM_PERF yourself to override.
    env.setdefault("GALLIVM_PERF", LAVAPIPE_PERF)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    return env, "lavapipe"


def apply_delegate_env_in_process(driver: Optional[str] = None) -> str:
    """Set the Vulkan variables in this process (only useful before ai_edge_litert loads the
    GPU accelerator; LD_LIBRARY_PATH changes are not seen by the running dynamic loader, so
    this works only when the library dir is already on the path or the loader is system-wide)."""
    env, name = delegate_env(driver=driver)
    for key in ("VK_ICD_FILENAMES", "LD_LIBRARY_PATH"):
        if key in env:
            os.environ[key] = env[key]
    return name


# --------------------------------------------------------------------------------------
# Log parsing
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class RejectedOp:
    op: str
    reason: str
    location: str = ""  # tensor location as the converter wrote it (torch module stack)
    module: str = ""  # readable module path

    def describe(self) -> str:
        where = f" (from {self.module})" if self.module else ""
        return f"{self.op}: {self.reason}{where}"


_HEADER = "Following operations are not supported by GPU delegate:"
_FOOTER = re.compile(r"^(\d+) operations? will run on the GPU, and the remaining (\d+) operations? will run on the CPU")
_LINE = re.compile(r"^([A-Z][A-Z0-9_]*):\s*(.*)$")


def module_from_location(location: str) -> str:
    """'pkg.Class_attr/pkg.Class2_0/...;7' -> 'attr/0/...' (readable torch module path)."""
    loc = location.split(";;")[0].split(";")[0].strip()
    parts = []
    for seg in loc.split("/"):
        leaf = seg.rsplit(".", 1)[-1]
        if "_" in leaf:
            cls, attr = leaf.split("_", 1)
            parts.append(f"{attr}")
        else:
            parts.append(leaf)
    # the first segment is the wrapper module itself; "module" is the keyword adapter
    parts = parts[1:] if len(parts) > 1 else parts
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def parse_delegate_log(text: str) -> tuple[list[RejectedOp], Optional[tuple[int, int]]]:
    """Rejected ops listed by the delegate, and (ops on GPU, ops on CPU) when it says so."""
    rejected: list[RejectedOp] = []
    split = None
    inside = False
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith(_HEADER) or line == _HEADER:
            inside = True
            continue
        m = _FOOTER.match(line)
        if m:
            split = (int(m.group(1)), int(m.group(2)))
            inside = False
            continue
        if inside:
            lm = _LINE.match(line)
            if not lm:
                inside = False
                continue
            op, rest = lm.group(1), lm.group(2)
            reason, location = rest, ""
            # "Tensor dimensions must be less than 5. pkg.Module_x/...;5"
            idx = rest.find(". ")
            if idx >= 0 and (";" in rest[idx:] or "/" in rest[idx:]):
                reason, location = rest[: idx + 1], rest[idx + 2 :].strip()
            item = RejectedOp(op, reason.strip(), location, module_from_location(location) if location else "")
            if item not in rejected:  # a model compiled at two precisions logs its ops twice
                rejected.append(item)
    return rejected, split


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class DelegateRun:
    """What one compile + run on an accelerator did."""

    accelerator: str  # gpu | cpu
    driver: str  # lavapipe | system | n/a
    compiled: bool
    fully_accelerated: bool
    rejected: list[RejectedOp]
    ops_split: Optional[tuple[int, int]]
    outputs: dict[str, list[np.ndarray]]  # precision -> outputs in signature order
    output_names: list[str]
    input_names: list[str]
    compile_s: dict[str, float]
    latency_s: dict[str, float]  # median over repeats
    adapter: str
    error: str
    log: str
    memory: dict = dataclasses.field(default_factory=dict)  # measured in the child: per precision, and its totals

    def rejected_summary(self) -> str:
        return "; ".join(r.describe() for r in self.rejected) or (self.error or "no rejected ops listed")


def _write_inputs(inputs: Union[Sequence[np.ndarray], dict], path: Path) -> None:
    if isinstance(inputs, dict):
        arrays = {f"in_{i}": np.asarray(v) for i, v in enumerate(inputs.values())}
        names = list(inputs.keys())
    else:
        arrays = {f"in_{i}": np.asarray(v) for i, v in enumerate(inputs)}
        names = []
    np.savez(path, **arrays)
    (path.parent / "input_names.json").write_text(json.dumps(names))


def run_on_delegate(
    model_path: Union[str, Path],
    inputs: Union[Sequence[np.ndarray], dict, None] = None,
    precisions: Sequence[str] = PRECISIONS,
    accelerator: str = "gpu",
    repeats: int = 1,
    warmup: int = 0,
    timeout_s: float = 900.0,
    driver: Optional[str] = None,
    num_threads: int = 0,
    timed_read: bool = False,
) -> DelegateRun:
    """Compile `model_path` on the GPU delegate (or CPU) in a child process and run `inputs`.

    `inputs`: arrays in signature input order (or a dict name -> array); None compiles only.
    `precisions`: "fp16" (the delegate's default) and/or "fp32" (`enforce_f32`); ignored on CPU
    (one run, reported under "fp32"). `timed_read`: each timed repeat also reads the outputs back (a GPU run
    may return on submission; with it, latency is run + readback). Never raises for delegate failures: read
    `.compiled`, `.fully_accelerated`, `.rejected`, `.error`.
    """
    model_path = Path(model_path)
    if not model_path.is_file():
        raise PocketdiffError(f"model not found: {model_path}")
    for p in precisions:
        if p not in PRECISIONS:
            raise PocketdiffError(f"precision must be one of {PRECISIONS}, got {p!r}")
    if accelerator == "gpu":
        env, drv = delegate_env(driver=driver)
    else:
        env, drv = dict(os.environ), "n/a"
        precisions = ("fp32",)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # One child process for all precisions (the worker releases each compiled model and its
    # buffers before the next); a crash stays isolated from this process.
    outputs: dict[str, list[np.ndarray]] = {}
    with tempfile.TemporaryDirectory(prefix="pocketdiff-delegate-") as tmp:
        work = Path(tmp)
        if inputs is not None:
            _write_inputs(inputs, work / "inputs.npz")
        request = {
            "model": str(model_path.resolve()),
            "accelerator": accelerator,
            "precisions": list(precisions),
            "repeats": int(repeats),
            "warmup": int(warmup),
            "timed_read": bool(timed_read),
            "num_threads": int(num_threads),
            "inputs": str(work / "inputs.npz") if inputs is not None else None,
            "out_dir": str(work),
        }
        (work / "request.json").write_text(json.dumps(request))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pocketdiff.runtime._delegate_worker", str(work / "request.json")],
                env=env, capture_output=True, text=True, timeout=timeout_s,
            )
            log = proc.stdout + proc.stderr
            rc: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired as e:  # keep what it logged (the delegate logs to stderr)
            parts = [e.stdout or "", e.stderr or ""]
            log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in parts)
            rc = None
        res = json.loads((work / "result.json").read_text()) if (work / "result.json").is_file() else {}
        for p in res.get("ran", []):
            data = np.load(work / f"out_{p}.npz")
            outputs[p] = [data[f"out_{i}"] for i in range(len(data.files))]
    error = res.get("error", "")
    if rc is None:
        error = f"delegate run timed out after {timeout_s:.0f} s"
    elif rc < 0:
        error = f"delegate process crashed (signal {-rc})" + (f" after: {error}" if error else "")
    elif rc != 0 and not error:
        tail = [line for line in log.splitlines() if line.strip()][-3:]
        error = f"delegate process failed (exit {rc}): " + " | ".join(tail)
    if error:
        error = f"[{'+'.join(precisions)}] {error}"
    log = f"===== {accelerator} {'+'.join(precisions)} =====\n{log}"
    rejected, split = parse_delegate_log(log)
    if "No adapters found" in log and not res.get("compiled"):
        error = f"no Vulkan adapter for the GPU delegate ({drv}); {_SETUP_HINT}"
    m = re.search(r"Selected adapter: ([^\n]*)", log)
    return DelegateRun(
        accelerator=accelerator,
        driver=drv,
        compiled=bool(res.get("compiled")),
        fully_accelerated=bool(res.get("fully_accelerated")),
        rejected=rejected,
        ops_split=split,
        outputs=outputs,
        output_names=res.get("output_names", []),
        input_names=res.get("input_names", []),
        compile_s=res.get("compile_s", {}),
        latency_s=res.get("latency_s", {}),
        adapter=m.group(1).strip() if m else "",
        error=error,
        log=log,
        memory={"by_precision": res.get("memory", {}), **(res.get("memory_totals") or {})},
    )


def delegate_available(driver: Optional[str] = None) -> tuple[bool, str]:
    """(True, driver) when a Vulkan driver for the delegate is configured; else (False, why)."""
    try:
        _, name = delegate_env(driver=driver)
    except PocketdiffError as e:
        return False, str(e)
    return True, name


def prepare_in_process(driver: Optional[str] = None) -> str:
    """Make the GPU delegate usable from this process (run-bundle): set VK_ICD_FILENAMES and
    preload the unpacked Vulkan loader and libdrm by absolute path (LD_LIBRARY_PATH is only
    read at process start). Call before the first GPU CompiledModel is created."""
    import ctypes

    env, name = delegate_env(driver=driver)
    for key in ("VK_ICD_FILENAMES", "GALLIVM_PERF"):
        if key in env:
            os.environ[key] = env[key]
    libdir_str = _lavapipe_libdir(vulkan_dir())
    if name == "lavapipe" or (name == "system" and not _system_has_libvulkan()):
        if libdir_str:
            libdir = Path(libdir_str)
            for lib in ("libdrm.so.2", "libdrm_amdgpu.so.1", "libvulkan.so.1"):
                p = libdir / lib
                if p.exists():
                    ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
    return name
