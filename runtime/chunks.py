"""A model exported in K chunks (export `unet_chunks: K`, `text_encoder_chunks: K`): the manifest's
`unet_chunks` / `text_encoder_chunks` blocks, their checks, and the chunks run in sequence (run-bundle,
verify-bundle, export's end-to-end parity).

A block (manifest schema_version 2), `<base>_chunks` for base `unet` or `text_encoder`:

    <base>_chunks: {components: [<base>.0, ..., <base>.K-1], inputs: [{name, shape, dtype}] (the whole model's:
                    the UNet's sample, timestep, encoder_hidden_states; the text encoder's input_ids),
                    golden: {path, sha256, tolerances} (the whole model's inputs and output), stages: [[block or
                    layer names, e.g. up_blocks.1.layers.0, encoder.layers.3] per chunk], parity: {...},
                    aliases: [{name: output} per chunk] (optional)}

Each `<base>.k` is an ordinary component (file, sha256, io, golden). The runner keeps a table of named
tensors: the whole model's inputs first; chunk k reads its declared inputs from it by name and writes its
outputs into it (`hidden`, the stream; the UNet's `skip_J`, a skip connection of the down path), then, per its
`aliases` entry, each alias as a second name for one of its outputs (a UNet chunk that ends with a down block
returns that block's last skip only as `hidden`: one tensor, which converters return once); the last
chunk's single output is the model's output. A UNet with SDXL's added embedding (its inputs `text_embeds`, `time_ids`)
has them read by `unet.0`, which returns `emb` (the time-embedding row plus the added embedding); later chunks read
`emb` in place of `timestep` (export/unet_chunks.py). A UNet with LoRA slots: the factors (`lora_factors`, the whole
UNet's inputs in the block's `inputs`) start in the table, and each chunk reads those of its own slots. numpy only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from pocketdiff.errors import PocketdiffError

from .components import CHUNKABLE, TEXT_ENCODER, UNET  # the registry: the components a bundle may hold in chunks

STREAM = "hidden"
OUTPUT = "out"
SKIP_PREFIX = "skip_"
EMBEDDING = "emb"  # a UNet with SDXL's added embedding: the time-embedding row plus it, made by unet.0 for later chunks
ADDED_INPUTS = ("text_embeds", "time_ids")  # what unet.0 computes the added embedding from (the whole UNet's inputs)
CHUNKED_SCHEMA_VERSION = 2


def block_key(base: str) -> str:
    """The manifest key of `base`'s chunks block: unet_chunks, text_encoder_chunks."""
    return f"{base}_chunks"


def chunk_name(i: int, base: str = UNET) -> str:
    return f"{base}.{i}"


def base_of(name: str) -> str:
    """The component a chunk belongs to (`unet.2` -> unet), else the name itself."""
    head, _, tail = name.rpartition(".")
    return head if head in CHUNKABLE and tail.isdigit() else name


def has_chunks(man: dict) -> bool:
    """Whether the manifest holds any chunks block (schema_version 2)."""
    return any(block_key(b) in man for b in CHUNKABLE)


def skip_name(j: int) -> str:
    return f"{SKIP_PREFIX}{j}"


def spoken_input(name: str) -> str:
    """A chunk input's name for a message: `emb` says what it is and where it comes from."""
    if name == EMBEDDING:
        return (f"{EMBEDDING} (the time embedding plus the added embedding of {' and '.join(ADDED_INPUTS)}, which the first "
                "chunk computes and returns)")
    return name


def parts_of(man: dict, base: str = UNET) -> tuple[str, ...]:
    """A model's components in call order: the chunks of its `<base>_chunks` block, else `base` itself."""
    block = man.get(block_key(base))
    if isinstance(block, dict) and isinstance(block.get("components"), list) and block["components"]:
        return tuple(str(c) for c in block["components"])
    return (base,)


