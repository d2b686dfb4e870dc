"""`pocketdiff run-bundle BUNDLE --prompt TEXT --output DIR`: text -> PNG from a bundle alone.

`BundleRunner` is two objects: the pipeline that runs the stages the manifest declares (runtime/pipeline.py) and
the model pool that loads and releases the models (runtime/model_pool.py). The reference runner of an exported bundle. It uses only the bundle's files, numpy,
`tokenizers` (the bundle's tokenizer.json), ai-edge-litert and PIL (to write the PNG):
no torch, no diffusers. The manifest's scheduler (runtime/schedulers.py: DDIM, or for `scheduler.type: lcm`
the consistency step) on its timesteps, classifier-free guidance in one
batch-2 UNet call (or the student's embedded guidance), the time embedding looked up in the
bundle's table when it was computed outside the graph.

`--pipelined` loads each model just before its use and releases it after (text encoder, UNet,
decoder: one at a time). Without it the three models are loaded up front (the naive app).
A bundle with a `vae_tiling` block decodes with its two decoder graphs (`vae_decoder_head` on the
whole latent, `vae_up_tile` per tile: runtime/onepass_decode.py or, for the iterated schemes,
runtime/tiled_decode.py); pipelined, the head runs and is released before the up tile loads. A UNet exported in chunks
(`unet_chunks`: unet.0, unet.1, ...) loads chunk after chunk, each run once on zeros on the GPU before the next
compiles (the accelerator lets a model's host weight copies go at its first run; pipelined, the freed heap is also
returned, the chunks share one environment, and they compile largest compile excess first when an earlier launch
measured it: runtime/compile_order.py), stays for every step, and runs in sequence
with its tensors passed by name (runtime/chunks.py); with `--stream-unet` (and `--pipelined`) each
chunk is instead loaded for each step and released after it (one chunk in memory at a time). A text encoder
in chunks (`text_encoder_chunks`) runs chunk after chunk on the prompt; pipelined, each is released before the
next loads. `--pipelined --overlap-loads`: each model (a UNet's chunks together) compiled and run in a worker process
of its own, the next one compiling while the current one loads and runs, within `--memory-budget-mb` checked from
measured figures (runtime/overlap.py); `--overlap-ahead N` compiles the N models after the current one at once.
`--on-cpu text_encoder` runs that component on the CPU (XNNPACK; an int8 file through its CPU variant, made at the
first launch and kept in the --gpu-cache folder) while the rest run on the GPU: no GPU compile for it and no GPU memory,
and with --overlap-loads it loads and runs while the GPU models compile in their workers. `--one-environment`
(pipelined): every model in one LiteRT environment instead of one each. `--compile-ahead` (pipelined): the next GPU
model compiles in a thread while the current stage runs (the UNet during a CPU text encoder, the decoder's first graph
during the steps; runtime/compile_ahead.py). On the GPU the
models run through LiteRT's C API (runtime/litert_c.py) with the compiled-program cache
(runtime/gpu_cache.py); `--weight-cache` keeps the converted weights there too (litert-lm-api's one-build
library). The report has per-stage latency and the measured memory: host and GPU
peaks and every model's phases (runtime/memory.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import numpy as np

from pocketdiff.errors import PocketdiffError

from .manifest_check import check_bundle
from .verified_files import HashLedger, ledger_path
from .load_workers import check_count
from .managed_model import loading_policy
from .litert_c import parse_gpu_option
from .memory import process_age_s
from .model_pool import ModelPool
from .overlap import check_ahead, check_budget
from .cli_checks import check_on_cpu, check_weight_cache
from .compile_ahead import check_compile_ahead
from .image_tasks import check_image_flags, image_inputs
from .lora_slots import LoraFeeds, check_lora_flags
from .pipeline import BundlePipeline
from .tiled_bundle import load_tiled_decoder, tiled_decode_bundle  # noqa: F401  (their home before runtime/tiled_bundle.py)
from .tokens import bundle_tokenize, bundle_tokenizer, check_seed  # noqa: F401  (likewise, runtime/tokens.py)



class BundleRunner:
    """A bundle's models for any number of prompts (`run`); `close()` (or a `with` block) frees them.

    Two objects: the `pipeline` (runtime/pipeline.py) runs the stages the manifest declares, and the `pool`
    (runtime/model_pool.py) loads, keeps and releases the models as the loading policy says. Plain: every model is
    loaded at the first prompt and stays (the naive app). `pipelined`: each model is loaded just before its use and
    released right after it, one at a time (Choi et al.'s pipelined loading; Apple's reduceMemory); on the GPU each
    has a LiteRT environment of its own. `stream_unet` (pipelined): a chunked UNet's chunks loaded per step.
    `load_workers` N (plain, GPU): the models compiled in N worker processes at once. `overlap_loads` (pipelined,
    GPU): each model in a worker of its own, the next one compiled during the current one, as far as
    `memory_budget_mb` lets. `gpu_cache`: the accelerator's compiled-program cache folder (None: the default one per
    bundle, False: none). `release_file_pages` (GPU): a compiled model's .tflite pages go back. Memory is measured
    per phase (runtime/memory.py). The start-up levers (issue 66; each off by default): `on_cpu` (GPU runner): whole
    components run on the CPU (XNNPACK) in this process, e.g. ("text_encoder",), their int8 files' CPU variants kept in
    the cache folder (the report's `accelerator_by_model` says where each model ran); `overlap_ahead` N (overlap_loads,
    no budget): the N units after the current one compile at once in their workers; `one_environment` (pipelined, GPU):
    the models share one LiteRT environment; `compile_ahead` (pipelined, GPU): the next GPU model compiles in a thread
    while the current stage runs (runtime/compile_ahead.py). `weight_cache` (GPU, a cache folder): the accelerator's
    converted weights kept in the cache folder too, through litert-lm-api's one-build LiteRT library, which this
    process then keeps (one library per process: runtime/litert_c.py); the report's gpu_cache says made / reused.
    """

    def __init__(self, bundle: str | Path, accelerator: str = "gpu", pipelined: bool = False, manifest: Optional[dict] = None,
                 gpu_cache: Union[str, Path, None, bool] = None, gpu_options: Optional[dict] = None, stream_unet: bool = False,
                 load_workers: int = 0, overlap_loads: bool = False, memory_budget_mb: Optional[float] = None,
                 release_file_pages: bool = True, keep: tuple = (), image_input: bool = False,
                 lora: Union[str, Path, LoraFeeds, None] = None, lora_scale: float = 1.0, on_cpu: tuple = (),
                 overlap_ahead: int = 1, one_environment: bool = False, compile_ahead: bool = False,
                 weight_cache: bool = False):
        if accelerator not in ("cpu", "gpu"):
            raise PocketdiffError(f"accelerator must be cpu or gpu, got {accelerator!r}")
        # plain, pipelined, streamed, workers or overlapped (runtime/managed_model.py), checked before the bundle is read
        self.policy = loading_policy(accelerator, pipelined, stream_unet, load_workers, overlap_loads, keep, one_environment)
        budget = check_budget(memory_budget_mb, self.policy.overlap)
        overlap_ahead = check_ahead(overlap_ahead, self.policy.overlap, budget)
        compile_ahead = check_compile_ahead(compile_ahead, self.policy, accelerator)
        weight_cache = check_weight_cache(weight_cache, accelerator, gpu_cache is not False)
        self.bundle, self.accelerator = bundle, accelerator
        self.man = manifest or check_bundle(bundle)  # fields, stages, sizes and every .tflite's signature, before anything runs
        on_cpu = check_on_cpu(on_cpu, accelerator, self.man, bundle)  # names, a GPU runner, this bundle's stages (run-bundle's: checked)
        self.pipeline = BundlePipeline(self.man, bundle, image_input)  # image_input: runs from a picture (img2img, inpaint)
        if isinstance(lora, LoraFeeds):  # read and checked by the caller (run-bundle, before --output is made)
            self.pipeline.lora = lora
        elif lora is not None:
            self.set_lora(lora, lora_scale)
        absent = [k for k in self.policy.keep if k not in {s["component"] for s in self.pipeline.stages}]
        if absent:
            raise PocketdiffError(f"--keep {','.join(absent)}: no stage of bundle {bundle} runs it "
                                  f"(its stages run {', '.join(s['component'] for s in self.pipeline.stages)})")
        if stream_unet and len(self.pipeline.denoiser_parts()) == 1:
            raise PocketdiffError(f"bundle {bundle}: --stream-unet streams a UNet exported in chunks; this one is one model "
                                  "(export with unet_chunks=N)")
        self.pool = ModelPool(bundle, self.man, self.pipeline.names(), self.pipeline.units(), self.policy, accelerator,
                              gpu_cache=gpu_cache, gpu_options=gpu_options, release_file_pages=release_file_pages, budget=budget,
                              chunk_group=self.pipeline.denoiser_parts(), on_cpu=on_cpu, overlap_ahead=overlap_ahead,
                              compile_ahead=compile_ahead, weight_cache=weight_cache)
        self.pipeline.pool = self.pool
        self.pool.mark("runner", "ready")

    # the pool's state, as callers of the runner read it
    loaded = property(lambda self: self.pool.loaded)
    sampler = property(lambda self: self.pool.sampler)
    models = property(lambda self: self.pool.models)
    phases = property(lambda self: self.pool.phases)
    driver = property(lambda self: self.pool.driver)

    def _options_for(self, name: str) -> dict:
        return self.pool.options_for(name)

    def __enter__(self) -> "BundleRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.close()

    def run(self, prompt: str, seed: int = 0, init_latents: Optional[np.ndarray] = None, **image) -> tuple[np.ndarray, dict]:
        """One prompt: (image [H, W, 3] float32 in [0, 1], stats). Loads what is not resident;
        `latency_s` holds this prompt's loads and runs only; `memory` the measured phases so far. `image`: init_image,
        strength, mask (runtime/pipeline.py `run`; the runner made with image_input)."""
        check_seed(seed)
        return self.pipeline.run(prompt, seed, init_latents, **image)

    def set_lora(self, path: Union[str, Path, None], scale: float = 1.0) -> Optional[dict]:
        """Swap the LoRA a bundle exported with lora_slots feeds its UNet, between images (None: none, zero factors):
        new factor inputs only, no model reloaded or recompiled (runtime/lora_slots.py). Refused in one line, the
        previous LoRA kept, for a file that does not fit the slots."""
        if path is None:
            self.pipeline.lora.clear()
            return None
        return self.pipeline.lora.load(path, scale)

    def memory_report(self) -> dict:
        """Measured: the whole run's peaks (host, GPU, host + GPU) and every phase; the cache's state."""
        return self.pool.memory_report()


def generate(
    bundle: str | Path,
    prompt: str,
    seed: int = 0,
    accelerator: str = "gpu",
    pipelined: bool = False,
    init_latents: Optional[np.ndarray] = None,
    manifest: Optional[dict] = None,
    gpu_cache: Union[str, Path, None, bool] = None,
) -> tuple[np.ndarray, dict]:
    """Run the bundle for one prompt: (image [H, W, 3] float32 in [0, 1], stats). Loads and frees
    every model; for several prompts, `BundleRunner` loads them once."""
    with BundleRunner(bundle, accelerator, pipelined, manifest, gpu_cache=gpu_cache) as runner:
        return runner.run(prompt, seed=seed, init_latents=init_latents)


def check_flags(args) -> None:
    """run-bundle's flags that contradict each other or say nothing: one line naming them, before anything is read."""
    from .cli_checks import check_run_bundle_flags

    check_run_bundle_flags(args)  # --prompt's text, --gpu-cache outside the bundle, GPU-only flags (runtime/cli_checks.py)
    workers = getattr(args, "load_workers", None)
    if workers is not None:
        check_count(workers)  # `--load-workers 0` is refused, not run as plain without a word
    overlap = bool(getattr(args, "overlap_loads", False))
    policy = loading_policy(args.accelerator, args.pipelined, getattr(args, "stream_unet", False), workers, overlap,
                            one_environment=getattr(args, "one_environment", False))
    check_compile_ahead(getattr(args, "compile_ahead", False), policy, args.accelerator)
    check_ahead(getattr(args, "overlap_ahead", None), overlap, check_budget(getattr(args, "memory_budget_mb", None), overlap))
    if getattr(args, "gpu_cache", None) is not None and getattr(args, "no_gpu_cache", False):
        raise PocketdiffError(f"--gpu-cache {args.gpu_cache} and --no-gpu-cache contradict each other: give one of them")
    check_image_flags(args)  # --mask / --strength without --init-image, a strength outside (0, 1] (runtime/image_tasks.py)
    check_lora_flags(args)  # --lora-scale without --lora, a pickle or another suffix (runtime/lora_slots.py)


