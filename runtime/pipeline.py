"""The bundle's pipeline, read from its manifest: prompt -> image through the stages it declares (numpy only).

The manifest's `pipeline` block (runtime/pipeline_spec.py; derived for bundles from before it) lists the stages in
order; each names its component and feeds every graph input by role. This module runs them: encode-prompt stages
(each on the prompt and, for classifier-free guidance, the empty prompt, or zero rows under the manifest's
conditioning.zero_unconditional: runtime/guidance.py), the denoise stage
under the manifest's scheduler (runtime/schedulers.py), the decode stage (a whole decoder, or its tiled graphs:
runtime/tiled_bundle.py); for image-to-image and inpainting the encode-image stage first, and the loop's start and blend
from its latents (runtime/image_tasks.py). It never loads a model itself: it asks the `ModelPool` (runtime/model_pool.py) for each by
name and says when its use is over, so the loading policy stays the pool's.
"""
from __future__ import annotations

import functools
import time
from typing import Optional

import numpy as np

from pocketdiff.errors import PocketdiffError

from .chunks import chunk_aliases, run_into, run_parts
from .components import ENCODE_IMAGE, VAE_DECODER
from .guidance import Guidance
from .image_tasks import ImageStart
from .lora_slots import LoraFeeds
from .memory import host_peak_mb, process_age_s
from .model_pool import ModelPool
from .pipeline_spec import DECODE, DENOISE, ENCODE_PROMPT, PROMPT, ROLES, inpainting_unet, pipeline_of, stage_parts
from .schedulers import sample_loop, scheduler_for
from .tiled_bundle import tiled_decode_bundle
from .tokens import bundle_tokenizer, prompt_ids


def _sum_loads(latency: dict, base: str, parts: tuple) -> None:
    """`<base>_load`: the load seconds of a chunked model's parts, when this prompt loaded them all."""
    if len(parts) > 1 and all(f"{n}_load" in latency for n in parts):
        latency[f"{base}_load"] = float(sum(latency[f"{n}_load"] for n in parts))