def chunk_aliases(man: dict, base: str = UNET) -> list[dict[str, str]]:
    """Per chunk, {alias: the chunk's output it names} (empty where the block has none or a malformed one,
    which check_block reports)."""
    block = man.get(block_key(base)) or {}
    names, aliases = block.get("components") or [], block.get("aliases")
    return [dict(a) for a in aliases] if _aliases_ok(aliases, len(names)) else [{} for _ in names]


def _aliases_ok(aliases, n: int) -> bool:
    """One {name: output} object of strings per chunk."""
    return (isinstance(aliases, list) and len(aliases) == n
            and all(isinstance(a, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in a.items()) for a in aliases))


def check_block(man: dict, ios: dict, found, io_of: Callable, base: str = UNET) -> Optional[tuple[dict, dict]]:
    """`base`'s chunks block against the components (`ios`: name -> (inputs, outputs) as declared): chunk
    names in order, each present, every chunk input made by the model's inputs or an earlier chunk with the
    same shape and dtype, one output at the end. Returns the whole model's (inputs, outputs) for the
    runner's contract checks, or None (no block, or it is malformed: the problems are in `found`)."""
    key = block_key(base)
    block = man.get(key)
    comps = man.get("components") if isinstance(man.get("components"), dict) else {}
    if block is None:
        for name in comps:
            if base_of(name) == base and name != base:
                found.add(f"components.{name}", "consistency", f"a {base} chunk needs the manifest's {key} block")
        return None
    names = block.get("components") if isinstance(block, dict) else None
    if not isinstance(names, list) or len(names) < 2 or names != [chunk_name(i, base) for i in range(len(names))]:
        found.add(f"{key}.components", "value", f"must list {base}.0, {base}.1, ... (at least two), got {names!r}")
        return None
    if not isinstance(man.get("schema_version"), int) or man["schema_version"] < CHUNKED_SCHEMA_VERSION:
        found.add("schema_version", "value", f"a bundle with {key} has schema_version {CHUNKED_SCHEMA_VERSION}, got {man.get('schema_version')!r}")
    if base in comps:
        found.add(f"components.{base}", "consistency", f"a chunked bundle runs {base}.0 ... in sequence, not a whole {base}")
    whole_in = io_of(block, "inputs", key, found)
    if whole_in is None or any(n not in ios for n in names):
        for n in names:
            if n not in comps:
                found.add(f"components.{n}", "present", f"missing: {key} lists it (the bundle has {', '.join(comps)})")
        return None
    return whole_in, _check_flow(names, whole_in, ios, _aliases_of(block, names, key, found), found, base)


def _aliases_of(block: dict, names: list[str], key: str, found) -> list[dict]:
    aliases = block.get("aliases")
    if aliases is None:
        return [{} for _ in names]
    if not _aliases_ok(aliases, len(names)):
        found.add(f"{key}.aliases", "value", f"must be one {{name: output}} object per chunk ({len(names)}), got {aliases!r}")
        return [{} for _ in names]
    return aliases


def _check_flow(names: list[str], whole_in: dict, ios: dict, aliases: list[dict], found, base: str) -> dict:
    tensors = dict(whole_in)
    read: set = set()
    for k, name in enumerate(names):
        ins, outs = ios[name]
        read.update(ins)
        for n, spec in ins.items():
            have = tensors.get(n)
            if have is None:
                found.add(f"components.{name}.inputs.{n}", "consistency", f"no earlier chunk (nor the {base}'s inputs) makes it"
                          + (f": {spoken_input(n)}" if n == EMBEDDING else ""))
            elif have != spec:
                found.add(f"components.{name}.inputs.{n}", "consistency", f"{spec}, but it is made as {have}")
        if k == len(names) - 1 and len(outs) != 1:
            found.add(f"components.{name}.outputs", "consistency", f"the last chunk returns the {base}'s output only, it declares {sorted(outs)}")
        tensors.update(outs)
        for alias, src in aliases[k].items():
            if src not in outs:
                found.add(f"{block_key(base)}.aliases.{k}.{alias}", "consistency", f"names {src}, which {name} does not return ({sorted(outs)})")
            else:
                tensors[alias] = outs[src]
    for n in (n for n in ADDED_INPUTS if n in whole_in and n not in read):
        found.add(f"{block_key(base)}.inputs.{n}", "consistency", f"no chunk reads it (the {base}'s added embedding is computed from "
                  f"{' and '.join(ADDED_INPUTS)} in {names[0]}, which passes it on as {EMBEDDING})")
    return ios[names[-1]][1]


