"""Measured memory of this process: host resident set (now and peak) and GPU memory where the platform
tells it. What run-bundle and verify-bundle report under a memory name comes from here, never from
file sizes.

- Host: /proc/self/status (VmRSS now, VmHWM the peak since start or since `reset_host_peak`; RssFile the part of
  VmRSS that is file-backed, e.g. model files the runtime maps).
- GPU: NVIDIA's NVML (libnvidia-ml.so.1, the driver's own library): the memory the driver charges to
  this process (graphics and compute lists; a Vulkan process is a graphics one). Where the per-process
  lists are empty (some sandboxes hide them) the device's used memory minus what it used when the
  `GpuMemory` was made, named as such (`source`). None on machines without NVML (lavapipe, phones).
- `PeakSampler` polls both in a thread (default every 20 ms) to catch GPU peaks between phases; the
  host peak comes from the kernel's own high-water mark, not from polling. Worker processes count with it
  (`add_process`); a worker that exits before the run ends is retired first (`retire_process`), and the run's
  host peak adds only the workers that were alive together (each one's own lifetime peak, an upper bound).
- `SelfMeter`: one process measuring itself (an overlap worker of runtime/overlap.py): its lifetime peaks and
  what it held while it ran.
"""
from __future__ import annotations

import ctypes as C
import os
import threading
import time
from typing import Optional


def _status_kb(field: str, pid="self") -> Optional[float]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def host_rss_mb(pid="self") -> Optional[float]:
    kb = _status_kb("VmRSS", pid)
    return None if kb is None else kb / 1024.0


def host_file_mb(pid="self") -> Optional[float]:
    """The file-backed part of the resident set (RssFile: mapped model files and libraries, clean pages the kernel
    can drop and read back), so a report can tell it from the anonymous memory a process really holds."""
    kb = _status_kb("RssFile", pid)
    return None if kb is None else kb / 1024.0


def host_peak_mb() -> Optional[float]:
    """The kernel's high-water mark of this process's resident set (since start or the last reset)."""
    kb = _status_kb("VmHWM")
    if kb is None:  # not Linux: ru_maxrss (KB on Linux, bytes on macOS; only reached off Linux)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return kb / 1024.0


