"""Flag checks of the bundle runners (run-bundle, verify-bundle, web), each one line naming the flag, before the
bundle is read or anything is written: text a tokenizer cannot take, a timeout that is no time, a flag that does
nothing with the others given, and a path that would write into the input bundle (nothing ever is written there).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from pocketdiff.errors import PocketdiffError
from pocketdiff.outputs import _forms  # a path as written and with its links resolved (the output checks' own)


def check_text(value: Optional[str], flag: str) -> None:
    """Text from argv that is not valid UTF-8 (Python keeps the bytes as surrogate escapes) is refused by name."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start:e.end].encode("utf-8", "surrogateescape")
        raise PocketdiffError(f"{flag}: not valid UTF-8 text (byte {bad[:4].hex(' ')} at character {e.start}); "
                              "pass it as UTF-8 (the shell's locale decides how arguments arrive)") from None


def check_timeout(value: float, flag: str = "--timeout") -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise PocketdiffError(f"{flag} {value}: must be a positive number of seconds")


def check_outside_bundle(path: Optional[str], flag: str, bundle: str) -> None:
    """`path` (a file or folder to write) must be neither the bundle folder nor inside it, by name or through links."""
    if path is None:
        return
    roots = _forms(Path(bundle).expanduser())
    for p in _forms(Path(path).expanduser()):
        if any(p == r or r in p.parents for r in roots):
            raise PocketdiffError(f"{flag} {path} is inside the input bundle {bundle}: nothing is written into a bundle; "
                                  "choose a path outside it")


class CheckedOnCpu(tuple):
    """--on-cpu's components once `check_on_cpu` passed them against a bundle's manifest (run-bundle checks them before
    --output is made and hands them on: BundleRunner checks them no further)."""


def check_on_cpu(names, accelerator: str, man: Optional[dict] = None, bundle=None) -> tuple[str, ...]:
    """--on-cpu's components (a comma list or a sequence): components a pipeline stage may name, on a GPU runner; with
    the bundle's manifest `man`, also each one a stage of bundle `bundle` runs (then a CheckedOnCpu)."""
    from .components import STAGE_COMPONENTS
    from .pipeline_spec import pipeline_of

    if isinstance(names, CheckedOnCpu):
        return names
    names = tuple(n.strip() for n in (names.split(",") if isinstance(names, str) else names or ()) if n.strip())
    unknown = [n for n in names if n not in STAGE_COMPONENTS]
    if unknown:
        raise PocketdiffError(f"--on-cpu {','.join(unknown)}: not a component (components: {', '.join(STAGE_COMPONENTS)})")
    if names and accelerator != "gpu":
        raise PocketdiffError(f"--on-cpu {','.join(names)} runs those components on the CPU beside the GPU: it needs "
                              f"--accelerator gpu (with --accelerator {accelerator} every model runs there already)")
    if man is None:
        return names
    stages = [s["component"] for s in pipeline_of(man)["stages"]]
    absent = [n for n in names if n not in stages]
    if absent:
        raise PocketdiffError(f"--on-cpu {','.join(absent)}: no stage of bundle {bundle} runs it (its stages run {', '.join(stages)})")
    return CheckedOnCpu(names)


def check_weight_cache(weight_cache: bool, accelerator: str, gpu_cache: bool, find_library: bool = True) -> bool:
    """--weight-cache: the GPU accelerator's converted weights kept in the GPU cache folder, so it needs both; and
    litert-lm-api's library (runtime/litert_c.py), whose absence is one line naming the pip extra."""
    if not weight_cache:
        return False
    if accelerator != "gpu":
        raise PocketdiffError(f"--weight-cache keeps the GPU accelerator's converted weights: it needs --accelerator gpu, "
                              f"not {accelerator}")
    if not gpu_cache:
        raise PocketdiffError("--weight-cache keeps the converted weights in the GPU cache folder: it cannot go with "
                              "--no-gpu-cache (drop one of them)")
    if find_library:
        from .litert_c import single_build_path

        single_build_path()
    return True


def check_run_bundle_flags(args) -> None:
    """run-bundle's text, paths and accelerator-only flags."""
    check_text(getattr(args, "prompt", None), "--prompt")
    check_outside_bundle(getattr(args, "gpu_cache", None), "--gpu-cache", args.bundle)
    check_weight_cache(getattr(args, "weight_cache", False), args.accelerator, not getattr(args, "no_gpu_cache", False))
    if getattr(args, "keep_file_pages", False) and args.accelerator != "gpu":
        raise PocketdiffError("--keep-file-pages keeps the GPU accelerator's .tflite pages: it does nothing with "
                              f"--accelerator {args.accelerator}; drop it")


def check_verify_bundle_flags(args) -> None:
    check_timeout(args.timeout)
    check_outside_bundle(getattr(args, "json", None), "--json", args.bundle)
    for flag, value in (("--precisions", args.precisions), ("--components", getattr(args, "components", None))):
        check_text(value, flag)


def check_web_flags(args) -> None:
    """`pocketdiff web`: the reference prompt, --check's own flags without --check, the timeout."""
    check_text(getattr(args, "prompt", None), "--prompt")
    check_timeout(args.timeout)
    if not args.check:
        for flag, given in (("--screenshot", args.screenshot is not None), ("--accelerator", args.accelerator != "webgpu")):
            if given:
                raise PocketdiffError(f"{flag} belongs to --check (the headless run): add --check, or drop {flag}")
