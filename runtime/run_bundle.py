"""`pocketdiff run-bundle BUNDLE --prompt TEXT --output DIR`: text -> PNG from a bundle alone.

The reference runner of an exported bundle. It uses only the bundle's files, numpy,
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
measured figures (runtime/overlap.py). On the GPU the
models run through LiteRT's C API (runtime/litert_c.py) with the compiled-program cache
(runtime/gpu_cache.py). The report has per-stage latency and the measured memory: host and GPU
peaks and every model's phases (runtime/memory.py).
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

from pocketdiff.errors import PocketdiffError

from .components import VAE_DECODER
from .manifest_check import TILED_DECODER, check_bundle, decoder_components
from .gpu_cache import bundle_digest
from .verified_files import HashLedger, ledger_path
from .load_workers import LoadWorkers, check_count, settle
from .loaded_model import LoadedModel
from .managed_model import PIPELINED, ManagedModel, loading_policy
from .litert_c import parse_gpu_option
from .memory import PeakSampler, host_peak_mb, process_age_s, return_freed_memory, tune_allocator
from .overlap import check_budget, overlap_loader, overlap_units
from .onepass_decode import ONE_PASS, one_pass_decode_loaded, timed
from .schedulers import sample_loop, scheduler_for
from .compile_order import ChunkOrder
from .chunks import TEXT_ENCODER, UNET, StreamedPart, base_of, chunk_aliases, parts_of, run_into, run_parts

_env_group = base_of  # the LiteRT environment a model shares when pipelined: a chunk's is its model's


def _sum_chunk_loads(latency: dict, base: str, parts: tuple) -> None:
    """`<base>_load`: the load seconds of a chunked model's parts, when this prompt loaded them all."""
    if len(parts) > 1 and all(f"{n}_load" in latency for n in parts):
        latency[f"{base}_load"] = float(sum(latency[f"{n}_load"] for n in parts))


def bundle_tokenizer(tokenizer_json: str | Path, tok: dict):
    """The bundle's `tokenizers.Tokenizer`, padding and truncating to the manifest's max_length."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tokenizer_json))
    L = int(tok["max_length"])
    t.enable_truncation(max_length=L)
    t.enable_padding(length=L, pad_id=int(tok["pad_id"]), pad_token=str(tok.get("pad_token", "")))
    return t


def _ids(tokenizer, prompt: str, tok: dict) -> np.ndarray:
    L = int(tok["max_length"])
    enc = tokenizer.encode(prompt)
    if enc.overflowing:  # each overflow piece carries its own start and end tokens
        n = len(enc.ids) + sum(sum(o.attention_mask) - 2 for o in enc.overflowing)
        print(f"warning: prompt is {n} tokens, the text encoder takes {L}: cut to the first {L} ({prompt[:40]!r}...)",
              file=sys.stderr)
    return np.asarray(enc.ids[:L], dtype=np.int32)


def bundle_tokenize(tokenizer_json: str | Path, prompt: str, tok: dict) -> np.ndarray:
    """ids [max_length] int32, as CLIPTokenizer(padding="max_length", truncation=True) gives them."""
    return _ids(bundle_tokenizer(tokenizer_json, tok), prompt, tok)


def check_seed(seed, what: str = "seed") -> int:
    """The seed of numpy's latents: a non-negative integer, else one line naming `what`."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise PocketdiffError(f"{what} must be a non-negative integer, got {seed!r}")
    return int(seed)


def load_tiled_decoder(entries: dict, accelerator: str, names: tuple[str, ...] = TILED_DECODER) -> tuple[LoadedModel, list[LoadedModel]]:
    """The tiled decoder's head and its up path's models (`names`: the head, then the up tile or its parts)."""
    head = LoadedModel(names[0], entries[names[0]], accelerator)
    return head, [LoadedModel(n, entries[n], accelerator) for n in names[1:]]