class BundlePipeline:
    """The stages of one bundle (`man`, checked), run with the models of `pool`; `image_input`: runs start from the
    user's picture (the encode-image stage is run; else it is left out, and its model never loads)."""

    def __init__(self, man: dict, bundle=None, image_input: bool = False):
        self.man, self.bundle = man, bundle
        block = pipeline_of(man)
        self.stages = block["stages"]
        self.image_encoders = [s for s in self.stages if s["kind"] == ENCODE_IMAGE] if image_input else []
        self.image_encoder = self.image_encoders[0] if self.image_encoders else None
        if image_input and self.image_encoder is None:
            raise PocketdiffError(f"bundle {bundle}: no encode_image stage (tasks {block.get('tasks')}): it cannot start "
                                  "from a picture; export it with tasks: [text_to_image, image_to_image, inpaint]")
        self.inpaint_unet = inpainting_unet(man)  # a 9-channel UNet: the mask and the masked picture's latents as inputs
        if self.inpaint_unet and not image_input:
            raise PocketdiffError(f"bundle {bundle}: its UNet inpaints (tasks {block.get('tasks')}): it runs from a picture "
                                  "and a mask only (--init-image PATH --mask PATH)")
        self.stages = [s for s in self.stages if s["kind"] != ENCODE_IMAGE or image_input]
        self.encoders = [s for s in self.stages if s["kind"] == ENCODE_PROMPT]
        self.denoiser = next(s for s in self.stages if s["kind"] == DENOISE)
        self.decoder = next(s for s in self.stages if s["kind"] == DECODE)
        for stage in self.stages:  # a role no runner can feed: refused before any model loads
            for name, role in stage["inputs"].items():
                if ROLES[role].source == "none":
                    raise PocketdiffError(f"bundle {bundle}: stage {stage['stage']}, component {stage['component']}, input {name}: "
                                          f"no runner feeds role {role} (re-export with rewrites.time_embedding_outside: true)")
        self.parts = {s["stage"]: stage_parts(man, s["component"]) for s in self.stages}
        conditioning = block.get("conditioning") or {}
        self.guidance = Guidance(man["guidance"], zero_unconditional=bool(conditioning.get("zero_unconditional")))
        self.tokenizers = {s["stage"]: bundle_tokenizer(man[s["tokenizer"]]["files"]["tokenizer.json"]["_path"], man[s["tokenizer"]])
                           for s in self.encoders}
        # each encode stage's ids of the empty prompt (cfg), read once, as the runner always did: every prompt reuses them
        self.empty_ids = {s["stage"]: prompt_ids(self.tokenizers[s["stage"]], "", man[s["tokenizer"]]) for s in self.encoders}
        self.table = np.load(man["time_embedding"]["_path"]) if man.get("time_embedding") else None
        ids = conditioning.get("time_ids")
        self.constants = {"time_ids": np.asarray(ids, np.float32)[None]} if ids is not None else {}
        self.lora = LoraFeeds(man, bundle)  # a slotted UNet's LoRA factors (runtime/lora_slots.py): zeros until one is loaded
        self.pool: Optional[ModelPool] = None

    def names(self) -> tuple[str, ...]:
        """Every model the stages run, in the order of use."""
        return tuple(p for s in self.stages for p in self.parts[s["stage"]])

    def units(self) -> list[tuple[str, tuple[str, ...]]]:
        """(unit, its models) in the order of use, for the overlapped loader: the denoiser's chunks are one unit."""
        out = []
        for s in self.stages:
            parts = self.parts[s["stage"]]
            out += [(s["component"], parts)] if s["kind"] == DENOISE else [(p, (p,)) for p in parts]
        return out

    def denoiser_parts(self) -> tuple[str, ...]:
        return self.parts[self.denoiser["stage"]]

    # ------------------------------------------------------------------ stages

    def token_rows(self, prompt: str) -> dict[str, list[np.ndarray]]:
        """Per encode stage, the ids of each prompt it runs on (the prompt, then for cfg the empty one)."""
        return {s["stage"]: [self.empty_ids[s["stage"]] if p == "" else prompt_ids(self.tokenizers[s["stage"]], p, self.man[s["tokenizer"]])
                             for p in self.guidance.prompts(prompt)] for s in self.encoders}

    def encode(self, rows: dict[str, list[np.ndarray]], latency: dict) -> dict[str, np.ndarray]:
        """Every prompt role the encode stages make, stacked as the UNet's batch ([uncond, cond] for cfg); a role
        two stages make is their outputs concatenated on the last axis, in stage order."""
        per_role: dict[str, list] = {}
        for stage in self.encoders:
            outs = self._encode_stage(stage, rows[stage["stage"]], latency)
            for k, role in enumerate(stage["outputs"]):
                got = [row[k] for row in outs]
                per_role[role] = got if role not in per_role else [np.concatenate([a, b], axis=-1) for a, b in zip(per_role[role], got)]
        return {role: self.guidance.stack(values) for role, values in per_role.items()}

    def _encode_stage(self, stage: dict, ids_rows: list[np.ndarray], latency: dict) -> list[list[np.ndarray]]:
        """One encode stage on each row: its chunks in turn over every row (pipelined, each released before the next
        loads); per row, the outputs in the stage's order."""
        pool, comp, parts = self.pool, stage["component"], self.parts[stage["stage"]]
        fed = [n for n, role in stage["inputs"].items() if role == "token_ids"]
        tables = [{n: ids[None] for n in fed} for ids in ids_rows]
        aliases = chunk_aliases(self.man, comp)
        run_s, outs, last = 0.0, [], None
        for k, name in enumerate(parts):
            last = pool.load(name, latency)
            before = len(last.run_s)
            outs = [run_into(t, last, aliases[k] if k < len(aliases) else {}) for t in tables]
            for _ in tables:
                pool.ran(name)
            run_s += sum(last.run_s[before:])
            pool.done(name)
        _sum_loads(latency, comp, parts)
        latency[f"{comp}_run"] = float(run_s)
        declared = [o["name"] for o in self.man["components"][parts[-1]]["outputs"]]
        if len(declared) == 1:
            return [[o[0]] for o in outs]
        return [[dict(zip(last.out_names, o))[n] for n in declared] for o in outs]

    def _fixed_feeds(self, cond: dict[str, np.ndarray], start: Optional[ImageStart] = None) -> dict[str, np.ndarray]:
        """The denoiser's inputs that stay the same at every step: the prompt roles, the declared constants and an
        inpainting UNet's mask and masked-picture latents (batched)."""
        feeds, picture = {}, start.unet_inputs if start is not None else {}
        for name, role in self.denoiser["inputs"].items():
            if ROLES[role].per == PROMPT:
                feeds[name] = cond[role]
            elif role in self.constants:
                feeds[name] = self.guidance.repeat(self.constants[role])
            elif role in picture:
                feeds[name] = self.guidance.repeat(picture[role])
            elif role == "lora_factors":
                feeds[name] = self.lora.feeds[name]
        return feeds

    def _step_feeds(self, x: np.ndarray, t: int) -> dict[str, np.ndarray]:
        """The denoiser's inputs of one step: the latents and the timestep (or its table row), batched."""
        B, feeds = self.guidance.batch, {}
        for name, role in self.denoiser["inputs"].items():
            if role == "latents":
                feeds[name] = self.guidance.repeat(x)
            elif role == "timestep_embedding":
                feeds[name] = np.repeat(self.table[int(t)][None], B, axis=0)
            elif role == "timestep":
                feeds[name] = np.full((B,), float(t), dtype=np.float32)
        return feeds

    def encode_pictures(self, pictures: dict[str, np.ndarray], latency: dict) -> dict[str, np.ndarray]:
        """Every encode-image stage on the picture role it reads (`pictures`: role -> [1, 3, H, W]): role -> latents.
        The stages share one encoder, loaded once for all of them."""
        pool, name = self.pool, self.parts[self.image_encoder["stage"]][0]
        enc = pool.load(name, latency)
        before, out = len(enc.run_s), {}
        for stage in self.image_encoders:
            (fed, role), = stage["inputs"].items()
            out[stage["outputs"][0]] = np.asarray(enc({fed: pictures[role]}), np.float32)
            pool.ran(name)
        latency[f"{name}_run"] = float(sum(enc.run_s[before:]))
        pool.done(name)
        return out

    def denoise(self, x: np.ndarray, cond: dict, latency: dict, stats: dict, rng: np.random.Generator,
                start: Optional[ImageStart] = None) -> np.ndarray:
        """The sampling loop through the bundle's scheduler (DDIM, or the consistency step for `scheduler.type: lcm`,
        whose re-noising draws from `rng`, the run's seeded generator, after the initial latents); from a picture
        (`start`) its partial schedule and, inpainting, the blend after each step."""
        pool, comp, names = self.pool, self.denoiser["component"], self.denoiser_parts()
        scheduler = start.scheduler if start is not None else scheduler_for(self.man["scheduler"])
        if pool.policy.stream_unet:
            parts = pool.streamed(names, latency)
        else:
            parts = pool.load_group(names, latency)
            _sum_loads(latency, comp, names)
        aliases, fixed, step_s = chunk_aliases(self.man, comp), self._fixed_feeds(cond, start), []

        def model(x: np.ndarray, t: int) -> np.ndarray:
            if not step_s:
                age = process_age_s()
                stats["start_s"] = None if age is None else round(age, 3)  # process start -> the first step
            before = [len(m.run_s) for m in parts]
            out = run_parts(parts, {**self._step_feeds(x, t), **fixed}, aliases)
            step_s.append(sum(sum(m.run_s[n:]) for m, n in zip(parts, before)))
            if not pool.policy.stream_unet:  # a streamed chunk marks its runs itself, before its release
                for name in names:
                    pool.ran(name)
            return self.guidance.combine(out)

        x = sample_loop(scheduler, x, model, generator=rng, after_step=start.blend if start is not None else None)
        latency[f"{comp}_steps"] = float(sum(step_s))
        latency[f"{comp}_step_mean"] = float(np.mean(step_s)) if step_s else 0.0
        for name in names:
            pool.done(name)
        return x

    def decode(self, x: np.ndarray, latency: dict, stats: dict) -> np.ndarray:
        """The latents' image [H, W, 3]: a whole decoder, or the tiled one's head then up path."""
        pool, names = self.pool, self.parts[self.decoder["stage"]]
        fed = next(n for n, role in self.decoder["inputs"].items() if role == "latents")
        if names == (VAE_DECODER,):
            dec = pool.load(VAE_DECODER, latency)
            before = len(dec.run_s)
            image = dec({fed: x})[0].transpose(1, 2, 0)
            latency["vae_decoder_run"] = float(sum(dec.run_s[before:]))
            pool.ran(VAE_DECODER)
            pool.done(VAE_DECODER)
            return image
        return self._decode_tiled(x, fed, names, latency, stats)

    def _decode_tiled(self, x: np.ndarray, fed: str, names: tuple, latency: dict, stats: dict) -> np.ndarray:
        """The tiled decoder: its head once on the whole latent, then the up tile over the tiles (an up path in parts:
        each part over every tile, in turn). Pipelined, the head is released before the up path loads and each part
        before the next, so no two decoder graphs share the GPU (the features wait in host memory)."""
        pool, head_name, up_names = self.pool, names[0], names[1:]
        head = pool.load(head_name, latency)
        features = head({fed: x})
        head_s = head.run_s[-1]
        pool.ran(head_name)
        pool.done(head_name)

        def done(model) -> None:
            pool.ran(model.name)
            pool.done(model.name)

        ups = [functools.partial(pool.load, n, latency) for n in up_names]  # each part loads when its turn comes
        pixels, timing = tiled_decode_bundle(lambda feeds: features, ups, self.man["vae_tiling"], x, done)
        tiles = timing["latency_s"]
        tiles.update(vae_decoder_head_run=head_s, vae_tiled_decode=tiles["vae_tiled_decode"] + head_s)
        latency.update(tiles)
        stats["vae_up_tile_calls"] = timing["up_tile_calls"]
        return pixels[0].transpose(1, 2, 0)

    def _image_start(self, init_image, strength, mask, masked_image, noise, latency) -> ImageStart:
        """The loop's start from the picture: its latents (and an inpainting UNet's masked-picture latents and mask)."""
        if self.inpaint_unet and (mask is None or masked_image is None):
            raise PocketdiffError(f"bundle {self.bundle}: its UNet inpaints: a run needs the mask and the masked picture "
                                  "(run-bundle --init-image PATH --mask PATH)")
        pictures = {"init_image": init_image, **({"masked_image": masked_image} if self.inpaint_unet else {})}
        latents = self.encode_pictures(pictures, latency)
        extra = {"mask": np.asarray(mask, np.float32), "masked_image_latents": latents["masked_image_latents"]} if self.inpaint_unet else {}
        return ImageStart(scheduler_for(self.man["scheduler"], strength), latents["image_latents"], noise, mask, strength, extra)

    # ------------------------------------------------------------------ one prompt

    def run(self, prompt: str, seed: int, init_latents: Optional[np.ndarray] = None, init_image: Optional[np.ndarray] = None,
            strength: float = 1.0, mask: Optional[np.ndarray] = None, masked_image: Optional[np.ndarray] = None) -> tuple[np.ndarray, dict]:
        """One prompt through every stage: (image [H, W, 3] float32 in [0, 1], stats). From a picture (`init_image`
        [1, 3, H, W] in [0, 1], `strength`; `mask` [1, 1, h, w], 1 = repaint; an inpainting UNet's `masked_image`
        [1, 3, H, W], image_tasks.masked_picture): the drawn (or given) latents are the noise it is noised with
        (runtime/image_tasks.py)."""
        pool, lat = self.pool, self.man["latent"]
        latency: dict = {}
        stats: dict = {"latency_s": latency, "driver": pool.driver}
        t_total = t0 = time.perf_counter()
        rows = self.token_rows(prompt)
        latency["tokenize"] = time.perf_counter() - t0
        pool.begin()
        pool.load_up_front(self.names(), latency)
        cond = self.encode(rows, latency)
        shape = (1, int(lat["channels"]), int(lat["height"]), int(lat["width"]))
        rng = np.random.default_rng(seed)  # the initial latents, then (lcm) the noise between steps
        drawn = rng.standard_normal(shape).astype(np.float32)  # drawn even when given: the later draws stay the seed's
        x = drawn if init_latents is None else np.asarray(init_latents, np.float32).reshape(shape)
        start = None
        if init_image is not None:
            if self.image_encoder is None:
                raise PocketdiffError(f"bundle {self.bundle}: the pipeline was built without image_input: it cannot start from a picture")
            start = self._image_start(init_image, strength, mask, masked_image, x, latency)
            x = start.start()
        x = self.denoise(x, cond, latency, stats, rng, start)
        image = self.decode(x, latency, stats)
        stats["fully_accelerated"] = pool.accelerator == "gpu" and all(pool.accelerated.values())
        stats["fully_accelerated_by_component"] = dict(pool.accelerated)  # the GPU's models (--on-cpu ones are not here)
        stats["accelerator_by_model"] = dict(pool.placed)  # cpu | gpu, every model loaded so far
        latency["total"] = time.perf_counter() - t_total
        age = process_age_s()
        stats["total_s"] = None if age is None else round(age, 3)  # process start -> this image
        pool.record_overlap(host_peak_mb() or 0.0)
        stats["memory"] = pool.memory_report()
        stats["finite"] = bool(np.isfinite(image).all())
        return np.clip(image, 0.0, 1.0), stats