def run_parts(parts: Sequence, feeds: dict[str, np.ndarray], aliases: Sequence[dict] = ()) -> np.ndarray:
    """A model's output from its loaded parts (`run_all(feeds) -> outputs`, `in_names`, `out_names`): one
    whole model, or the chunks in sequence with their tensors passed by name (`aliases`: chunk_aliases)."""
    if len(parts) == 1:
        return parts[0](feeds)
    tensors = dict(feeds)
    outs: list = []
    for k, m in enumerate(parts):  # check_block proved at load that every input is made before it is read
        outs = run_into(tensors, m, aliases[k] if k < len(aliases) else {})
    return outs[0]


def run_into(tensors: dict[str, np.ndarray], model, aliases: dict) -> list:
    """One chunk run on its inputs from the table of named tensors, its outputs (and their aliases) put
    back into the table; returns its outputs."""
    outs = model.run_all({n: tensors[n] for n in model.in_names})
    _take(tensors, model.out_names, outs, aliases)
    return outs


class StreamedPart:
    """A UNet chunk loaded for each run and released right after it (run-bundle --stream-unet), as the page's
    `?unet=streamed`: one chunk in memory at a time, a load per run. `load()` -> the loaded model (`run_all`,
    `out_names`, `run_s`); `ran()` is called after each run while the model is still loaded (the runner's memory
    marks); `release()` frees it. `in_names` come from the manifest (check_component_io proved them the
    file's), `out_names` from the model once it has run."""

    def __init__(self, in_names: Sequence[str], load, ran, release):
        self.in_names, self._load, self._ran, self._release = list(in_names), load, ran, release
        self.out_names: list = []
        self.run_s: list = []

    def run_all(self, feeds: dict[str, np.ndarray]) -> list:
        model = self._load()
        try:
            outs = model.run_all(feeds)
            self.out_names = list(model.out_names)
            self.run_s.append(model.run_s[-1])
            self._ran()
        finally:
            self._release()
        return outs


def _take(tensors: dict, names: Sequence[str], outs: Sequence, aliases: dict) -> None:
    """A chunk's outputs into the table by name, and their aliases."""
    mine = dict(zip(names, outs))
    tensors.update(mine)
    tensors.update({a: mine[src] for a, src in aliases.items() if src in mine})


def chain_on_delegate(parts: Sequence[tuple[str | Path, Sequence[str], dict]], inputs: dict[str, np.ndarray], precision: str,
                      **kw) -> tuple[np.ndarray, list]:
    """The chunk files in sequence on the delegate at one precision, each in its worker process and fed its
    inputs (`parts`: (file, input names, aliases)) from the model's inputs and the previous chunks' delegate
    outputs: (the model's output, each chunk's DelegateRun). `kw`: run_on_delegate's (accelerator, driver, timeout_s)."""
    from .delegate import run_on_delegate

    tensors = dict(inputs)
    runs, outs = [], []
    for path, names, aliases in parts:
        missing = [n for n in names if n not in tensors]
        if missing:
            raise PocketdiffError(f"chunk {Path(path).name}: no earlier chunk (nor the model's inputs) made its input {', '.join(map(spoken_input, missing))}")
        run = run_on_delegate(path, {n: tensors[n] for n in names}, precisions=[precision], **kw)
        runs.append(run)
        got = run.outputs.get(precision) or (run.outputs.get("fp32") if kw.get("accelerator") == "cpu" else None)
        if not got:
            raise PocketdiffError(f"chunk {Path(path).name}: no {precision} output on the delegate ({run.error or 'did not run'})")
        outs = got
        _take(tensors, run.output_names, outs, aliases)
    return outs[0], runs