def reset_host_peak(pid="self") -> bool:
    """Set VmHWM back to the current RSS (Linux >= 4.0: write 5 to /proc/<pid>/clear_refs)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _ProcessInfo(C.Structure):  # nvmlProcessInfo_t (v2/v3 share the first two fields' layout)
    _fields_ = [("pid", C.c_uint), ("usedGpuMemory", C.c_ulonglong), ("gpuInstanceId", C.c_uint), ("computeInstanceId", C.c_uint)]


class _MemoryInfo(C.Structure):
    _fields_ = [("total", C.c_ulonglong), ("free", C.c_ulonglong), ("used", C.c_ulonglong)]


class GpuMemory:
    """GPU memory of this process (or `pid`) through NVML, and of the processes `add_pid` adds (their sum); `available`
    is False where there is none."""

    def __init__(self, pid: Optional[int] = None):
        self.pid = pid or os.getpid()
        self.pids = {self.pid}
        self.available = False
        self.name = None
        self.source = None
        try:
            self.nvml = C.CDLL("libnvidia-ml.so.1")
            if self.nvml.nvmlInit_v2() != 0:
                return
            self.device = C.c_void_p()
            index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0] or 0)
            if self.nvml.nvmlDeviceGetHandleByIndex_v2(index, C.byref(self.device)) != 0:
                return
            buf = C.create_string_buffer(96)
            if self.nvml.nvmlDeviceGetName(self.device, buf, 96) == 0:
                self.name = buf.value.decode()
            self.available = True
            self.baseline_mb = self.device_used_mb()
        except OSError:
            return

    def driver_version(self) -> Optional[str]:
        if not self.available:
            return None
        buf = C.create_string_buffer(96)
        return buf.value.decode() if self.nvml.nvmlSystemGetDriverVersion(buf, 96) == 0 else None

    def device_used_mb(self) -> float:
        info = _MemoryInfo()
        self.nvml.nvmlDeviceGetMemoryInfo(self.device, C.byref(info))
        return info.used / 2**20

    def add_pid(self, pid: int) -> None:
        """Count another process too (run-bundle's load workers)."""
        self.pids.add(pid)

    def _process_list(self) -> dict[int, int]:
        """pid -> bytes, for every process NVML lists on the device (graphics and compute lists)."""
        listed: dict[int, int] = {}
        for fn in ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v3"):
            f = getattr(self.nvml, fn, None)
            if f is None:
                continue
            n = C.c_uint(64)
            procs = (_ProcessInfo * 64)()
            if f(self.device, C.byref(n), procs) != 0:
                continue
            for p in procs[: n.value]:
                if p.usedGpuMemory < (1 << 62):
                    listed[p.pid] = listed.get(p.pid, 0) + p.usedGpuMemory
        return listed

    def pid_mb(self, pid: int) -> float:
        """One process's GPU memory as NVML lists it (0 when it is not listed)."""
        return self._process_list().get(pid, 0) / 2**20

    def _listed_mb(self) -> Optional[float]:
        """Our processes' GPU memory from NVML's lists (one of them absent holds none), None when none is listed."""
        listed = self._process_list()
        mine = [listed[p] for p in self.pids if p in listed]
        return sum(mine) / 2**20 if mine else None

    def used_mb(self) -> Optional[float]:
        """Our processes' GPU memory now (MB): NVML's per-process figures added, or where it lists none of them the
        device's used memory minus its baseline (counted once); None where NVML is absent."""
        if not self.available:
            return None
        listed = self._listed_mb()
        if listed is not None:
            self.source = "nvml process list"
            return listed
        self.source = "nvml device used minus baseline"
        return max(0.0, self.device_used_mb() - self.baseline_mb)


class PeakSampler:
    """Background polling of GPU memory (and host RSS) for peaks between `mark()` calls. Processes that work for
    this one (run-bundle's load workers) are added with `add_process`: from then on every figure is the sum over
    this process and them (host: each one's own high-water mark, added)."""

    def __init__(self, gpu: Optional[GpuMemory] = None, every_s: float = 0.02):
        self.gpu = gpu if gpu is not None else GpuMemory()
        self.every_s = every_s
        self.gpu_peak_mb = 0.0
        self.gpu_window_peak_mb = 0.0
        self.host_peak_total_mb = host_peak_mb() or 0.0
        self.sum_peak_mb = 0.0  # polled: the largest host RSS + GPU at one moment
        self.others: dict[int, dict] = {}  # pid -> the largest VmHWM seen, and when it was added and retired
        self._events = 0  # adds and retirements, in order
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="memory-sampler", daemon=True)
        self._thread.start()

    def add_process(self, pid: int, own_peak: bool = False) -> None:
        """Count process PID with this one from now on. `own_peak`: its high-water mark is never reset here (it
        measures its own lifetime peak: an overlap worker), so a mark's window counts its peak so far."""
        self._events += 1
        self.others[pid] = {"peak_mb": 0.0, "reset": not own_peak, "start": self._events, "end": None}
        self.gpu.add_pid(pid)

    def retire_process(self, pid: int) -> float:
        """PID is about to exit: its high-water mark read a last time (its lifetime peak where never reset); from
        now on it counts in no window and no longer as alive next to the processes added later. Its peak (MB)."""
        o = self.others[pid]
        kb = _status_kb("VmHWM", pid)
        o["peak_mb"] = max(o["peak_mb"], 0.0 if kb is None else kb / 1024.0)
        self._events += 1
        o["end"] = self._events
        return o["peak_mb"]

    def _alive(self) -> list[int]:
        return [pid for pid, o in list(self.others.items()) if o["end"] is None]

    def _gpu_used_mb(self) -> Optional[float]:
        return self.gpu.used_mb() if self.gpu.available else None

    def _host_rss_mb(self) -> Optional[float]:
        own = host_rss_mb()
        return None if own is None else own + sum(host_rss_mb(pid) or 0.0 for pid in self._alive())

    def _others_peak_mb(self, reset: bool) -> float:
        """The live added processes' high-water marks: with `reset`, each one's since the last mark (then reset, but
        for an `own_peak` one: its peak so far; a process gone since holds nothing in this window), else the bound of
        the run: the most that the processes alive together have held (each one's largest seen, kept after it exits)."""
        total = 0.0
        for pid in self._alive():
            o = self.others[pid]
            kb = _status_kb("VmHWM", pid)
            window = 0.0 if kb is None else kb / 1024.0
            o["peak_mb"] = max(o["peak_mb"], window)
            if reset and kb is not None and o["reset"]:
                reset_host_peak(pid)
            total += window
        return total if reset else self._together_peak_mb()

    def _together_peak_mb(self) -> float:
        """The largest sum of peaks over processes alive at one time (the set only grows at an add: check each)."""
        procs = list(self.others.values())
        return max((sum(o["peak_mb"] for o in procs if o["start"] <= s and (o["end"] is None or o["end"] > s))
                    for s in (o["start"] for o in procs)), default=0.0)

    def _poll(self) -> None:
        while not self._stop.is_set():
            used = self._gpu_used_mb()
            if used is not None:
                both = used + (self._host_rss_mb() or 0.0)
                with self._lock:
                    self.gpu_peak_mb = max(self.gpu_peak_mb, used)
                    self.gpu_window_peak_mb = max(self.gpu_window_peak_mb, used)
                    self.sum_peak_mb = max(self.sum_peak_mb, both)
            time.sleep(self.every_s)

    def mark(self) -> dict:
        """Now and the peaks since the last mark: host RSS, host peak (VmHWM, then reset so the next mark
        sees its own window; `host_peak_total_mb` keeps the whole run's), GPU."""
        gpu_now = self._gpu_used_mb()
        with self._lock:
            window = max(self.gpu_window_peak_mb, gpu_now or 0.0) if gpu_now is not None else None
            self.gpu_window_peak_mb = gpu_now or 0.0
            if gpu_now is not None:
                self.gpu_peak_mb = max(self.gpu_peak_mb, gpu_now)
        own = host_peak_mb()
        self.host_peak_total_mb = max(self.host_peak_total_mb, own or 0.0)
        reset_host_peak()
        peak = None if own is None else own + self._others_peak_mb(reset=True)
        files = host_file_mb()
        if files is not None:
            files += sum(host_file_mb(pid) or 0.0 for pid in self._alive())
        return {"host_rss_mb": _r(self._host_rss_mb()), "host_file_mb": _r(files), "host_peak_mb": _r(peak),
                "gpu_mb": _r(gpu_now), "gpu_peak_mb": _r(window)}

    def totals(self) -> dict:
        """The whole run's peaks so far (host: the kernel's high-water mark; GPU: polled)."""
        self.host_peak_total_mb = max(self.host_peak_total_mb, host_peak_mb() or 0.0)
        host = self.host_peak_total_mb + self._others_peak_mb(reset=False)  # workers alive together: their peaks, added
        gpu = self.gpu_peak_mb if self.gpu.available else None
        both = None if gpu is None else host + gpu
        return {"host_peak_mb": _r(host), "gpu_peak_mb": _r(gpu), "processes": 1 + len(self.others),
                "host_plus_gpu_peak_mb": _r(both),  # the two peaks added: an upper bound, whenever each came
                "host_plus_gpu_peak_at_once_mb": _r(self.sum_peak_mb) if gpu is not None else None,  # polled
                "gpu_source": self.gpu.source, "gpu_name": self.gpu.name}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


