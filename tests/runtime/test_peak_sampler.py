"""runtime/memory.py's sums over processes (run-bundle's load workers): each process's GPU memory counted once,
whether NVML lists processes or only tells the device's use, and the workers' host memory added to the runner's."""
from __future__ import annotations

import subprocess
import sys

from pocketdiff.runtime.memory import GpuMemory, PeakSampler


class _FakeNvml(GpuMemory):
    """GpuMemory with NVML's answers given: `listed` pid -> MB in its process lists, the device's used MB."""

    def __init__(self, pid, listed, device_mb=0.0, baseline_mb=0.0):
        self.pid, self.pids, self.available, self.name, self.source = pid, {pid}, True, "fake", None
        self.listed, self.device, self.baseline_mb = listed, device_mb, baseline_mb

    def _process_list(self):
        return {p: int(mb * 2**20) for p, mb in self.listed.items()}

    def device_used_mb(self):
        return self.device


def test_gpu_of_added_processes_is_counted_once():
    # the runner itself holds no GPU memory (absent from NVML's list); two workers hold 300 and 400 MB
    sampler = PeakSampler(gpu=_FakeNvml(1, {}, device_mb=1800.0, baseline_mb=1000.0), every_s=10)
    try:
        assert sampler._gpu_used_mb() == 800.0  # alone: the device minus its baseline
        sampler.add_process(11)
        sampler.add_process(12)
        sampler.gpu.listed = {11: 300.0, 12: 400.0, 99: 5000.0}  # 99: another program on the GPU, not ours
        assert sampler._gpu_used_mb() == 700.0 and sampler.gpu.source == "nvml process list"
        # NVML lists nobody (a sandbox): the device's use once, not once per process
        sampler.gpu.listed = {}
        assert sampler._gpu_used_mb() == 800.0 and sampler.gpu.source == "nvml device used minus baseline"
    finally:
        sampler.close()


def test_host_memory_of_an_added_process_is_added():
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
                              "import sys; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        sampler = PeakSampler(gpu=_FakeNvml(1, {}), every_s=10)
        try:
            alone = sampler._host_rss_mb()
            sampler.add_process(child.pid)
            assert sampler._host_rss_mb() > alone + 190
            mark = sampler.mark()
            assert mark["host_peak_mb"] > alone + 190
            assert sampler.totals()["host_peak_mb"] > alone + 190 and sampler.totals()["processes"] == 2
        finally:
            sampler.close()
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_a_process_gone_since_the_last_mark_adds_nothing_to_the_next_window_but_stays_in_the_totals():
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
                              "import sys; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    sampler = PeakSampler(gpu=_FakeNvml(1, {}), every_s=10)
    try:
        sampler.add_process(child.pid)
        with_child = sampler.mark()["host_peak_mb"]
        child.stdin.close()
        child.wait(timeout=30)
        without = sampler.mark()["host_peak_mb"]
        assert without < with_child - 190, (with_child, without)  # its last window is not counted again
        assert sampler.totals()["host_peak_mb"] > without + 190  # the run's peak keeps what it held
    finally:
        sampler.close()
        if child.poll() is None:
            child.kill()


def test_mark_tells_file_backed_memory_from_the_rest(tmp_path):
    # a mapped, touched 64 MB file shows in host_file_mb (RssFile), which is part of host_rss_mb
    import mmap

    path = tmp_path / "model.bin"
    path.write_bytes(b"\1" * (64 << 20))
    sampler = PeakSampler(gpu=_FakeNvml(1, {}), every_s=10)
    try:
        before = sampler.mark()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            assert sum(m[i] for i in range(0, len(m), 4096)) == len(m) // 4096
            after = sampler.mark()
    finally:
        sampler.close()
    assert after["host_file_mb"] - before["host_file_mb"] > 60
    assert after["host_rss_mb"] >= after["host_file_mb"]


def _holder(mb: int) -> subprocess.Popen:
    """A child that holds MB of touched memory until a line on its stdin, then frees it and waits for stdin to close."""
    child = subprocess.Popen([sys.executable, "-c", f"b = bytearray({mb} * 2**20); b[::4096] = b'x' * len(b[::4096]); "
                              "import sys; print('ready', flush=True); sys.stdin.readline(); del b; "
                              "print('freed', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_workers_alive_one_after_the_other_count_once_and_keep_their_own_peaks():
    # overlap workers (runtime/overlap.py): each measures its own lifetime peak, which the runner's marks must not
    # reset; one retired before the next starts adds only the larger of the two peaks to the run's host peak
    sampler = PeakSampler(gpu=_FakeNvml(1, {}), every_s=10)
    children = []
    try:
        sampler.mark()  # a window starts here
        own, window = sampler.totals()["host_peak_mb"], sampler.mark()["host_peak_mb"]  # the run's, a window's (this process)
        first = _holder(200)
        children.append(first)
        sampler.add_process(first.pid, own_peak=True)
        first.stdin.write("free\n")
        first.stdin.flush()
        assert first.stdout.readline().strip() == "freed"
        sampler.mark()  # would reset the child's high-water mark for a load worker; an own_peak one keeps it
        assert sampler.mark()["host_peak_mb"] > window + 190
        assert sampler.retire_process(first.pid) > 190
        assert sampler.mark()["host_peak_mb"] < window + 100  # retired: in no later window
        second = _holder(120)
        children.append(second)
        sampler.add_process(second.pid, own_peak=True)
        sampler.retire_process(second.pid)
        total = sampler.totals()["host_peak_mb"]
        assert own + 190 < total < own + 190 + 110, (own, total)  # the larger peak, not the sum of both
    finally:
        sampler.close()
        for child in children:
            child.stdin.close()
            child.wait(timeout=30)
