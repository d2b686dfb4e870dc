"""`pocketdiff run-bundle BUNDLE --prompt TEXT --output DIR`: text -> PNG from a bundle alone.

The reference runner of an exported bundle. It uses only the bundle's files, numpy,
`tokenizers` (the bundle's tokenizer.json), ai-edge-litert and PIL (to write the PNG):
no torch, no diffusers. DDIM with the manifest's timesteps, classifier-free guidance in one
batch-2 UNet call (or the student's embedded guidance), the time embedding looked up in the
bundle's table when it was computed outside the graph.

`--pipelined` keeps the UNet resident, loads + runs the text encoder in a background thread
while the UNet compiles, releases it, and loads the decoder in a background thread during
the last denoising step. Without it the three models are loaded up front (the naive app).
A bundle with a `vae_tiling` block decodes with its two decoder graphs (`vae_decoder_head` on the
whole latent, `vae_up_tile` per tile and pass: export/tiled_decode.tiled_decode_with_stats); they
load and release together where the decoder does, and the stats time the head, the tiles and a pass.
The report has per-stage latency, the process's peak RSS and the peak of model bytes held at
once.
"""
from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from pocketdiff.errors import PocketdiffError

from .manifest_check import TILED_DECODER, check_bundle, decoder_components


def bundle_tokenizer(tokenizer_json: str | Path, tok: dict):
    """The bundle's `tokenizers.Tokenizer`, padding and truncating to the manifest's max_length."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tokenizer_json))
    L = int(tok["max_length"])
    t.enable_truncation(max_length=L)
    t.enable_padding(length=L, pad_id=int(tok["pad_id"]), pad_token=str(tok.get("pad_token", "")))
    return t


def _ids(tokenizer, prompt: str, tok: dict) -> np.ndarray:
    return np.asarray(tokenizer.encode(prompt).ids[: int(tok["max_length"])], dtype=np.int32)


def bundle_tokenize(tokenizer_json: str | Path, prompt: str, tok: dict) -> np.ndarray:
    """ids [max_length] int32, as CLIPTokenizer(padding="max_length", truncation=True) gives them."""
    return _ids(bundle_tokenizer(tokenizer_json, tok), prompt, tok)


def _np_dtype(name: str):
    return np.dtype(name)


class _Loaded:
    """A compiled model with its buffers."""

    def __init__(self, name: str, entry: dict, accelerator: str, cpu_int8_as_fp16: bool = True):
        from ai_edge_litert.compiled_model import CompiledModel, GpuOptions, HardwareAccelerator, Options

        t0 = time.perf_counter()
        path = entry["_path"]
        self._tmp = None
        if accelerator == "cpu" and cpu_int8_as_fp16 and entry.get("weights") == "int8":
            import tempfile

            from .cpu_variant import fp16_variant

            self._tmp = tempfile.TemporaryDirectory(prefix="pocketdiff-cpu-")
            path = str(Path(self._tmp.name) / Path(path).name)
            fp16_variant(entry["_path"], path)  # XNNPACK: fp16 storage runs ~fp16-file speed, int8 DEQUANTIZE does not
        if accelerator == "gpu":
            opts = Options(hardware_accelerators=HardwareAccelerator.GPU, gpu_options=GpuOptions())
        else:
            opts = Options(hardware_accelerators=HardwareAccelerator.CPU)
        self.name, self.entry = name, entry
        self.bytes = int(entry.get("bytes") or Path(entry["_path"]).stat().st_size)
        self.model = CompiledModel.from_file(path, options=opts)
        self.fully_accelerated = bool(self.model.is_fully_accelerated()) if accelerator == "gpu" else False
        sigs = self.model.get_signature_list()
        self.sig = next(iter(sigs))
        self.in_names = list(sigs[self.sig]["inputs"])
        self.out_names = list(sigs[self.sig]["outputs"])
        self.in_details = self.model.get_input_tensor_details(self.sig)
        self.out_details = self.model.get_output_tensor_details(self.sig)
        self.in_bufs = self.model.create_input_buffers(0)
        self.out_bufs = self.model.create_output_buffers(0)
        self.load_s = time.perf_counter() - t0
        self.run_s: list[float] = []

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return self.run_all(feeds)[0]

    def run_all(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Every output, in the signature's order."""
        names = list(feeds)
        for i, (buf, name) in enumerate(zip(self.in_bufs, self.in_names)):
            key = name if name in feeds else names[i]
            det = self.in_details[name]
            arr = np.ascontiguousarray(np.asarray(feeds[key]).astype(_np_dtype(det["dtype"])))
            if list(arr.shape) != [int(s) for s in det["shape"]]:
                raise PocketdiffError(f"{self.name}: input {name} has shape {list(arr.shape)}, the model takes {list(det['shape'])}")
            buf.write(arr)
        t0 = time.perf_counter()
        self.model.run_by_index(0, self.in_bufs, self.out_bufs)
        self.run_s.append(time.perf_counter() - t0)
        outs = []
        for buf, name in zip(self.out_bufs, self.out_names):
            shape = [int(s) for s in self.out_details[name]["shape"]]
            outs.append(np.asarray(buf.read(int(np.prod(shape)), _np_dtype(self.out_details[name]["dtype"]))).reshape(shape))
        return outs

    def close(self) -> None:
        self.in_bufs = self.out_bufs = None
        self.model = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class _Residency:
    """Peak of model bytes held at once."""

    def __init__(self):
        self.now = 0
        self.peak = 0
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.now += n
            self.peak = max(self.peak, self.now)

    def sub(self, n: int) -> None:
        with self.lock:
            self.now -= n