def tiled_decode_bundle(head: LoadedModel, ups: Sequence[Callable[[], LoadedModel]], block: dict, latents: np.ndarray,
                        done: Optional[Callable] = None) -> tuple[np.ndarray, dict]:
    """[1, C, h, w] latents -> ([1, 3, H, W] pixels, {latency_s, up_tile_calls}) through the tiled models, with
    the manifest's vae_tiling block (tile, overlap, passes, factor, norms [K, G], margin, scheme). `ups`: the up
    path's models in order (one_pass: the up tile or its parts; the iterated schemes: the up tile alone), each as a
    function that gives it when its turn comes; `done(model)` once a model ran every tile."""
    from .tiled_decode import tiled_decode_with_stats

    if block.get("scheme") == ONE_PASS:  # a norm-free up path: every tile once, no statistics (runtime/onepass_decode.py)
        return one_pass_decode_loaded(head, ups, block, latents, done)
    (load,) = ups  # the iterated schemes' up path is one graph (manifest_check refuses parts)
    up = load()
    K, G = (int(v) for v in block["norms"])
    # the manifest declares (pixels, sums) in that order, with their shapes (runtime/manifest_check.py) and
    # the .tflite's names (check_component_io); the signature may list them in either order
    declared = [o.get("name") for o in up.entry.get("outputs") or []]
    if len(declared) != 2 or sorted(declared) != sorted(up.out_names):
        raise PocketdiffError(f"vae_up_tile: outputs {up.out_names} in the .tflite, the manifest declares (pixels, sums) as {declared}")
    sums_at = up.out_names.index(declared[1])
    calls = {"head": 0.0, "up": 0.0, "up_calls": 0}
    run_head = timed(calls, "head", lambda z: head({"latents": z}))
    run_up_all = timed(calls, "up", lambda features, weight, stats, own: up.run_all(
        {"features": features, "weight": weight, "stats": stats, "own": own}))

    def run_up(features, weight, stats, own):
        outs = run_up_all(features, weight, stats, own)
        return outs[1 - sums_at], outs[sums_at]

    t0 = time.perf_counter()
    image = tiled_decode_with_stats(latents, run_head, run_up, int(block["tile"]), int(block["overlap"]), int(block["factor"]),
                                    (K, G), int(block["passes"]), margin=int(block.get("margin", 0)),
                                    scheme=str(block.get("scheme", "plain")))
    total = time.perf_counter() - t0
    latency = {"vae_decoder_head_run": calls["head"], "vae_up_tiles_run": calls["up"],
               "vae_up_tile_mean": calls["up"] / max(1, calls["up_calls"]), "vae_tiled_decode": total,
               "vae_tiled_pass_mean": (total - calls["head"]) / int(block["passes"])}
    if done is not None:
        done(up)
    return image, {"latency_s": latency, "up_tile_calls": calls["up_calls"]}