def hash_ledger(args) -> Optional[HashLedger]:
    """The files that passed the checks at earlier launches (runtime/verified_files.py), kept with the GPU cache;
    --no-gpu-cache: none."""
    if getattr(args, "no_gpu_cache", False):
        return None
    folder = getattr(args, "gpu_cache", None)
    return HashLedger(ledger_path(args.bundle, Path(folder) if folder else None))


def main(args) -> int:
    """CLI entry (argparse namespace: bundle, prompt, output, accelerator, pipelined, seed, overwrite, debug)."""
    from pocketdiff.outputs import finish_output_dir, prepare_output_dir, write_json

    startup = {"main": process_age_s()}  # process start -> here: the interpreter, the CLI and its imports
    check_seed(args.seed, "--seed")  # before the bundle is read or --output made
    check_flags(args)
    gpu_options = dict(parse_gpu_option(o) for o in getattr(args, "gpu_option", None) or [])
    man = check_bundle(args.bundle, ledger=hash_ledger(args))  # refuses bad bundles (files, fields, signatures) before touching --output
    # --on-cpu's one check (runtime/cli_checks.py): known components, a GPU runner, each one a stage of this bundle runs
    on_cpu = check_on_cpu(getattr(args, "on_cpu", None), args.accelerator, man, args.bundle)
    startup["bundle_checked"] = process_age_s()  # sha256 (of the files changed since the last launch) and .tflite checks
    picture = image_inputs(args, man)  # img2img / inpaint: the bundle's tasks, the strength's steps, the picture and mask read
    lora = None
    if getattr(args, "lora", None):  # read and checked against the bundle's slots before --output is made
        lora = LoraFeeds(man, args.bundle)
        lora.load(args.lora, 1.0 if args.lora_scale is None else args.lora_scale)
    fresh = not Path(args.output).exists()
    out = prepare_output_dir(args.output, overwrite=args.overwrite, inputs=[("bundle", args.bundle)], verb="run-bundle")
    fully = None
    try:
        cache = False if getattr(args, "no_gpu_cache", False) else getattr(args, "gpu_cache", None)
        with BundleRunner(args.bundle, args.accelerator, args.pipelined, man, gpu_cache=cache, gpu_options=gpu_options,
                          stream_unet=getattr(args, "stream_unet", False), load_workers=getattr(args, "load_workers", None) or 0,
                          overlap_loads=getattr(args, "overlap_loads", False),
                          memory_budget_mb=getattr(args, "memory_budget_mb", None),
                          release_file_pages=not getattr(args, "keep_file_pages", False), image_input=bool(picture),
                          lora=lora, on_cpu=on_cpu, overlap_ahead=getattr(args, "overlap_ahead", None) or 1,
                          one_environment=getattr(args, "one_environment", False),
                          compile_ahead=getattr(args, "compile_ahead", False),
                          weight_cache=getattr(args, "weight_cache", False)) as runner:
            image, stats = runner.run(args.prompt, seed=args.seed, **picture)
        if not stats["finite"]:
            raise PocketdiffError(f"bundle {args.bundle}: the image has NaN/Inf values ({args.accelerator})")
    except PocketdiffError:
        if fresh:  # leave no half-made folder behind (only the one this call created)
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise
    from PIL import Image  # only to write the PNG: imported after the run, not before the runner is ready

    fully = stats["fully_accelerated"]
    path = out / "image.png"
    Image.fromarray((image * 255).round().astype(np.uint8)).save(path)
    report = {
        "image": str(path.resolve()),
        "prompt": args.prompt,
        "seed": args.seed,
        **({"init_image": str(Path(args.init_image).resolve()), "strength": picture["strength"],
            "mask": str(Path(args.mask).resolve()) if args.mask else None} if picture else {}),
        "bundle": str(Path(args.bundle).resolve()),
        "lora": lora.loaded if lora is not None else None,  # the LoRA fed to the slots: file, scale, layers
        "accelerator": args.accelerator,
        "driver": stats["driver"],
        "pipelined": bool(args.pipelined),
        "stream_unet": bool(getattr(args, "stream_unet", False)),
        "load_workers": int(getattr(args, "load_workers", 0) or 0),
        "overlap_loads": bool(getattr(args, "overlap_loads", False)),
        "memory_budget_mb": getattr(args, "memory_budget_mb", None),
        "loading_policy": runner.policy.name,
        "fully_accelerated": fully,
        "fully_accelerated_by_component": stats["fully_accelerated_by_component"],  # the GPU's models
        "on_cpu": list(on_cpu),
        "accelerator_by_model": stats["accelerator_by_model"],  # where each model ran: cpu | gpu
        "overlap_ahead": getattr(args, "overlap_ahead", None) or 1,
        "one_environment": bool(getattr(args, "one_environment", False)),
        "compile_ahead": bool(getattr(args, "compile_ahead", False)),
        "weight_cache": bool(getattr(args, "weight_cache", False)),
        # the program cache's folder and hits, the weight cache (off | made | reused | made+reused) and the library
        "gpu_cache": {**(stats["memory"].get("gpu_cache") or {"folder": None, "weight_cache": "off"}),
                      "library": stats["memory"].get("litert_library")},
        "latency_s": {k: round(v, 4) for k, v in stats["latency_s"].items()},
        # measured (runtime/memory.py): host peak RSS, the process's GPU memory where NVML tells it, per phase
        "host_peak_mb": stats["memory"]["host_peak_mb"],
        "gpu_peak_mb": stats["memory"]["gpu_peak_mb"],
        "host_plus_gpu_peak_mb": stats["memory"]["host_plus_gpu_peak_mb"],
        "start_s": stats.get("start_s"),
        "total_s": stats.get("total_s"),
        # the measured memory and its phases; startup_s: the process's age at main, once the bundle was checked, and
        # when the runner was ready (its first phase): where the time before the first load went
        "memory": {**stats["memory"], "startup_s": {**{k: None if v is None else round(v, 3) for k, v in startup.items()},
                                                     "runner_ready": stats["memory"]["phases"][0]["t_s"]}},
        "model_files_mb": round(sum(int(e.get("bytes", 0)) for e in man["components"].values()) / 2**20, 1),  # file sizes, not memory
        "steps": len(man["scheduler"]["timesteps"]),
        "vae_tiling": ({**man["vae_tiling"], "up_tile_calls": stats.get("vae_up_tile_calls")} if man.get("vae_tiling") else None),
        "guidance": man["guidance"],
        "pid": os.getpid(),
    }
    write_json(out / "report.json", report)
    finish_output_dir(out)
    gpu = f", GPU {report['gpu_peak_mb']:.0f} MB" if report["gpu_peak_mb"] is not None else ""
    print(f"wrote {path} ({args.accelerator}, {report['latency_s']['total']:.2f} s, host peak {report['host_peak_mb']:.0f} MB{gpu})")
    return 0
