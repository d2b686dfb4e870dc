"""The whole VAE decoder against the one-pass tiled decode, timed side by side in ONE process on the
LiteRT GPU accelerator, through the runner's own code (runtime/litert_c.py for the models,
runtime/onepass_decode.py for the tiling): the delegate-time ratio of issue 33 measured as run-bundle
decodes, not as isolated component probes with their own processes and inputs.

Every model is compiled once in one environment; then `--repeats` rounds, each decoding the same
latents with the whole decoder and with the one-pass path (order alternating per round), wall time of
the whole decode call (host copies in and out included, as the runner pays them). Medians and the
ratio of medians go to the JSON; per-round times stay in it.

    python benchmarks/decoder_side_by_side.py --whole vae_decoder.tflite --head vae_decoder_head.tflite \
        --up vae_up_tile.tflite --tiling manifest.json --out decoder_side_by_side.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from _checkout import use_checkout

use_checkout()


def _named(model):
    """A compiled model as the one-pass code calls it: {name: array} -> outputs (first one for a head)."""
    def run(feeds: dict):
        return model.run([feeds[s.name] for s in model.inputs])
    return run


def _rounds(whole, head, up, block: dict, latents: np.ndarray, repeats: int) -> dict:
    from pocketdiff.runtime.onepass_decode import one_pass_decode

    head_run, up_run = _named(head), _named(up)
    head_fn = lambda z: head_run({"latents": z})[0]  # noqa: E731
    up_fn = lambda x: up_run({"features": x})[0]  # noqa: E731
    tile, overlap, factor, margin = block["tile"], int(block["overlap"]), int(block["factor"]), int(block.get("margin", 0))

    def whole_decode():
        return whole.run([latents])[0]

    def one_pass():
        return one_pass_decode(latents, head_fn, up_fn, tile, overlap, factor, margin)

    times = {"whole": [], "one_pass": []}
    for r in range(repeats):
        order = [("whole", whole_decode), ("one_pass", one_pass)]
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            if not np.isfinite(out).all():
                raise SystemExit(f"{name}: non-finite output")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--whole", required=True, help="the whole decoder .tflite (latents -> pixels)")
    ap.add_argument("--head", required=True, help="the one-pass head .tflite (latents -> features)")
    ap.add_argument("--up", required=True, help="the one-pass up tile .tflite (features tile -> pixels)")
    ap.add_argument("--tiling", required=True, help="a bundle manifest.json whose vae_tiling block is the one-pass scheme")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu", help="cpu: a check of the script itself (XNNPACK)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from pocketdiff.runtime.delegate import prepare_in_process
    from pocketdiff.runtime.litert_c import CompiledModel, Environment

    driver = prepare_in_process()
    manifest = json.loads(Path(args.tiling).read_text())
    block = manifest["vae_tiling"]
    env = Environment()
    models, load_s = {}, {}
    for name in ("whole", "head", "up"):
        t0 = time.perf_counter()
        models[name] = CompiledModel(getattr(args, name), env, {}, accelerator=args.accelerator)
        load_s[name] = round(time.perf_counter() - t0, 2)
        if args.accelerator == "gpu" and not models[name].fully_accelerated():
            raise SystemExit(f"{name}: not fully accelerated")
    spec = models["whole"].inputs[0]
    latents = (np.random.default_rng(0).standard_normal(spec.shape) * 0.8).astype(np.float32)
    _rounds(models["whole"], models["head"], models["up"], block, latents, args.warmup)
    times = _rounds(models["whole"], models["head"], models["up"], block, latents, args.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "what": "whole VAE decoder vs one-pass tiled decode, one process, one LiteRT environment, alternating rounds, "
                "wall time of each decode call (host copies included)",
        "command": "python benchmarks/decoder_side_by_side.py " + " ".join(
            f"--{k} {Path(v).name if isinstance(v, str) else v}" for k, v in vars(args).items() if k != "out"),
        "driver": driver, "accelerator": args.accelerator, "host": platform.node(), "latent": list(spec.shape), "tiling": block,
        "load_s": load_s, "repeats": args.repeats, "warmup": args.warmup,
        "whole_s": round(med["whole"], 5), "one_pass_s": round(med["one_pass"], 5),
        "delegate_time_ratio": round(med["one_pass"] / med["whole"], 3),
        "p10_p90_s": {k: [round(float(np.percentile(v, 10)), 5), round(float(np.percentile(v, 90)), 5)] for k, v in times.items()},
        "rounds_s": {k: [round(x, 5) for x in v] for k, v in times.items()},
    }
    for m in models.values():
        m.close()
    env.close()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("whole_s", "one_pass_s", "delegate_time_ratio", "load_s")}))


if __name__ == "__main__":
    main()
