"""`pocketdiff VERB --config FILE --output DIR [key=value ...]`.

The CLI knows every stage; a stage is a module exposing `Config` (a dataclass schema) and
`run(cfg, output_dir, resume=None) -> dict` (the report). The CLI loads and validates the
config, prepares the output folder (never overwriting without --overwrite), writes the
resolved `config.yaml`, runs the stage and writes `report.json`.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

from .errors import PocketdiffError

# verb -> module implementing it.
VERBS: dict[str, str] = {
    "train-teacher": "pocketdiff.train.teacher",
    "distill": "pocketdiff.train.distill",
    "calibrate": "pocketdiff.compress.quant.calibrate",
    "prune": "pocketdiff.compress.prune.verb",
    "evaluate": "pocketdiff.evaluate.run",
    "export": "pocketdiff.export.verb",
    "run-bundle": "pocketdiff.runtime.run_bundle",
    "verify-bundle": "pocketdiff.runtime.verify_bundle",
    "demo": "pocketdiff.demo",
    "train-clip": "pocketdiff.evaluate.train_clip",
    "web": "pocketdiff.web.verb",
    "serve": "pocketdiff.web.serve",
    "distill-decoder": "pocketdiff.train.decoder_distill",
}

# verbs that run a bundle with the LiteRT runtime alone: they must not import torch or diffusers
RUNTIME_ONLY_VERBS = ("run-bundle", "verify-bundle", "web", "serve")

HELP = {
    "train-teacher": "train a text-to-image latent diffusion teacher (Accelerate)",
    "distill": "distillation to few sampling steps: guided + progressive, or consistency (LCM)",
    "distill-decoder": "a norm-free VAE decoder (GroupNorms folded, fine-tuned to the original) that tiles in one pass",
    "calibrate": "block-wise reconstruction PTQ to int8 / int4 weights",
    "prune": "structured pruning of the large convolutions + recovery",
    "evaluate": "FD / FID and CLIP score, sample grids, reports",
    "export": "mobile bundle of .tflite files for the LiteRT GPU delegate",
    "run-bundle": "run an exported bundle: text to PNG with ai-edge-litert",
    "verify-bundle": "check a bundle on this machine: files, io, full delegation, golden parity (no torch)",
    "demo": "the whole chain end to end on the embedded default",
    "train-clip": "train a small domain CLIP (image + text towers) for FD / CLIP score on small domains",
    "web": "write a bundle's web page (LiteRT.js on WebGPU); --check runs it in headless Chromium",
    "serve": "serve a bundle folder and its web page (phones: adb reverse, or --https)",
}


VERBOSE_HELP = "show third-party native logs (LiteRT, TensorFlow, absl) and library bars; else they go to DIR/logs/native.log"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML recipe (see configs/)")
    p.add_argument("--output", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true",
                   help="replace what an earlier pocketdiff run wrote in --output (never an input, never files it did not write)")
    p.add_argument("--resume", default=None, metavar="CKPT", help="'latest' or a checkpoint folder inside --output")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pocketdiff", description="Make Stable-Diffusion-family models phone-ready.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb in VERBS:
        p = sub.add_parser(verb, help=HELP[verb], description=HELP[verb])
        if verb == "run-bundle":
            p.add_argument("bundle", help="bundle folder made by `pocketdiff export`")
            p.add_argument("--prompt", required=True)
            p.add_argument("--output", required=True)
            p.add_argument("--accelerator", choices=["cpu", "gpu"], default="gpu")
            p.add_argument("--pipelined", action="store_true",
                           help="load each model just before its use and release it after (lowest peak memory)")
            p.add_argument("--stream-unet", action="store_true",
                           help="with --pipelined and a UNet in chunks: load each chunk for each step and release it after "
                                "(one chunk in memory at a time; a load per chunk and step)")
            p.add_argument("--gpu-cache", metavar="DIR",
                           help="folder for the GPU accelerator's compiled programs (default: one per bundle under "
                                "$XDG_CACHE_HOME/pocketdiff/gpu) and the sha256 of the bundle's files (verified.json): a second launch "
                                "loads without compiling and hashes only the files changed since")
            p.add_argument("--no-gpu-cache", action="store_true", help="compile every model and hash every file afresh, keep nothing")
            p.add_argument("--weight-cache", action="store_true",
                           help="also keep the GPU accelerator's converted weights in the --gpu-cache folder (constant-tensor "
                                "sharing; LiteRT from litert-lm-api's one-build library: pip install 'pocketdiff[gpu-cache]')")
            p.add_argument("--load-workers", type=int, default=None, metavar="N",
                           help="compile the models in N worker processes at once (GPU, not --pipelined): LiteRT loads one "
                                "model at a time per process, so the loads overlap only across processes; more memory")
            p.add_argument("--overlap-loads", action="store_true",
                           help="with --pipelined (GPU): compile the next model in a worker process while the current one "
                                "loads and runs (each model in a process of its own; writes its measured memory figures)")
            p.add_argument("--memory-budget-mb", type=float, default=None, metavar="MB",
                           help="with --overlap-loads: host + GPU MB; checked before loading from the figures a run measured: "
                                "a pair that would exceed it does not overlap, a model that cannot fit is refused")
            p.add_argument("--overlap-ahead", type=int, default=None, metavar="N",
                           help="with --overlap-loads (no --memory-budget-mb): compile the N models after the current one at "
                                "once, each in its worker (default 1: the next one); faster start, more memory at once")
            p.add_argument("--on-cpu", default=None, metavar="COMPONENT[,COMPONENT]",
                           help="run these components on the CPU (XNNPACK) while the others use the GPU, e.g. text_encoder: "
                                "no GPU compile or GPU memory for them; an int8 file's CPU variant is made at the first launch "
                                "and kept in the --gpu-cache folder")
            p.add_argument("--compile-ahead", action="store_true",
                           help="with --pipelined: compile the next GPU model in a thread while the current stage runs (the "
                                "UNet while an --on-cpu text encoder runs, the decoder during the UNet's steps)")
            p.add_argument("--one-environment", action="store_true",
                           help="with --pipelined: every model in one LiteRT environment (as plain mode) instead of one each: "
                                "no environment made per model; memory only an environment frees stays until the end")
            p.add_argument("--keep-file-pages", action="store_true",
                           help="keep each compiled model's .tflite pages resident (by default they go back to the system "
                                "once the GPU accelerator holds the whole model)")
            p.add_argument("--gpu-option", action="append", default=[], metavar="KEY=VALUE",
                           help="an option of LiteRT's GPU accelerator (runtime/litert_c.py: GPU_OPTION_KEYS), repeatable")
            p.add_argument("--init-image", metavar="PATH", default=None,
                           help="image-to-image: start from this picture (the bundle's size; the same aspect ratio is resized "
                                "with a warning); needs a bundle exported with tasks image_to_image / inpaint")
            p.add_argument("--strength", type=float, default=None, metavar="S",
                           help="with --init-image: how much of the schedule runs from the picture, in (0, 1] (default 0.8; "
                                "with --mask 1.0, as diffusers); the bundle's steps x S must leave at least one step")
            p.add_argument("--mask", metavar="PATH", default=None,
                           help="with --init-image: inpaint; white = repaint, black = keep (the picture's size)")
            p.add_argument("--lora", metavar="FILE", default=None,
                           help="a LoRA (.safetensors) fed to a bundle exported with lora_slots: its UNet attention factors, "
                                "no re-export or recompiling")
            p.add_argument("--lora-scale", type=float, default=None, metavar="S", help="with --lora: its strength (default 1.0)")
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--overwrite", action="store_true")
            p.add_argument("--debug", action="store_true")
            p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
        elif verb in ("web", "serve"):  # a bundle's page: web/verb.py defines both argument sets
            from pocketdiff.web import verb as web_verb

            (web_verb.add_arguments if verb == "web" else web_verb.add_serve_arguments)(p)
        elif verb == "verify-bundle":
            p.add_argument("bundle", help="bundle folder made by `pocketdiff export`")
            p.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
            p.add_argument("--precisions", default="fp16,fp32", help="gpu: fp16 (the delegate's default) and/or fp32 (enforce_f32)")
            p.add_argument("--components", default=None, help="comma separated (default: all in the manifest)")
            p.add_argument("--json", default=None, help="write the report here")
            p.add_argument("--no-run", action="store_true", help="only the checks that need no model run (manifest, files, io, golden)")
            p.add_argument("--keep-going", action="store_true", help="check every component, then fail naming all failures")
            p.add_argument("--timeout", type=float, default=1800.0, help="seconds per component run")
            p.add_argument("--cpu-int8-as-is", action="store_true", help="cpu: run int8 files as they are (default: their fp16-storage variant)")
            p.add_argument("--debug", action="store_true")
        elif verb == "demo":
            p.add_argument("--output", default="outputs/demo")
            p.add_argument("--smoke", action="store_true", help="smoke sizes (minutes)")
            p.add_argument("--overwrite", action="store_true")
            p.add_argument("--debug", action="store_true")
            p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
        else:
            _add_common(p)
    return parser


def run_stage(verb: str, config: Optional[str], output: str | Path, overrides: Optional[list[str]] = None,
              overwrite: bool = False, resume: Optional[str] = None) -> dict:
    """Run one config-driven verb as the CLI does: validate, prepare DIR, config.yaml, run, report.json."""
    from .config import load_config, to_yaml
    from .outputs import MARKER, atomic_write_text, config_inputs, finish_output_dir, prepare_output_dir, write_json

    module = importlib.import_module(VERBS[verb])
    cfg = load_config(module.Config, config, overrides or [])
    state = _distributed_state()
    if state is not None and not state.is_main_process:
        # `accelerate launch`: the main process owns the folder (a second check would find it
        # non-empty); the others wait for its verdict, then run without touching config or report
        refused = _share_verdict(None)
        if refused is not None:
            raise PocketdiffError(refused)
        report = module.run(cfg, Path(output), resume=resume)
        state.wait_for_everyone()  # leave together (see _end_distributed)
        return report
    fresh = not Path(output).exists()
    marker = Path(output) / MARKER
    marker_before = marker.read_text(encoding="utf-8") if marker.is_file() else None
    verdict = None
    try:
        inputs = ([("--config", config)] if config else []) + config_inputs(cfg)
        out = prepare_output_dir(output, overwrite=overwrite, resume=resume is not None, inputs=inputs, verb=verb)
    except Exception as e:
        verdict = str(e)
        raise
    finally:
        if state is not None:  # also on a refused folder: no process waits forever, none runs in it
            _share_verdict(verdict)
    cfg_file = out / "config.yaml"
    previous = cfg_file.read_text(encoding="utf-8") if cfg_file.is_file() else None
    ckpts_before = set() if fresh else set(out.rglob("checkpoint-*"))
    atomic_write_text(cfg_file, to_yaml(cfg))
    start = time.time()
    try:
        report = module.run(cfg, out, resume=resume)
    except PocketdiffError:
        # bad input found while running (e.g. NaN weights): leave no half-made folder behind
        # (a resumable run keeps its checkpoints: only folders this call created are removed)
        if fresh and not any(out.rglob("checkpoint-*")):
            shutil.rmtree(out, ignore_errors=True)
        elif not fresh and set(out.rglob("checkpoint-*")) == ckpts_before:
            # a refused --resume (e.g. a damaged checkpoint, a changed recipe): the folder keeps its own config
            restore = [(cfg_file, previous)] + ([(marker, marker_before)] if resume is not None else [])
            for path, text in restore:  # (and, resumed, its own marker: a refused resume changes no file)
                if text is None:
                    path.unlink(missing_ok=True)
                else:
                    atomic_write_text(path, text)
            if resume is None:
                finish_output_dir(out)
        else:
            finish_output_dir(out)  # what this run wrote, for a later --overwrite
        raise
    report.setdefault("verb", verb)
    report.setdefault("wall_time_s", round(time.time() - start, 3))
    from .lora import config_lora_entries

    lora = config_lora_entries(cfg)  # every LoRA the config fused (model.lora, models[i].lora): file, sha256, scale
    if lora:
        report.setdefault("lora", lora)
    write_json(out / "report.json", report)
    finish_output_dir(out)
    if state is not None:
        state.wait_for_everyone()
    return report


def _distributed_state():
    """accelerate's process state when launched as several processes (None for one process).

    Made as the Accelerator would make it (`accelerate launch --cpu` sets ACCELERATE_USE_CPU):
    the state is a singleton, and one made without the flag leaves a CPU launch undistributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))


