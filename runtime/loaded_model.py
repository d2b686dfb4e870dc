"""One compiled model of a bundle with its buffers, as the runner uses it: on the GPU through LiteRT's C API
(runtime/litert_c.py), on the CPU through ai-edge-litert's `CompiledModel` (XNNPACK). run-bundle holds these, and
so does each of its load workers (runtime/load_workers.py)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import numpy as np

from pocketdiff.errors import PocketdiffError


class LoadedModel:
    """A compiled model with its buffers. GPU: through LiteRT's C API (`litert_c`), sharing the runner's
    environment, with the accelerator options the runner gives (its program cache among them); CPU:
    ai-edge-litert's `CompiledModel` (XNNPACK). `on_phase(name)` is called when the file is opened and
    when the model is compiled. `release_file_pages` (GPU): once the model is compiled and fully accelerated, the
    pages of its file that LiteRT's mapping holds are given back (runtime/file_pages.py; `pages_released` says how
    much, and `on_phase("pages_released", **that)` is called)."""

    def __init__(self, name: str, entry: dict, accelerator: str, cpu_int8_as_fp16: bool = True,
                 env=None, gpu_options: Optional[dict] = None, on_phase=None, release_file_pages: bool = False,
                 cpu_variant_dir=None, cpu_threads: Optional[int] = None, xnnpack_cache=None):
        t0 = time.perf_counter()
        path = entry["_path"]
        self._tmp = None
        self.name, self.entry, self.accelerator = name, entry, accelerator
        self.run_s: list[float] = []
        self.pages_released: Optional[dict] = None
        self.cpu_variant: Optional[str] = None  # CPU, int8 file: made | kept (in cpu_variant_dir) | temporary
        self.xnnpack_cache: Optional[str] = None  # CPU: made | reused | off (runtime/xnnpack_cache.py)
        self._xnnpack_pending = None  # (cache, slot) of a packed file not yet kept
        if accelerator == "gpu":
            from .litert_c import CompiledModel as CModel

            self.model = CModel(path, env, gpu_options or {}, on_phase=on_phase)
            self.fully_accelerated = self.model.fully_accelerated()
            self.in_names = [t.name for t in self.model.inputs]
            self.out_names = [t.name for t in self.model.outputs]
            self.in_details = {t.name: {"shape": list(t.shape), "dtype": t.dtype} for t in self.model.inputs}
            self.out_details = {t.name: {"shape": list(t.shape), "dtype": t.dtype} for t in self.model.outputs}
            if release_file_pages and self.fully_accelerated:  # the accelerator holds the weights: the file's pages are dead
                self._release_file_pages(path, on_phase)
        else:
            source_key = entry.get("sha256") or ""
            if cpu_int8_as_fp16 and entry.get("weights") == "int8":
                from .cpu_variant import VARIANT_VERSION

                path = self._cpu_variant(entry, cpu_variant_dir, on_phase)
                source_key = source_key and f"{source_key}|cpu-variant-v{VARIANT_VERSION}"
            self._load_cpu_cached(path, on_phase, cpu_threads, xnnpack_cache, source_key)
        self.load_s = time.perf_counter() - t0

    def _cpu_variant(self, entry: dict, folder, on_phase) -> str:
        """The int8 file's CPU variant (runtime/cpu_variant.py; XNNPACK: fp16 storage runs ~fp16-file speed, int8
        DEQUANTIZE does not, and int8 filters read by a conv directly do not run at all): kept in `folder` between launches
        when one is given (made at the first), else written to a temporary folder for this load. `cpu_variant` says which."""
        from .cpu_variant import fp16_variant, kept_variant

        if folder is not None and entry.get("sha256"):
            path, made = kept_variant(entry["_path"], entry["sha256"], folder)
            self.cpu_variant = "made" if made else "kept"
        else:
            import tempfile

            self._tmp = tempfile.TemporaryDirectory(prefix="pocketdiff-cpu-")
            path = str(Path(self._tmp.name) / Path(entry["_path"]).name)
            fp16_variant(entry["_path"], path)
            self.cpu_variant = "temporary"
        if on_phase:
            on_phase("cpu_variant", variant=self.cpu_variant)
        return path

    def _release_file_pages(self, path: str, on_phase) -> None:
        from .file_pages import release_file_pages

        self.pages_released = release_file_pages(path)
        if on_phase and self.pages_released is not None:
            on_phase("pages_released", **self.pages_released)

    def _load_cpu_cached(self, path: str, on_phase, threads: Optional[int], cache, source_key: str) -> None:
        """`_load_cpu` with XNNPACK's packed weights kept in `cache` (an `XnnpackWeightCache`, or None: not kept) under
        `source_key` (what the file is: its checked sha256, its variant's version). A load that fails with the cache
        gets one warning line and is made again without it."""
        slot = cache.slot(self.name, source_key) if cache is not None else None
        if slot is None or not slot.path:
            self.xnnpack_cache = "off"
            self._load_cpu(path, on_phase, threads)
        else:
            try:
                self._load_cpu(path, on_phase, threads, slot.path)
            except Exception as e:  # noqa: BLE001 - LiteRT raises RuntimeError/ValueError; the load goes on without
                cache.drop(slot)
                cache.warn(f"xnnpack cache {slot.path}: {self.name} did not load with it ({e}); loaded without")
                slot.state = "off"
                self._load_cpu(path, on_phase, threads)
            self.xnnpack_cache = slot.state
            if slot.state == "made":  # kept after the first run: XNNPACK may pack some weights only then
                self._xnnpack_pending = (cache, slot)
        if on_phase:
            on_phase("xnnpack_cache", state=self.xnnpack_cache)

    def _load_cpu(self, path: str, on_phase, threads: Optional[int] = None, weight_cache: str = "") -> None:
        """XNNPACK through ai-edge-litert's CompiledModel; `threads` None: the library's default count; `weight_cache`:
        the file XNNPACK packs the weights into or maps them from (runtime/xnnpack_cache.py), "" for none."""
        from ai_edge_litert.compiled_model import CompiledModel, CpuOptions, HardwareAccelerator, Options

        if on_phase:
            on_phase("opened")
        cpu = None
        if threads or weight_cache:
            cpu = CpuOptions(num_threads=int(threads or 0), xnnpack_weight_cache_path=weight_cache)
        self.model = CompiledModel.from_file(path, options=Options(hardware_accelerators=HardwareAccelerator.CPU, cpu_options=cpu))
        self.fully_accelerated = False
        sigs = self.model.get_signature_list()
        self.sig = next(iter(sigs))
        self.in_names = list(sigs[self.sig]["inputs"])
        self.out_names = list(sigs[self.sig]["outputs"])
        self.in_details = self.model.get_input_tensor_details(self.sig)
        self.out_details = self.model.get_output_tensor_details(self.sig)
        self.in_bufs = self.model.create_input_buffers(0)
        self.out_bufs = self.model.create_output_buffers(0)
        if on_phase:
            on_phase("compiled")

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return self.run_all(feeds)[0]

    def _ordered(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        names = list(feeds)
        arrays = []
        for i, name in enumerate(self.in_names):
            key = name if name in feeds else names[i]
            det = self.in_details[name]
            arr = np.ascontiguousarray(np.asarray(feeds[key]).astype(np.dtype(det["dtype"])))
            if list(arr.shape) != [int(s) for s in det["shape"]]:
                raise PocketdiffError(f"{self.name}: input {name} has shape {list(arr.shape)}, the model takes {list(det['shape'])}")
            arrays.append(arr)
        return arrays

    def run_all(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Every output, in the signature's order."""
        arrays = self._ordered(feeds)
        t0 = time.perf_counter()
        if self.accelerator == "gpu":
            outs = self.model.run(arrays)
            self.run_s.append(time.perf_counter() - t0)
            return outs
        for buf, arr in zip(self.in_bufs, arrays):
            buf.write(arr)
        self.model.run_by_index(0, self.in_bufs, self.out_bufs)
        self.run_s.append(time.perf_counter() - t0)
        if self._xnnpack_pending is not None:
            cache, slot = self._xnnpack_pending
            self._xnnpack_pending = None
            cache.keep(slot)
        outs = []
        for buf, name in zip(self.out_bufs, self.out_names):
            shape = [int(s) for s in self.out_details[name]["shape"]]
            outs.append(np.asarray(buf.read(int(np.prod(shape)), np.dtype(self.out_details[name]["dtype"]))).reshape(shape))
        return outs

    def close(self) -> None:
        if self.accelerator == "gpu" and self.model is not None:
            self.model.close()
        if self._xnnpack_pending is not None:  # never ran: its packed file is not known whole, and not kept
            cache, slot = self._xnnpack_pending
            self._xnnpack_pending = None
            cache.drop(slot)
        self.in_bufs = self.out_bufs = None
        self.model = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
