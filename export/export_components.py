"""Step 4 of `pocketdiff export` (export/verb.py): every component rewritten, converted by
litert-torch, checked on the GPU delegate and stored, with its golden file, report row and
manifest entry; one at a time (the UNet last, each released from the pipeline when done, so an
SD-2.1-size export fits a 24 GB machine) or converted in parallel worker processes (`jobs`)."""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from pocketdiff.outputs import write_json
from pocketdiff.runtime.components import component
from pocketdiff.runtime.memory import host_peak_mb, reset_host_peak

from . import bundle as bundle_lib
from .chunk_export import export_chunked
from .components import Shapes, TextEncoderGraph, UNetGraph, VaeDecoderGraph
from .banded_encoder import check_band_parity, encoder_graph
from .device_profile import check_component
from .family_export import golden_ids, text_encoder_graph
from .exporter import convert_job, finish_component, peak_rss_mb, prepare_component
from .tiled_export import parity_latents, tiled_parity

log = logging.getLogger(__name__)


def say(msg: str) -> None:
    """A progress line per phase (stderr, like the other verbs)."""
    print(f"export: {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class GoldenInputs:
    """Step 2 of the export: the fixed shapes and inputs every component is converted and checked with."""

    mode: str  # guidance: cfg | embedded | none
    shapes: Shapes
    timesteps: list  # the scheduler's, at the manifest's step count
    ids_prompt: np.ndarray  # the golden prompt's token ids [1, L]
    unet_inputs: dict  # sample, timestep (or its embedding row), encoder_hidden_states[, timestep_cond]
    takes_cond: bool  # the UNet graph takes timestep_cond (a w-conditioned student, time embedding inside)
    vae_latents: torch.Tensor
    table: Optional[np.ndarray]  # the time-embedding table (time embedding outside the graph), else None
    image_pixels: Optional[torch.Tensor] = None  # the image encoder's golden picture [1, 3, H, W] in [0, 1] (image tasks)
    ids_prompt_2: Optional[np.ndarray] = None  # the SDXL family: the golden prompt's ids by the second tokenizer [1, L]
    time_ids: Optional[list] = None  # a text_time UNet's size / crop ids (pipeline.conditioning.time_ids), else None
    family: str = "sd"  # the pipeline's family (export/family_export.py), the manifest's pipeline.family
    zero_unconditional: bool = False  # cfg's unconditional rows are zeros (the folder's force_zeros_for_empty_prompt)


class ComponentExport:
    """The components of one export; `run()` fills `reports` (per component), `manifest` (the
    manifest's components) and `tiling_report` (the tiled-decode parity), and adds to `timings`."""

    def __init__(self, *, out: Path, work: Path, pipe, names: list[str], golden: GoldenInputs, rewrites_of: dict,
                 weights_of: dict, quantized: dict, split, tiled: tuple, settings: Any, timings: dict):
        """`settings`: the export Config (rewrites, verify, parity, int8.float_storage, device_profile,
        vae_tiling, jobs, unet_chunks, text_encoder_chunks); `split`: the tiled decoder's graphs or None; `tiled`: its component names."""
        self.out, self.work, self.pipe, self.names, self.golden = out, work, pipe, names, golden
        self.rewrites_of, self.weights_of, self.quantized, self.split, self.tiled = rewrites_of, weights_of, quantized, split, tiled
        self.cfg, self.timings = settings, timings
        self.sequential = settings.jobs == 1 or len(names) == 1
        self.reports: dict = {}
        self.manifest: dict = {}
        self.tiling_report: dict = {}
        self.chunk_blocks: dict[str, dict] = {}  # the manifest's <base>_chunks blocks (unet_chunks, text_encoder_chunks > 1)
        self.lora_block: Optional[dict] = None  # the manifest's lora_slots block (export lora_slots: export/lora_slots.py)
        self.encoder_bands: Optional[dict] = None  # the vae_encoder's band plan (export/banded_encoder.py), for its report

    def run(self) -> None:
        (self.out / "golden").mkdir(exist_ok=True)
        if self.sequential:
            self._run_sequential()
        else:
            self._run_parallel()

    def _run_sequential(self) -> None:
        import gc

        order = sorted(self.names, key=lambda n: component(n).role == "denoise")  # one component in memory at a time
        for i, name in enumerate(order):
            reset = reset_host_peak()
            chunks = getattr(self.cfg, f"{name}_chunks") if component(name).chunks else 1
            if chunks > 1:  # K files, one converted after another (export/chunk_export.py)
                export_chunked(self, name, chunks, say)
            else:
                prep = self._prepare(name)
                say(f"{name}: converting with litert-torch ...")
                self._finish(prep, convert_job(prep.rewritten, prep.inputs, prep.raw_path))
                prep.raw_path.unlink(missing_ok=True)
                del prep
            self._check_tiling()
            attr = component(name).pipeline_attr  # released once no later component needs it (the head: the VAE stays)
            if attr and all(component(n).pipeline_attr != attr for n in order[i + 1:]):
                setattr(self.pipe, attr, None)
            gc.collect()
            if reset:  # the process's peak while this component was prepared, converted and checked
                self.reports[name]["peak_rss_mb"] = round(host_peak_mb(), 1)
            log.info("export %s: done (peak RSS %.1f GB)", name, (self.reports[name].get("peak_rss_mb") or peak_rss_mb()) / 1024)

    def _run_parallel(self) -> None:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        preps = [self._prepare(name) for name in self.names]
        # the largest first: with 2 workers the UNet runs beside the other two
        order = sorted(preps, key=lambda p: -sum(t.numel() for t in p.rewritten.parameters()))
        with ProcessPoolExecutor(max_workers=min(self.cfg.jobs, len(preps)), mp_context=mp.get_context("spawn")) as pool:
            futures = {p.name: pool.submit(convert_job, p.rewritten, p.inputs, str(p.raw_path), 1) for p in order}
            for prep in preps:
                self._finish(prep, futures[prep.name].result())
                prep.raw_path.unlink(missing_ok=True)
        self._check_tiling()

    def _graph_for(self, name: str):
        pipe, g, outside = self.pipe, self.golden, self.cfg.rewrites.time_embedding_outside
        if component(name).role == "text":  # the family's graph (export/family_export.py: SDXL's penultimate states, pooled)
            return text_encoder_graph(pipe, name), {"input_ids": torch.from_numpy(golden_ids(g, name))}
        if name == "unet":
            import copy

            unet = copy.deepcopy(pipe.unet) if outside and not self.sequential else pipe.unet
            graph = UNetGraph(unet, external_time_embedding=outside, timestep_cond=g.takes_cond)
            if getattr(self.cfg, "lora_slots", None) is not None:  # the attention projections take LoRA factors as inputs
                from .lora_slots import add_lora_slots

                graph, inputs, self.lora_block = add_lora_slots(graph, g.unet_inputs, self.cfg.lora_slots, self.cfg.seed)
                return graph, inputs
            return graph, g.unet_inputs
        if name == "vae_encoder":
            return self._encoder_graph(), {"pixels": g.image_pixels}
        if self.split is not None:
            return self.split.graphs.pop(name)  # held only while this component is prepared
        return VaeDecoderGraph(pipe.vae), {"latents": g.vae_latents}

    def _encoder_graph(self):
        """The whole encoder, or under the profile's max_tensor_mb the banded one, gated against the whole in torch."""
        px, prof = self.golden.image_pixels, self.cfg.device_profile
        graph, plan = encoder_graph(self.pipe.vae, px.shape[2], px.shape[3], prof.budgets()["max_tensor_mb"], prof.activation_bytes)
        if plan["levels"]:
            say(f"vae_encoder: {plan['what']} (device_profile.max_tensor_mb); parity against the whole encoder in torch ...")
            plan["parity_psnr_db"] = round(check_band_parity(self.pipe.vae, graph, px, self.cfg.parity.encoder_bands_psnr_db), 1)
        self.encoder_bands = plan
        return graph

    def _prepare(self, name: str):
        t0 = time.perf_counter()
        graph, inputs = self._graph_for(name)
        say(f"{name} ({self.weights_of[name]}): rewrites and PyTorch reference ...")
        prep = prepare_component(name, graph, inputs, self.out / f"{name}.tflite", self.rewrites_of[name], self.weights_of[name],
                                 self.quantized.get(name))
        prep.raw_path = self.work / f"{name}_fp32.tflite"
        if len(prep.references or ()) > 1 and prep.references_by_name is None:  # every output checked (SDXL's text_encoder_2)
            prep.references_by_name = {f"output_{i}": r for i, r in enumerate(prep.references)}
        self.timings[f"{name}_prepare_s"] = round(time.perf_counter() - t0, 2)
        return prep

    def _finish(self, prep, info) -> None:
        """Store and check one converted component; its golden file, report row and manifest entry."""
        cfg, out, timings, name = self.cfg, self.out, self.timings, prep.name
        t0 = time.perf_counter()
        say(f"{name}: converted by litert-torch in {info['convert_s']:.0f} s; "
            + (f"checking on the GPU delegate ({'+'.join(cfg.verify.precisions)}) ..." if cfg.verify.delegate else "storing weights"))
        rep = finish_component(prep, info, cfg.verify, cfg.parity, float_storage=cfg.int8.float_storage,
                               int8_gpu=cfg.int8.gpu_weights)
        timings[f"{name}_verify_s"] = round(time.perf_counter() - t0, 2)
        if cfg.verify.delegate:
            cos = ", ".join(f"{p} {m['cosine']:.6f}" for p, m in rep.get("parity", {}).items())
            say(f"{name}: fully accelerated on the GPU delegate ({rep['delegate']['driver']}), cosine {cos}, "
                f"{timings[f'{name}_verify_s']:.0f} s")
        reference = rep.pop("reference")
        golden_path = out / "golden" / f"{name}.npz"
        np.savez(golden_path, **{f"input_{k}": v.detach().numpy() for k, v in prep.inputs.items()},
                 **{f"output_{i}": r for i, r in enumerate(prep.references or [reference])})
        int8_map = rep.pop("int8_map", {})
        if int8_map:
            write_json(self.work / f"{name}_int8_map.json", int8_map)
        rep["device_profile"] = check_component(name, out / f"{name}.tflite", cfg.device_profile)
        rep["params"] = int(sum(p.numel() for p in prep.rewritten.parameters()))
        if name == "vae_encoder" and self.encoder_bands is not None:
            rep["bands"] = {k: v for k, v in self.encoder_bands.items() if k != "largest"}
        if rep.get("bytes"):
            rep["bytes_per_param"] = round(rep["bytes"] / max(1, rep["params"]), 4)
        self.reports[name] = rep
        entry = bundle_lib.file_entry(out, out / f"{name}.tflite")
        entry.update(
            weights=prep.weights,
            inputs=[{"name": k, **v} for k, v in rep["inputs"].items()],
            outputs=[{"name": k, **v} for k, v in rep["outputs"].items()],
            fully_accelerated=rep.get("fully_accelerated"),
            golden={**bundle_lib.file_entry(out, golden_path), "tolerances": {
                "fp16": dataclasses.asdict(cfg.parity.fp16), "fp32": dataclasses.asdict(cfg.parity.fp32)}},
        )
        q = prep.quantized
        if q is not None and prep.weights == "int8":
            entry["int8"] = {"layers": rep.get("int8_layers"), "method": q.recipe.extra.get("method") or sorted({lr.method for lr in q.recipe.layers.values()})}
            if cfg.int8.gpu_weights == "direct":
                entry["int8"]["storage"] = "direct"  # the runtime asks the accelerator for its int8 kernels
        self.manifest[name] = entry

    def _check_tiling(self) -> None:
        """The tiled-decode parity, once both tiled components are in the bundle (the VAE still loaded)."""
        split, vt, shapes = self.split, self.cfg.vae_tiling, self.golden.shapes
        if split is not None and not self.tiling_report and all(n in self.manifest for n in self.tiled):
            say(f"vae_tiling: tiled decode through the .tflite files (cpu, {vt.passes} passes) vs the whole decode ...")
            t0 = time.perf_counter()
            lat = parity_latents(self.pipe.vae, shapes.latent_size, shapes.vae_factor)
            if vt.scheme == "one_pass":  # against the same norm-free decoder, whole
                self.tiling_report.update(tiled_parity(self.out, self.manifest, split.vae, lat, split.block, vt.min_psnr_db),
                                          reference="the same norm-free decoder, whole, in torch", fold=split.fold)
            else:
                self.tiling_report.update(tiled_parity(self.out, self.manifest, self.pipe.vae, lat, split.block, vt.min_psnr_db))
            self.timings["vae_tiling_parity_s"] = round(time.perf_counter() - t0, 2)
            say(f"vae_tiling: PSNR {self.tiling_report['psnr_db']:.2f} dB (vae_tiling.min_psnr_db {vt.min_psnr_db})")