def load_tiled_decoder(entries: dict, accelerator: str) -> tuple[_Loaded, _Loaded]:
    return tuple(_Loaded(n, entries[n], accelerator) for n in TILED_DECODER)


def tiled_decode_bundle(head: _Loaded, up: _Loaded, block: dict, latents: np.ndarray) -> tuple[np.ndarray, dict]:
    """[1, C, h, w] latents -> ([1, 3, H, W] pixels, {latency_s, up_tile_calls}) through the two tiled models, with
    the manifest's vae_tiling block (tile, overlap, passes, factor, norms [K, G], margin, scheme)."""
    from .tiled_decode import tiled_decode_with_stats

    if block.get("scheme") == "one_pass":  # a norm-free up path: every tile once, no statistics (export/onepass_decode.py)
        from .onepass_decode import one_pass_decode_loaded

        return one_pass_decode_loaded(head, up, block, latents)
    K, G = (int(v) for v in block["norms"])
    # the manifest declares (pixels, sums) in that order, with their shapes (export/manifest_check.py) and
    # the .tflite's names (check_component_io); the signature may list them in either order
    declared = [o.get("name") for o in up.entry.get("outputs") or []]
    if len(declared) != 2 or sorted(declared) != sorted(up.out_names):
        raise PocketdiffError(f"vae_up_tile: outputs {up.out_names} in the .tflite, the manifest declares (pixels, sums) as {declared}")
    sums_at = up.out_names.index(declared[1])
    calls = {"head": 0.0, "up": 0.0, "up_calls": 0}

    def run_head(z):
        t0 = time.perf_counter()
        feats = head({"latents": z})
        calls["head"] += time.perf_counter() - t0
        return feats

    def run_up(features, weight, stats, own):
        t0 = time.perf_counter()
        outs = up.run_all({"features": features, "weight": weight, "stats": stats, "own": own})
        calls["up"] += time.perf_counter() - t0
        calls["up_calls"] += 1
        return outs[1 - sums_at], outs[sums_at]

    t0 = time.perf_counter()
    image = tiled_decode_with_stats(latents, run_head, run_up, int(block["tile"]), int(block["overlap"]), int(block["factor"]),
                                    (K, G), int(block["passes"]), margin=int(block.get("margin", 0)),
                                    scheme=str(block.get("scheme", "plain")))
    total = time.perf_counter() - t0
    latency = {"vae_decoder_head_run": calls["head"], "vae_up_tiles_run": calls["up"],
               "vae_up_tile_mean": calls["up"] / max(1, calls["up_calls"]), "vae_tiled_decode": total,
               "vae_tiled_pass_mean": (total - calls["head"]) / int(block["passes"])}
    return image, {"latency_s": latency, "up_tile_calls": calls["up_calls"]}


def ddim_step(x: np.ndarray, out: np.ndarray, a_t: float, a_prev: float, prediction_type: str) -> np.ndarray:
    if prediction_type == "epsilon":
        eps = out
        x0 = (x - np.sqrt(1.0 - a_t) * eps) / np.sqrt(a_t)
    elif prediction_type == "v_prediction":
        x0 = np.sqrt(a_t) * x - np.sqrt(1.0 - a_t) * out
        eps = np.sqrt(a_t) * out + np.sqrt(1.0 - a_t) * x
    else:
        raise PocketdiffError(f"bundle: prediction type {prediction_type!r} is not supported")
    return (np.sqrt(a_prev) * x0 + np.sqrt(1.0 - a_prev) * eps).astype(np.float32)