def _share_verdict(verdict: Optional[str]) -> Optional[str]:
    """The main process's verdict on the output folder (None: ready) in every process."""
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([verdict], from_process=0)[0]


def _end_distributed() -> None:
    """Tear the process group down before exit: a gloo peer that outlives the other process's
    exit can abort ('terminate called without an active exception'), failing the launch."""
    if "torch.distributed" not in sys.modules:  # never started (and verify-bundle / run-bundle must not import torch)
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_verb(args: argparse.Namespace) -> int:
    if args.verb in ("run-bundle", "verify-bundle", "demo", "web", "serve"):
        return int(importlib.import_module(VERBS[args.verb]).main(args) or 0)
    run_stage(args.verb, args.config, args.output, args.overrides, overwrite=args.overwrite, resume=args.resume)
    return 0


# Import-time notices of optional backends pocketdiff does not use (torchao, pulled in by
# litert-torch; torchvision, absent from CPU installs). The CLI silences only these loggers.
IMPORT_NOISE_LOGGERS = ("torch.utils._pytree", "torchao", "diffusers.quantizers.torchao.torchao_quantizer",
                        "transformers.utils.import_utils")


def main(argv: Optional[list[str]] = None) -> int:
    import logging

    for name in IMPORT_NOISE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides may also follow the options: `--config A x=1 --output B y=2`
        if hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
            args.overrides = list(args.overrides) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from .logs import keep_native_log, native_logs_to_file, native_logs_until_exit, quiet_libraries

    verbose = bool(getattr(args, "verbose", False))
    native = contextlib.nullcontext(None) if verbose else native_logs_to_file()
    if not verbose:
        quiet_libraries(huggingface=args.verb not in RUNTIME_ONLY_VERBS)
    failed, native_log = True, None
    output = getattr(args, "output", None)  # verify-bundle, serve ... write no folder
    made_here = output is not None and not Path(output).exists()
    try:
        with native as native_log:
            code = run_verb(args)
            failed = code != 0
            return code
    except PocketdiffError as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line unless --debug
        if args.debug:
            traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"error: {type(e).__name__}: {first} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        _end_distributed()
        if native_log is not None:
            # into DIR/logs/ when the command succeeded, or failed in a folder it made itself; never
            # into a folder it refused, and never left in the temp folder: else the log is dropped
            own = output is not None and (not failed or made_here)
            kept = keep_native_log(native_log, Path(output) if own else None)
            if failed and kept is not None:
                print(f"(native library log: {kept})", file=sys.stderr)
            if argv is None:  # the process is this command: its exit logs too (dropped with no log kept)
                native_logs_until_exit(kept or Path(os.devnull))


if __name__ == "__main__":
    sys.exit(main())