class BundleRunner:
    """A bundle's models for any number of prompts (`run`); `close()` (or a `with` block) frees them.

    Plain: every model is loaded at the first prompt and stays (the naive app). `pipelined`: each model
    is loaded just before its use and released right after it (text encoder, then UNet, then decoder),
    one at a time, never two compiling at once: the peak is the largest single model's, not the sum
    (Choi et al.'s pipelined loading; Apple's reduceMemory). On the GPU, plain, the models share one
    LiteRT environment; pipelined, each has its own, destroyed with it (LiteRT frees a model's GPU
    memory only with its environment). The accelerator's compiled programs are kept in a cache folder
    (`gpu_cache`: a folder, None for the default one per bundle, False for none; runtime/gpu_cache.py),
    so a second launch loads without compiling. Memory is measured per phase (runtime/memory.py).
    `load_workers` N (plain, GPU): the models are compiled in N worker processes at once, whose loads overlap
    where one process's do not (runtime/load_workers.py); their memory is counted with this process's.
    `overlap_loads` (pipelined, GPU): each model in a worker of its own, the next one compiled during the current one,
    as far as `memory_budget_mb` lets (runtime/overlap.py). `release_file_pages` (GPU, every policy): once a model is
    compiled and fully accelerated, the pages of its .tflite that LiteRT's mapping holds go back (runtime/file_pages.py;
    the accelerator holds the weights), in this process or in the worker that compiled it: a `pages_released` phase.
    """

    def __init__(self, bundle: str | Path, accelerator: str = "gpu", pipelined: bool = False, manifest: Optional[dict] = None,
                 gpu_cache: Union[str, Path, None, bool] = None, gpu_options: Optional[dict] = None, stream_unet: bool = False,
                 load_workers: int = 0, overlap_loads: bool = False, memory_budget_mb: Optional[float] = None,
                 release_file_pages: bool = True):
        if accelerator not in ("cpu", "gpu"):
            raise PocketdiffError(f"accelerator must be cpu or gpu, got {accelerator!r}")
        # plain, pipelined, streamed, workers or overlapped (runtime/managed_model.py), checked before the bundle is read
        self.policy = loading_policy(accelerator, pipelined, stream_unet, load_workers, overlap_loads)
        budget = check_budget(memory_budget_mb, self.policy.overlap)
        self.bundle, self.accelerator = bundle, accelerator  # pipelined / streamed: the policy holds them
        self.man = manifest or check_bundle(bundle)  # fields, sizes and every .tflite's signature, before anything runs
        self.comps = self.man["components"]
        self.decoder = decoder_components(self.man)
        self.te_parts = parts_of(self.man, TEXT_ENCODER)  # ("text_encoder",) or its chunks (runtime/chunks.py)
        self.unet_parts = parts_of(self.man)  # ("unet",) or the chunks unet.0, unet.1, ...
        if stream_unet and len(self.unet_parts) == 1:
            raise PocketdiffError(f"bundle {bundle}: --stream-unet streams a UNet exported in chunks; this one is one model "
                                  "(export with unet_chunks=N)")
        for need in (*self.te_parts, *self.unet_parts, *self.decoder):
            if need not in self.comps:
                raise PocketdiffError(f"bundle {bundle}: has no {need} (exported with components={list(self.comps)})")
        tune_allocator()  # large buffers the accelerator frees go back to the system at once (runtime/memory.py)
        self.sampler = PeakSampler()
        self.phases: list[dict] = []
        self.runs_seen: dict[str, int] = {}
        self.driver, self.env, self.cache = "n/a", None, None
        self.own_envs: dict = {}  # pipelined: one environment per loaded model
        self.gpu_options = dict(gpu_options or {})  # the accelerator's options (runtime/litert_c.py: GPU_OPTION_KEYS)
        self.release_file_pages = bool(release_file_pages) and accelerator == "gpu"
        if accelerator == "gpu":
            self._prepare_gpu(gpu_cache)
        # every model the pipeline may use, loaded on use and released on request (runtime/managed_model.py)
        self.models = {n: ManagedModel(n, functools.partial(self._open, n), functools.partial(self._close, n))
                       for n in (*self.te_parts, *self.unet_parts, *self.decoder)}
        self.accelerated: dict[str, bool] = {}  # every model loaded so far: fully on the GPU delegate
        # what every prompt shares, read once: the tokenizer, the unconditional ids (CFG), the time-embedding table
        tok = self.man["tokenizer"]
        self.tokenizer = bundle_tokenizer(tok["files"]["tokenizer.json"]["_path"], tok)
        self.ids_empty = _ids(self.tokenizer, "", tok) if int(self.man["guidance"]["unet_batch"]) == 2 else None
        self.table = np.load(self.man["time_embedding"]["_path"]) if self.man.get("time_embedding") else None
        self.workers = self.overlap = None
        if self.policy.overlap:  # the budget checked from measured figures before anything loads (runtime/overlap.py)
            self.overlap = overlap_loader(overlap_units(self.te_parts, self.unet_parts, self.decoder),
                                          self.cache.folder if self.cache is not None and self.cache.enabled else None,
                                          (bundle_digest(self.comps), self.gpu_identity), budget,
                                          lambda n: (self.comps[n], self._options_for(n)), self.sampler,
                                          release_file_pages=self.release_file_pages)
        self.chunk_order = None  # pipelined, chunks kept: the order they compile in (runtime/compile_order.py)
        if self.policy.name == PIPELINED and accelerator == "gpu" and len(self.unet_parts) > 1:
            self.chunk_order = ChunkOrder(self.unet_parts, self.cache.folder if self.cache is not None and self.cache.enabled else None,
                                          (bundle_digest(self.comps), self.gpu_identity),
                                          lambda msg: print(f"warning: {msg}", file=sys.stderr))
        if self.policy.load_workers:  # last: nothing after this can fail and leave them running
            self.workers = LoadWorkers(self.policy.load_workers, on_start=self.sampler.add_process,
                                       release_file_pages=self.release_file_pages)
        self._mark("runner", "ready")

    def _prepare_gpu(self, gpu_cache) -> None:
        from .delegate import prepare_in_process
        from .gpu_cache import GpuProgramCache, bundle_cache_folder, litert_version
        from .litert_c import Environment

        self.driver = prepare_in_process()
        self.env = None if self.policy.own_environments or self.policy.overlap else Environment()
        gpu = self.sampler.gpu  # what compiled programs and measured memory figures depend on besides the bundle
        self.gpu_identity = "|".join([litert_version(), self.driver, str(gpu.name), str(gpu.driver_version()),
                                      os.environ.get("VK_ICD_FILENAMES", ""), json.dumps(self.gpu_options, sort_keys=True)])
        if gpu_cache is not False:
            folder = Path(gpu_cache) if gpu_cache not in (None, True) else bundle_cache_folder(self.bundle, self.comps)
            self.cache = GpuProgramCache(folder, self.gpu_identity)

    @property
    def loaded(self) -> dict:
        """The models resident now, by name."""
        return {n: m.model for n, m in self.models.items() if m.loaded}

    def _mark(self, component: str, phase: str, **extra) -> None:
        age = process_age_s()
        self.phases.append({"component": component, "phase": phase, "t_s": None if age is None else round(age, 3), **self.sampler.mark(),
                            **extra})
        if component in getattr(self, "models", {}):
            self.models[component].phases.append(self.phases[-1])

    def __enter__(self) -> "BundleRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for name in list(self.loaded):
            self._release(name)
        for pool in (self.workers, self.overlap):
            if pool is not None:
                pool.close()
        self.workers = None
        if self.env is not None:
            self.env.close()
            self.env = None
        self.sampler.close()

    def _options_for(self, name: str) -> dict:
        options = dict(self.gpu_options)
        if (self.comps[name].get("int8") or {}).get("storage") == "direct":  # export int8.gpu_weights: direct
            options.setdefault("allow_src_quantized_fc_conv_ops", True)  # the accelerator's int8 kernels: weights kept int8
        if self.cache is not None:
            options.update(self.cache.options_for(name, self.comps[name]))
        return options

    def _load(self, name: str, latency: dict) -> LoadedModel:
        """The managed model NAME, loaded now if it is not resident (its load's seconds into `latency`)."""
        managed = self.models[name]
        fresh, t0 = not managed.loaded, time.perf_counter()
        m = managed.get()
        if fresh:
            if self.cache is not None:
                self.cache.record(name)
            self.accelerated[name] = m.fully_accelerated
            latency[f"{name}_load"] = m.load_s
            if self.overlap is not None:  # compiled in its worker: how long the pipeline waited (the load time not hidden)
                latency[f"{name}_wait"] = time.perf_counter() - t0
        return m

    def _open(self, name: str):
        """Compile NAME: in its load worker (`workers`, `overlapped`), else here, in the environment the policy gives it."""
        if self.workers is not None or self.overlap is not None:
            m = (self.workers or self.overlap).get(name)
            self._mark(name, "compiled")
            if m.pages_released is not None:  # given back in its worker, before it answered
                self._mark(name, "pages_released", **m.pages_released)
            return m
        return LoadedModel(name, self.comps[name], self.accelerator, env=self._environment_for(name),
                           gpu_options=self._options_for(name), on_phase=lambda phase, **extra: self._mark(name, phase, **extra),
                           release_file_pages=self.release_file_pages)

    def _done(self, name: str) -> None:
        """NAME's use is over: the policy says whether it goes now (pipelined) or stays (plain, workers)."""
        if self.policy.release_after_use:
            self._release(name)

    def _environment_for(self, name: str):
        """Plain: the one shared environment. Pipelined: an environment of the model's own, destroyed with
        it: LiteRT gives a model's GPU memory back only when its environment goes (measured on an H100)."""
        if self.accelerator != "gpu":
            return None
        if not self.policy.own_environments:
            return self.env
        from .litert_c import Environment

        group = _env_group(name)  # a UNet's chunks share one, kept for all of them
        if group not in self.own_envs:
            self.own_envs[group] = Environment()
        return self.own_envs[group]

    def _release(self, name: str) -> None:
        self.models[name].release()

    def _close(self, name: str, m) -> None:
        """Free a released model, and its environment when no other resident model shares it (overlapped: its worker
        goes with its unit's last model)."""
        if self.overlap is not None:
            self.overlap.release(name, m)
        else:
            m.close()
        group = _env_group(name)
        env = None if any(_env_group(n) == group for n in self.loaded) else self.own_envs.pop(group, None)
        if env is not None:
            env.close()
        return_freed_memory()
        self._mark(name, "released")

    def _ran(self, name: str) -> None:
        """Mark a component's first run and its second (steady) one."""
        n = self.runs_seen[name] = self.runs_seen.get(name, 0) + 1
        if n <= 2:
            self._mark(name, "first_run" if n == 1 else "steady_run")

    def _encode(self, ids: np.ndarray, latency: dict) -> np.ndarray:
        """The prompt's (and, for CFG, the empty prompt's) text embeddings. A text encoder in chunks runs chunk
        after chunk on both; pipelined, each chunk is released before the next one loads (one in memory)."""
        tables = [{"input_ids": ids[None]}] + ([{"input_ids": self.ids_empty[None]}] if self.ids_empty is not None else [])
        aliases = chunk_aliases(self.man, TEXT_ENCODER)
        run_s, outs = 0.0, []
        for k, name in enumerate(self.te_parts):
            m = self._load(name, latency)
            before = len(m.run_s)
            outs = [run_into(t, m, aliases[k] if k < len(aliases) else {})[0] for t in tables]
            for _ in tables:
                self._ran(name)
            run_s += sum(m.run_s[before:])
            self._done(name)
        _sum_chunk_loads(latency, TEXT_ENCODER, self.te_parts)
        latency["text_encoder_run"] = float(run_s)
        return outs[0] if len(outs) == 1 else np.concatenate([outs[1], outs[0]])

    def _denoise(self, x: np.ndarray, ehs: np.ndarray, latency: dict, stats: dict, rng: np.random.Generator) -> np.ndarray:
        """The sampling loop through the bundle's scheduler (runtime/schedulers.py: DDIM, or the consistency step
        for `scheduler.type: lcm`, whose re-noising draws from `rng`, the run's seeded generator, after the initial
        latents)."""
        guidance = self.man["guidance"]
        B = int(guidance["unet_batch"])
        scheduler = scheduler_for(self.man["scheduler"])  # DDIM or LCM, one interface (runtime/schedulers.py)
        parts = self._streamed_unet(latency) if self.policy.stream_unet else self._load_unet(latency)
        aliases = chunk_aliases(self.man)
        scale = float(guidance["scale"])
        step_s = []

        def unet(x: np.ndarray, t: int) -> np.ndarray:
            if not step_s:
                age = process_age_s()
                stats["start_s"] = None if age is None else round(age, 3)  # process start -> the first step
            x_in = np.concatenate([x] * B) if B > 1 else x
            feeds = {"sample": x_in}
            if self.table is not None:
                feeds["timestep"] = np.repeat(self.table[int(t)][None], B, axis=0)
            else:
                feeds["timestep"] = np.full((B,), float(t), dtype=np.float32)
            feeds["encoder_hidden_states"] = ehs
            before = [len(m.run_s) for m in parts]
            out = run_parts(parts, feeds, aliases)
            step_s.append(sum(sum(m.run_s[n:]) for m, n in zip(parts, before)))
            if not self.policy.stream_unet:  # a streamed chunk marks its runs itself, before its release
                for name in self.unet_parts:
                    self._ran(name)
            return out[0:1] + scale * (out[1:2] - out[0:1]) if B == 2 else out

        x = sample_loop(scheduler, x, unet, generator=rng)
        latency["unet_steps"] = float(sum(step_s))
        latency["unet_step_mean"] = float(np.mean(step_s)) if step_s else 0.0
        for name in self.unet_parts:
            self._done(name)
        return x

    def _load_unet(self, latency: dict) -> list:
        """The UNet's parts, loaded one after another and kept for every step. Pipelined, the heap a chunk's
        compile freed goes back to the system before the next chunk compiles (one compile transient at a time)."""
        order = self.chunk_order.order if self.chunk_order is not None else self.unet_parts
        fresh = [n for n in order if not self.models[n].loaded]
        parts = {}
        for name in order:
            parts[name] = self._load(name, latency)
            if name in fresh and self.accelerator == "gpu" and len(self.unet_parts) > 1 and self.overlap is None:  # its worker settles it
                self._settle(name, parts[name])
                if self.policy.release_after_use:
                    return_freed_memory()
        if fresh and self.chunk_order is not None:  # what each compile needed, for the next launch's order
            self.chunk_order.record({n: self.models[n].phases for n in fresh})
        _sum_chunk_loads(latency, UNET, self.unet_parts)
        return [parts[n] for n in self.unet_parts]

    def _streamed_unet(self, latency: dict) -> list:
        """The UNet's chunks as StreamedParts: each loaded for each step and released after it (one chunk in
        memory at a time; `unet_streamed_loads` sums their load seconds)."""
        latency["unet_streamed_loads"] = 0.0

        def load(name: str) -> LoadedModel:
            model = self._load(name, latency)
            latency["unet_streamed_loads"] += model.load_s
            return model

        return [StreamedPart([i["name"] for i in self.comps[name]["inputs"]], functools.partial(load, name),
                             functools.partial(self._ran, name), functools.partial(self._release, name)) for name in self.unet_parts]

    def _settle(self, name: str, model: "LoadedModel") -> None:
        """One run of a fresh UNet chunk on zeros, before the next chunk compiles: LiteRT's GPU accelerator
        keeps its host copies of a model's weights until the model's first run, so settling each chunk
        keeps them from piling up under the next compile (the run's output is discarded)."""
        settle(model)  # not a step: the latency report counts the sampling runs only
        self._mark(name, "settled")

    def _decode(self, x: np.ndarray, latency: dict, stats: dict) -> np.ndarray:
        if self.decoder != (VAE_DECODER,):
            return self._decode_tiled(x, latency, stats)
        dec = self._load("vae_decoder", latency)
        before = len(dec.run_s)
        image = dec({"latents": x})[0].transpose(1, 2, 0)
        latency["vae_decoder_run"] = float(sum(dec.run_s[before:]))
        self._ran("vae_decoder")
        self._done("vae_decoder")
        return image

    def _decode_tiled(self, x: np.ndarray, latency: dict, stats: dict) -> np.ndarray:
        """The tiled decoder: its head once on the whole latent (every scheme runs it once, first), then the up
        tile over the tiles (an up path in parts: each part over every tile, in turn). Pipelined, the head is
        released before the up path loads and each part before the next, so no two decoder graphs share the GPU
        (the features and the parts' outputs wait in host memory)."""
        head_name, up_names = self.decoder[0], self.decoder[1:]
        head = self._load(head_name, latency)
        features = head({"latents": x})
        head_s = head.run_s[-1]
        self._ran(head_name)
        self._done(head_name)

        def done(model) -> None:
            self._ran(model.name)
            self._done(model.name)

        ups = [functools.partial(self._load, n, latency) for n in up_names]  # each part loads when its turn comes
        pixels, timing = tiled_decode_bundle(lambda feeds: features, ups, self.man["vae_tiling"], x, done)
        tiles = timing["latency_s"]
        tiles.update(vae_decoder_head_run=head_s, vae_tiled_decode=tiles["vae_tiled_decode"] + head_s)
        latency.update(tiles)
        stats["vae_up_tile_calls"] = timing["up_tile_calls"]
        return pixels[0].transpose(1, 2, 0)

    def run(self, prompt: str, seed: int = 0, init_latents: Optional[np.ndarray] = None) -> tuple[np.ndarray, dict]:
        """One prompt: (image [H, W, 3] float32 in [0, 1], stats). Loads what is not resident;
        `latency_s` holds this prompt's loads and runs only; `memory` the measured phases so far."""
        check_seed(seed)
        lat, tok = self.man["latent"], self.man["tokenizer"]
        latency: dict = {}
        stats: dict = {"latency_s": latency, "driver": self.driver}
        t_total = time.perf_counter()
        t0 = time.perf_counter()
        ids = _ids(self.tokenizer, prompt, tok)
        latency["tokenize"] = time.perf_counter() - t0
        if self.overlap is not None:  # the first model's worker starts (and the next one's, as the budget lets)
            self.overlap.begin()
        if self.policy.up_front:  # plain (the naive app) and workers: everything up front
            names = (*self.te_parts, *self.unet_parts, *self.decoder)
            if self.workers is not None:  # all at once, spread over the workers in the order of use
                self.workers.submit([(n, self.comps[n], self._options_for(n)) for n in names if n not in self.loaded])
            for name in names:
                self._load(name, latency)
        ehs = self._encode(ids, latency)
        shape = (1, int(lat["channels"]), int(lat["height"]), int(lat["width"]))
        rng = np.random.default_rng(seed)  # the initial latents, then (lcm) the noise between steps
        drawn = rng.standard_normal(shape).astype(np.float32)  # drawn even when given: the later draws stay the seed's
        x = drawn if init_latents is None else np.asarray(init_latents, np.float32).reshape(shape)
        x = self._denoise(x, ehs, latency, stats, rng)
        image = self._decode(x, latency, stats)
        stats["fully_accelerated"] = self.accelerator == "gpu" and all(self.accelerated.values())
        stats["fully_accelerated_by_component"] = dict(self.accelerated)
        latency["total"] = time.perf_counter() - t_total
        age = process_age_s()
        stats["total_s"] = None if age is None else round(age, 3)  # process start -> this image
        if self.overlap is not None:  # each model's measured memory, for --memory-budget-mb (runtime/overlap.py)
            own_gpu = self.sampler.gpu.pid_mb(os.getpid()) if self.sampler.gpu.available else None
            self.overlap.record(max(self.sampler.host_peak_total_mb, host_peak_mb() or 0.0) + (own_gpu or 0.0))
        stats["memory"] = self.memory_report()
        stats["finite"] = bool(np.isfinite(image).all())
        return np.clip(image, 0.0, 1.0), stats

    def memory_report(self) -> dict:
        """Measured: the whole run's peaks (host, GPU, host + GPU) and every phase; the cache's state."""
        released = [p["released_mb"] for p in self.phases if p["phase"] == "pages_released"]
        return {**self.sampler.totals(), "phases": list(self.phases),
                "release_file_pages": self.release_file_pages, "pages_released_mb": round(sum(released), 1),
                "gpu_cache": self.cache.summary() if self.cache is not None else None,
                "loading_policy": self.policy.name, "models": {n: m.memory() for n, m in self.models.items() if m.loads},
                **({"overlap": self.overlap.report()} if self.overlap is not None else {}),
                **({"unet_compile_order": self.chunk_order.report()} if self.chunk_order is not None else {})}


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
    workers = getattr(args, "load_workers", None)
    if workers is not None:
        check_count(workers)  # `--load-workers 0` is refused, not run as plain without a word
    overlap = bool(getattr(args, "overlap_loads", False))
    loading_policy(args.accelerator, args.pipelined, getattr(args, "stream_unet", False), workers, overlap)
    check_budget(getattr(args, "memory_budget_mb", None), overlap)
    if getattr(args, "gpu_cache", None) is not None and getattr(args, "no_gpu_cache", False):
        raise PocketdiffError(f"--gpu-cache {args.gpu_cache} and --no-gpu-cache contradict each other: give one of them")


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
    startup["bundle_checked"] = process_age_s()  # sha256 (of the files changed since the last launch) and .tflite checks
    fresh = not Path(args.output).exists()
    out = prepare_output_dir(args.output, overwrite=args.overwrite, inputs=[("bundle", args.bundle)], verb="run-bundle")
    fully = None
    try:
        cache = False if getattr(args, "no_gpu_cache", False) else getattr(args, "gpu_cache", None)
        with BundleRunner(args.bundle, args.accelerator, args.pipelined, man, gpu_cache=cache, gpu_options=gpu_options,
                          stream_unet=getattr(args, "stream_unet", False), load_workers=getattr(args, "load_workers", None) or 0,
                          overlap_loads=getattr(args, "overlap_loads", False),
                          memory_budget_mb=getattr(args, "memory_budget_mb", None),
                          release_file_pages=not getattr(args, "keep_file_pages", False)) as runner:
            image, stats = runner.run(args.prompt, seed=args.seed)
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
        "bundle": str(Path(args.bundle).resolve()),
        "accelerator": args.accelerator,
        "driver": stats["driver"],
        "pipelined": bool(args.pipelined),
        "stream_unet": bool(getattr(args, "stream_unet", False)),
        "load_workers": int(getattr(args, "load_workers", 0) or 0),
        "overlap_loads": bool(getattr(args, "overlap_loads", False)),
        "memory_budget_mb": getattr(args, "memory_budget_mb", None),
        "loading_policy": runner.policy.name,
        "fully_accelerated": fully,
        "fully_accelerated_by_component": stats["fully_accelerated_by_component"],
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