class BundleRunner:
    """A bundle's models, loaded once, for any number of prompts (`run`); `close()` (or a `with`
    block) frees them.

    Plain: every model is loaded at the first prompt and stays. `pipelined`: the UNet stays and the
    text encoder (loaded in a thread while the UNet compiles) and the decoder (loaded during the
    last denoising step) are loaded and freed around each prompt, so at most the UNet and one other
    model are resident (Choi et al.'s pipelined loading).
    """

    def __init__(self, bundle: str | Path, accelerator: str = "gpu", pipelined: bool = False, manifest: Optional[dict] = None):
        if accelerator not in ("cpu", "gpu"):
            raise PocketdiffError(f"accelerator must be cpu or gpu, got {accelerator!r}")
        self.bundle, self.accelerator, self.pipelined = bundle, accelerator, pipelined
        self.man = manifest or check_bundle(bundle)  # fields, sizes and every .tflite's signature, before anything runs
        self.comps = self.man["components"]
        self.decoder = decoder_components(self.man)
        for need in ("text_encoder", "unet", *self.decoder):
            if need not in self.comps:
                raise PocketdiffError(f"bundle {bundle}: has no {need} (exported with components={list(self.comps)})")
        self.driver = "n/a"
        if accelerator == "gpu":
            from .delegate import prepare_in_process

            self.driver = prepare_in_process()
        self.loaded: dict[str, _Loaded] = {}
        self.accelerated: dict[str, bool] = {}  # every model loaded so far: fully on the GPU delegate
        self.res = _Residency()
        # what every prompt shares, read once: the tokenizer, the unconditional ids (CFG), the time-embedding table
        tok = self.man["tokenizer"]
        self.tokenizer = bundle_tokenizer(tok["files"]["tokenizer.json"]["_path"], tok)
        self.ids_empty = _ids(self.tokenizer, "", tok) if int(self.man["guidance"]["unet_batch"]) == 2 else None
        self.table = np.load(self.man["time_embedding"]["_path"]) if self.man.get("time_embedding") else None

    def __enter__(self) -> "BundleRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for name in list(self.loaded):
            self._release(name)

    def _load(self, name: str, latency: dict) -> _Loaded:
        if name not in self.loaded:
            m = _Loaded(name, self.comps[name], self.accelerator)
            self.res.add(m.bytes)
            self.loaded[name] = m
            self.accelerated[name] = m.fully_accelerated
            latency[f"{name}_load"] = m.load_s
        return self.loaded[name]

    def _release(self, name: str) -> None:
        m = self.loaded.pop(name, None)
        if m is not None:
            m.close()
            self.res.sub(m.bytes)

    def run(self, prompt: str, seed: int = 0, init_latents: Optional[np.ndarray] = None) -> tuple[np.ndarray, dict]:
        """One prompt: (image [H, W, 3] float32 in [0, 1], stats). Loads what is not resident;
        `latency_s` holds this prompt's loads and runs only."""
        man, decoder, pipelined = self.man, self.decoder, self.pipelined
        sched, guidance, lat, tok = man["scheduler"], man["guidance"], man["latent"], man["tokenizer"]
        B = int(guidance["unet_batch"])
        latency: dict = {}
        stats: dict = {"latency_s": latency, "driver": self.driver}
        t_total = time.perf_counter()

        # tokenizer
        t0 = time.perf_counter()
        ids, ids_empty = _ids(self.tokenizer, prompt, tok), self.ids_empty
        latency["tokenize"] = time.perf_counter() - t0

        text: dict = {}
        errors: list[BaseException] = []

        def encode() -> None:
            te = self._load("text_encoder", latency)
            before = len(te.run_s)
            text["cond"] = te({"input_ids": ids[None]})
            if ids_empty is not None:
                text["uncond"] = te({"input_ids": ids_empty[None]})
            latency["text_encoder_run"] = float(sum(te.run_s[before:]))
            if pipelined:
                self._release("text_encoder")

        def load_decoder() -> None:
            for name in decoder:
                self._load(name, latency)

        if pipelined:
            th = threading.Thread(target=_recording, args=(errors, encode), name="text-encoder")
            th.start()
            unet = self._load("unet", latency)
            th.join()
        else:
            self._load("text_encoder", latency)
            unet = self._load("unet", latency)
            load_decoder()
            encode()
        if errors:
            raise errors[0]
        ehs = np.concatenate([text["uncond"], text["cond"]]) if B == 2 else text["cond"]

        # denoising
        shape = (1, int(lat["channels"]), int(lat["height"]), int(lat["width"]))
        x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) if init_latents is None else np.asarray(init_latents, np.float32).reshape(shape)
        table = self.table
        T = int(sched["num_train_timesteps"])
        steps = int(sched["steps"])
        alphas = np.asarray(sched["alphas_cumprod"], dtype=np.float64)
        final = float(sched["final_alpha_cumprod"])
        scale = float(guidance["scale"])
        dec_thread = None
        n = len(sched["timesteps"])
        unet_before = len(unet.run_s)
        for i, t in enumerate(sched["timesteps"]):
            if pipelined and i == n - 1 and decoder[0] not in self.loaded:
                dec_thread = threading.Thread(target=_recording, args=(errors, load_decoder), name="decoder")
                dec_thread.start()
            x_in = np.concatenate([x] * B) if B > 1 else x
            feeds = {"sample": x_in}
            if table is not None:
                feeds["timestep"] = np.repeat(table[int(t)][None], B, axis=0)
            else:
                feeds["timestep"] = np.full((B,), float(t), dtype=np.float32)
            feeds["encoder_hidden_states"] = ehs
            out = unet(feeds)
            if B == 2:
                out = out[0:1] + scale * (out[1:2] - out[0:1])
            prev = int(t) - T // steps
            a_t = float(alphas[int(t)])
            a_prev = float(alphas[prev]) if prev >= 0 else final
            x = ddim_step(x, out, a_t, a_prev, sched["prediction_type"])
        runs = unet.run_s[unet_before:]
        latency["unet_steps"] = float(sum(runs))
        latency["unet_step_mean"] = float(np.mean(runs)) if runs else 0.0
        if dec_thread is not None:
            dec_thread.join()
        if errors:
            raise errors[0]
        if decoder == TILED_DECODER:
            pixels, timing = tiled_decode_bundle(self.loaded[decoder[0]], self.loaded[decoder[1]], man["vae_tiling"], x)
            image = pixels[0].transpose(1, 2, 0)
            latency.update(timing["latency_s"])
            stats["vae_up_tile_calls"] = timing["up_tile_calls"]
        else:
            dec = self.loaded["vae_decoder"]
            before = len(dec.run_s)
            image = dec({"latents": x})[0].transpose(1, 2, 0)
            latency["vae_decoder_run"] = float(sum(dec.run_s[before:]))
        stats["fully_accelerated"] = self.accelerator == "gpu" and all(self.accelerated.values()) and bool(text)
        stats["fully_accelerated_by_component"] = dict(self.accelerated)
        if pipelined:
            for name in decoder:
                self._release(name)  # the UNet stays resident for the next prompt
        latency["total"] = time.perf_counter() - t_total
        stats["peak_model_mb"] = self.res.peak / 2**20
        stats["finite"] = bool(np.isfinite(image).all())
        return np.clip(image, 0.0, 1.0), stats


