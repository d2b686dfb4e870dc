"""A UNet exported in K chunks (export `unet_chunks: K`): the manifest's `unet_chunks` block, its checks,
and the chunks run in sequence (run-bundle, verify-bundle, export's end-to-end parity).

The block (manifest schema_version 2):

    unet_chunks: {components: [unet.0, ..., unet.K-1], inputs: [{name, shape, dtype}] (the whole UNet's:
                  sample, timestep, encoder_hidden_states), golden: {path, sha256, tolerances} (the whole
                  UNet's inputs and output), stages: [[block names] per chunk], parity: {...}}

Each `unet.k` is an ordinary component (file, sha256, io, golden). The runner keeps a table of named
tensors: the whole UNet's inputs first; chunk k reads its declared inputs from it by name and writes its
outputs into it (`hidden`, the stream; `skip_J`, a skip connection of the down path); the last chunk's
single output is the UNet's output. numpy only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from pocketdiff.errors import PocketdiffError

UNET = "unet"
STREAM = "hidden"
OUTPUT = "out"
SKIP_PREFIX = "skip_"
CHUNKED_SCHEMA_VERSION = 2


def chunk_name(i: int) -> str:
    return f"{UNET}.{i}"


def skip_name(j: int) -> str:
    return f"{SKIP_PREFIX}{j}"


def unet_components(man: dict) -> tuple[str, ...]:
    """The UNet's components in call order: the chunks of a `unet_chunks` block, else `unet`."""
    block = man.get("unet_chunks")
    if isinstance(block, dict) and isinstance(block.get("components"), list) and block["components"]:
        return tuple(str(c) for c in block["components"])
    return (UNET,)


def check_block(man: dict, ios: dict, found, io_of: Callable) -> Optional[tuple[dict, dict]]:
    """The `unet_chunks` block against the components (`ios`: name -> (inputs, outputs) as declared):
    chunk names in order, each present, every chunk input made by the UNet's inputs or an earlier chunk
    with the same shape and dtype, one output at the end. Returns the whole UNet's (inputs, outputs) for the
    runner's contract checks, or None (no block, or it is malformed: the problems are in `found`)."""
    block = man.get("unet_chunks")
    comps = man.get("components") if isinstance(man.get("components"), dict) else {}
    if block is None:
        for name in comps:
            if name.startswith(f"{UNET}."):
                found.add(f"components.{name}", "consistency", "a UNet chunk needs the manifest's unet_chunks block")
        return None
    names = block.get("components") if isinstance(block, dict) else None
    if not isinstance(names, list) or len(names) < 2 or names != [chunk_name(i) for i in range(len(names))]:
        found.add("unet_chunks.components", "value", f"must list unet.0, unet.1, ... (at least two), got {names!r}")
        return None
    if not isinstance(man.get("schema_version"), int) or man["schema_version"] < CHUNKED_SCHEMA_VERSION:
        found.add("schema_version", "value", f"a bundle with unet_chunks has schema_version {CHUNKED_SCHEMA_VERSION}, got {man.get('schema_version')!r}")
    if UNET in comps:
        found.add(f"components.{UNET}", "consistency", "a chunked bundle runs unet.0 ... in sequence, not a whole unet")
    whole_in = io_of(block, "inputs", "unet_chunks", found)
    if whole_in is None or any(n not in ios for n in names):
        for n in names:
            if n not in comps:
                found.add(f"components.{n}", "present", f"missing: unet_chunks lists it (the bundle has {', '.join(comps)})")
        return None
    return whole_in, _check_flow(names, whole_in, ios, found)


def _check_flow(names: list[str], whole_in: dict, ios: dict, found) -> dict:
    tensors = dict(whole_in)
    for k, name in enumerate(names):
        ins, outs = ios[name]
        for n, spec in ins.items():
            have = tensors.get(n)
            if have is None:
                found.add(f"components.{name}.inputs.{n}", "consistency", "no earlier chunk (nor the UNet's inputs) makes it")
            elif have != spec:
                found.add(f"components.{name}.inputs.{n}", "consistency", f"{spec}, but it is made as {have}")
        if k == len(names) - 1 and len(outs) != 1:
            found.add(f"components.{name}.outputs", "consistency", f"the last chunk returns the UNet's output only, it declares {sorted(outs)}")
        tensors.update(outs)
    return ios[names[-1]][1]


def run_unet(parts: Sequence, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The UNet's output from its loaded parts (`run_all(feeds) -> outputs`, `in_names`, `out_names`): one
    whole model, or the chunks in sequence with their tensors passed by name."""
    if len(parts) == 1:
        return parts[0](feeds)
    tensors = dict(feeds)
    outs: list = []
    for m in parts:
        outs = m.run_all({n: tensors[n] for n in m.in_names})
        tensors.update(zip(m.out_names, outs))
    return outs[0]


def chain_on_delegate(parts: Sequence[tuple[str | Path, Sequence[str]]], inputs: dict[str, np.ndarray], precision: str,
                      **kw) -> tuple[np.ndarray, list]:
    """The chunk files in sequence on the delegate at one precision, each in its worker process and fed its
    inputs (`parts`: (file, input names)) from the UNet's inputs and the previous chunks' delegate outputs:
    (the UNet's output, each chunk's DelegateRun). `kw`: run_on_delegate's (accelerator, driver, timeout_s)."""
    from .delegate import run_on_delegate

    tensors = dict(inputs)
    runs, outs = [], []
    for path, names in parts:
        run = run_on_delegate(path, {n: tensors[n] for n in names}, precisions=[precision], **kw)
        runs.append(run)
        got = run.outputs.get(precision) or (run.outputs.get("fp32") if kw.get("accelerator") == "cpu" else None)
        if not got:
            raise PocketdiffError(f"unet chunk {Path(path).name}: no {precision} output on the delegate ({run.error or 'did not run'})")
        outs = got
        tensors.update(zip(run.output_names, outs))
    return outs[0], runs