class SelfMeter:
    """What this process holds, measured by itself (an overlap worker: runtime/load_workers.py with `measure`):
    `window()` gives its lifetime peaks so far (host: the kernel's VmHWM, which nothing may reset; GPU: polled) and
    the largest host RSS and GPU polled since the previous `window()` (then a new window starts)."""

    def __init__(self, every_s: float = 0.02):
        self.gpu = GpuMemory()
        self.every_s = every_s
        self.gpu_peak_mb = 0.0
        self._window = [0.0, 0.0]  # host RSS, GPU
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="self-meter", daemon=True)
        self._thread.start()

    def _sample(self) -> tuple[float, Optional[float]]:
        gpu = self.gpu.used_mb() if self.gpu.available else None
        with self._lock:
            host = host_rss_mb() or 0.0
            self._window[0] = max(self._window[0], host)
            if gpu is not None:
                self._window[1] = max(self._window[1], gpu)
                self.gpu_peak_mb = max(self.gpu_peak_mb, gpu)
        return host, gpu

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def window(self) -> dict:
        self._sample()
        with self._lock:
            host, gpu = self._window
            self._window = [0.0, 0.0]
        known = self.gpu.available
        return {"host_peak_mb": _r(host_peak_mb()), "gpu_peak_mb": _r(self.gpu_peak_mb) if known else None,
                "window_host_mb": _r(host), "window_gpu_mb": _r(gpu) if known else None, "gpu_source": self.gpu.source}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def _r(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(float(v), 1)


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux: /proc/self/stat's start time against /proc/uptime)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _libc():
    try:
        return C.CDLL("libc.so.6")
    except OSError:
        return None


def tune_allocator(mmap_threshold: int = 1 << 20) -> bool:
    """glibc: serve every allocation of `mmap_threshold` bytes or more with its own mmap, so that freeing it
    gives the pages back to the system at once (glibc's default threshold rises after large frees, and
    what a model load frees then stays in the heap). False where glibc is not the allocator."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1
    ok = libc.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    return bool(ok and libc.mallopt(M_TRIM_THRESHOLD, int(mmap_threshold)) == 1)


def return_freed_memory() -> bool:
    """glibc: hand the heap's free pages back to the system (malloc_trim); False elsewhere."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True