def generate(
    bundle: str | Path,
    prompt: str,
    seed: int = 0,
    accelerator: str = "gpu",
    pipelined: bool = False,
    init_latents: Optional[np.ndarray] = None,
    manifest: Optional[dict] = None,
) -> tuple[np.ndarray, dict]:
    """Run the bundle for one prompt: (image [H, W, 3] float32 in [0, 1], stats). Loads and frees
    every model; for several prompts, `BundleRunner` loads them once."""
    with BundleRunner(bundle, accelerator, pipelined, manifest) as runner:
        return runner.run(prompt, seed=seed, init_latents=init_latents)


def _recording(errors: list, fn) -> None:
    """fn() in a thread, its exception appended to `errors` for the main thread to raise."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
        errors.append(e)


def main(args) -> int:
    """CLI entry (argparse namespace: bundle, prompt, output, accelerator, pipelined, seed, overwrite, debug)."""
    from PIL import Image

    from pocketdiff.outputs import finish_output_dir, prepare_output_dir, write_json

    man = check_bundle(args.bundle)  # refuses bad bundles (files, fields, signatures) before touching --output
    fresh = not Path(args.output).exists()
    out = prepare_output_dir(args.output, overwrite=args.overwrite, inputs=[("bundle", args.bundle)], verb="run-bundle")
    fully = None
    try:
        image, stats = generate(args.bundle, args.prompt, seed=args.seed, accelerator=args.accelerator, pipelined=args.pipelined, manifest=man)
        if not stats["finite"]:
            raise PocketdiffError(f"bundle {args.bundle}: the image has NaN/Inf values ({args.accelerator})")
    except PocketdiffError:
        if fresh:  # leave no half-made folder behind (only the one this call created)
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise
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
        "fully_accelerated": fully,
        "fully_accelerated_by_component": stats["fully_accelerated_by_component"],
        "latency_s": {k: round(v, 4) for k, v in stats["latency_s"].items()},
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
        "peak_model_mb": round(stats["peak_model_mb"], 2),
        # what a non-pipelined run holds at once (all three models), for comparison
        "peak_model_mb_all_resident": round(sum(int(e.get("bytes", 0)) for e in man["components"].values()) / 2**20, 2),
        "steps": len(man["scheduler"]["timesteps"]),
        "vae_tiling": ({**man["vae_tiling"], "up_tile_calls": stats.get("vae_up_tile_calls")} if man.get("vae_tiling") else None),
        "guidance": man["guidance"],
        "pid": os.getpid(),
    }
    write_json(out / "report.json", report)
    finish_output_dir(out)
    print(f"wrote {path} ({args.accelerator}, {report['latency_s']['total']:.2f} s, peak RSS {report['peak_rss_mb']} MB)")
    return 0
