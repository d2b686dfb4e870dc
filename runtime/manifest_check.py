"""Checks of a bundle's manifest against itself and against its files, before anything runs.

`load_manifest` (bundle.py) checks the files exist inside the bundle, their sha256 and that
each .tflite is a whole flatbuffer. This module checks what the runner relies on:

- fields: sizes, guidance, the schedule, the tokenizer (runtime/manifest_fields.py);
- the components' declared inputs and outputs against each other (latent shape, text length
  and width, UNet batch, time input vs the time-embedding table);
- a UNet or text encoder in chunks (`unet_chunks`, `text_encoder_chunks`, runtime/chunks.py): every chunk
  present, each chunk's inputs made earlier with the same shape and dtype, then the chunks as one model
  against the contract;
- a tiled decoder (`vae_tiling`: tile, overlap, passes, factor, norms [K, G], features F):
  both of its components present, the block's values against the latent, their io against it;
- files: every declared `bytes` equals the file's size; every .tflite's signature (input
  and output names, shapes, dtypes) equals the manifest's; the time-embedding .npy header
  (shape, dtype) equals the manifest's.

`manifest_problems` lists every problem found; `check_bundle` (run-bundle) raises the first
as one line naming the field or file and the check; `verify-bundle` maps each problem to its
component (`BundleCheckError(component, check, detail)`, as `check_component_io` raises). numpy and the LiteRT flatbuffer schema
only: no torch, the runner's footprint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from pocketdiff.errors import PocketdiffError

from .manifest_fields import FIELD_CHECKS, Found, Problem, expect_shape, is_int, positive_ints, tokenizer_blocks
from .onepass_decode import ONE_PASS, check_one_pass_block, one_pass_io
from .tiled_decode import SCHEMES as TILING_SCHEMES
from .chunks import block_key
from .chunks import check_block as check_chunks_block
from .components import CHUNKABLE, COMPONENTS, REGISTRY, STAGE_COMPONENTS, TILED_DECODER
from .pipeline_spec import decoder_components, pipeline_problems, tiled_components  # noqa: F401  (their home before pipeline_spec)

RUNNER_COMPONENTS = COMPONENTS  # the registry's (runtime/components.py)


class BundleCheckError(PocketdiffError):
    """A bundle failed one named check of one component ("manifest" / "tokenizer" for fields)."""

    def __init__(self, component: str, check: str, detail: str):
        self.component, self.check, self.detail = component, check, detail
        super().__init__(f"{component}: {check}: {detail}")


def _io(entry: dict, key: str, name: str, found: Found) -> Optional[dict[str, dict]]:
    """name -> {shape, dtype} of a component's declared inputs or outputs (None when malformed)."""
    items = entry.get(key)
    where = f"components.{name}.{key}"
    if not isinstance(items, list) or not items:
        found.add(where, "present", "must be a non-empty list of {name, shape, dtype}")
        return None
    io: dict[str, dict] = {}
    for i, it in enumerate(items):
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            found.add(f"{where}[{i}]", "type", "must be an object with a name")
            return None
        shape, dtype = it.get("shape"), it.get("dtype")
        if not isinstance(shape, list) or not all(is_int(d) and d > 0 for d in shape):
            found.add(f"{where}[{i}].shape", "type", f"must be a list of positive integers, got {shape!r}")
            return None
        try:
            np.dtype(dtype)
        except TypeError:
            found.add(f"{where}[{i}].dtype", "type", f"{dtype!r} is not a dtype")
            return None
        io[it["name"]] = {"shape": list(shape), "dtype": str(np.dtype(dtype))}
    return io



def _check_components(man: dict, need: Iterable[str], found: Found, runnable: bool = True) -> None:
    comps = man.get("components")
    if not isinstance(comps, dict) or not comps:
        found.add("components", "present", "missing or empty")
        return
    for name in need:
        if name not in comps:
            found.add(f"components.{name}", "present", f"missing (the bundle has {', '.join(comps)})")
    ios: dict[str, tuple] = {}
    for name, entry in comps.items():
        if not isinstance(entry, dict):
            found.add(f"components.{name}", "type", "must be an object")
            continue
        if "bytes" in entry and (not is_int(entry["bytes"]) or entry["bytes"] <= 0):
            found.add(f"components.{name}.bytes", "type", f"must be a positive integer, got {entry['bytes']!r}")
        ins, outs = _io(entry, "inputs", name, found), _io(entry, "outputs", name, found)
        if ins is not None and outs is not None:
            ios[name] = (ins, outs)
    for base in CHUNKABLE:  # a model in chunks: checked as one model below
        whole = check_chunks_block(man, ios, found, _io, base)
        if whole:
            ios[base] = whole
    _check_contract(man, ios, found, runnable)


def _missing_inputs(ios: dict, found: Found) -> set[str]:
    """The whole components that lack an input the runner feeds them (the registry's `inputs`)."""
    lacking = set()
    for name in STAGE_COMPONENTS:
        if name in ios:
            ins = ios[name][0]
            missing = [k for k in REGISTRY[name].inputs if k not in ins]
            if missing:
                found.add(f"components.{name}.inputs", "consistency", f"has no {', '.join(missing)} (has {', '.join(ins)})")
                lacking.add(name)
    return lacking


def _check_contract(man: dict, ios: dict, found: Found, runnable: bool = True) -> None:
    """The pipeline's stages (runtime/pipeline_spec.py: roles, order, the shapes each role feeds and reads) against the
    components, then a tiled decoder's block."""
    lacking = _missing_inputs(ios, found)
    pipeline_problems(man, ios, found, frozenset(lacking), require_present=runnable)
    lat = man.get("latent") if isinstance(man.get("latent"), dict) else {}
    _check_tiling(man, ios, [lat.get("channels"), lat.get("height"), lat.get("width")], found)


def _check_tiling(man: dict, ios: dict, latent: list, found: Found) -> None:
    """The vae_tiling block (tile, overlap, passes, factor, norms [K, G], features F; margin and scheme
    optional) against the latent and the two tiled components' io; a tiled component without the
    block is refused."""
    block = man.get("vae_tiling")
    comps = man.get("components") if isinstance(man.get("components"), dict) else {}
    if block is None:
        for name in comps:
            if name in TILED_DECODER or name.rpartition(".")[0] == TILED_DECODER[1]:
                found.add(f"components.{name}", "consistency", "a tiled decoder component needs the manifest's vae_tiling block")
        return
    if not isinstance(block, dict):
        found.add("vae_tiling", "type", "must be an object")
        return
    tiled = tiled_components(block)
    if "components" in block and list(tiled) != block["components"]:
        found.add("vae_tiling.components", "value", f"must be [{TILED_DECODER[0]}, then {TILED_DECODER[1]} or "
                  f"{TILED_DECODER[1]}.0 ... {TILED_DECODER[1]}.K-1], got {block['components']!r}")
    if len(tiled) > 2 and block.get("scheme") != ONE_PASS:
        found.add("vae_tiling.components", "consistency", f"an up path in {len(tiled) - 1} parts needs scheme {ONE_PASS} "
                  f"(the iterated schemes feed norm statistics through one graph), got {block.get('scheme', 'plain')!r}")
    for name in tiled:
        if name not in comps:
            found.add(f"components.{name}", "present", f"missing: vae_tiling needs {', '.join(tiled)} (the bundle has {', '.join(comps)})")
    if "vae_decoder" in comps:
        found.add("components.vae_decoder", "consistency", "a tiled bundle decodes with vae_decoder_head + vae_up_tile, not vae_decoder")
    if not positive_ints(block, "vae_tiling", ("tile", "passes", "factor", "features"), found):
        return
    t, o, f = block["tile"], block.get("overlap"), block["factor"]
    if not is_int(o) or not 0 <= o < t:
        found.add("vae_tiling.overlap", "range", f"must be an integer in [0, tile={t}), got {o!r}")
    m = block.get("margin", 0)  # bundles from before the margin decode with none
    if not is_int(m) or m < 0 or (is_int(o) and 2 * m > o):
        found.add("vae_tiling.margin", "range", f"must be an integer with 0 <= 2 * margin <= overlap={o!r}, got {m!r}")
    one_pass = block.get("scheme") == ONE_PASS
    if block.get("scheme", "plain") not in TILING_SCHEMES + (ONE_PASS,):
        found.add("vae_tiling.scheme", "value", f"must be one of {', '.join(TILING_SCHEMES + (ONE_PASS,))}, got {block.get('scheme')!r}")
    norms = block.get("norms")
    if not one_pass and (not isinstance(norms, list) or len(norms) != 2 or not all(is_int(v) and v > 0 for v in norms)):
        found.add("vae_tiling.norms", "type", f"must be [norm count K, groups G] (positive integers), got {norms!r}")
        return
    lat = man.get("latent") if isinstance(man.get("latent"), dict) else {}
    if f != lat.get("vae_factor"):
        found.add("vae_tiling.factor", "consistency", f"{f}, but latent.vae_factor is {lat.get('vae_factor')!r}")
    if all(is_int(d) for d in latent[1:]) and t > min(latent[1:]):
        found.add("vae_tiling.tile", "range", f"{t} latents is larger than the latent {latent[1]}x{latent[2]}")
    if one_pass:  # runtime/onepass_decode.py: features in, pixels out, one pass
        for key, message in check_one_pass_block(block, latent):
            found.add(key, "value", message)
        want = one_pass_io(block, latent, tiled[1:], ios)
    else:
        K, G, F = norms[0], norms[1], block["features"]
        want = {"vae_decoder_head": ({"latents": [1, *latent]}, [[1, F, *latent[1:]]]),
                "vae_up_tile": ({"features": [1, F, t, t], "weight": [t, t], "stats": [K, 2, G], "own": [1]}, [[1, 3, t * f, t * f], [K, 5, G]])}
    for name, (want_in, want_out) in want.items():
        if name not in ios:
            continue
        ins, outs = ios[name]
        if set(ins) != set(want_in):
            found.add(f"components.{name}.inputs", "consistency", f"names {sorted(ins)}, the tiled decoder feeds {sorted(want_in)}")
            continue
        for k, shape in want_in.items():
            expect_shape(found, f"components.{name}.inputs.{k}", ins[k]["shape"], shape, "vae_tiling and latent")
        got_out = [o["shape"] for o in outs.values()]
        if want_out is None:  # an up-path part before the last: one tensor, which the next part takes
            if len(got_out) != 1:
                found.add(f"components.{name}.outputs", "consistency", f"{len(got_out)} outputs, an up-path part hands one tensor to the next")
        elif got_out != want_out:
            found.add(f"components.{name}.outputs", "consistency", f"shapes {got_out}, but vae_tiling and latent give {want_out}")




# ------------------------------------------------------------------------------- file checks


def tflite_signature(path: str | Path) -> tuple[dict[str, dict], dict[str, dict]]:
    """(inputs, outputs) of a .tflite's first signature (or its first subgraph's inputs and
    outputs, named input_J / output_J, when it has none): name -> {shape, dtype}, in order.
    Reads the flatbuffer in place (no unpacking of weights)."""
    ins, outs, _ = _read_signature(path)
    return ins, outs


def _read_signature(path: str | Path) -> tuple[dict[str, dict], dict[str, dict], list[list[str]]]:
    """tflite_signature's (inputs, outputs), and the groups of output names that name one tensor (a
    converter returns a tensor a graph gives twice once; runners then see one of the names)."""
    import mmap

    from ai_edge_litert import schema_py_generated as schema

    from .tflite_file import NP_TYPES

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as raw:
        model = schema.Model.GetRootAsModel(raw, 0)

        def describe(graph, index: int) -> dict:
            t = graph.Tensors(index)
            dtype = NP_TYPES.get(t.Type())
            return {"shape": [int(d) for d in t.ShapeAsNumpy()] if t.ShapeLength() else [],
                    "dtype": str(np.dtype(dtype)) if dtype is not None else f"tflite type {t.Type()}"}

        if model.SignatureDefsLength():
            sig = model.SignatureDefs(0)
            graph = model.Subgraphs(sig.SubgraphIndex())
            ins = {sig.Inputs(i).Name().decode(): describe(graph, sig.Inputs(i).TensorIndex()) for i in range(sig.InputsLength())}
            outs, by_tensor = {}, {}
            for i in range(sig.OutputsLength()):
                name, index = sig.Outputs(i).Name().decode(), sig.Outputs(i).TensorIndex()
                outs[name] = describe(graph, index)
                by_tensor.setdefault(index, []).append(name)
            shared = [names for names in by_tensor.values() if len(names) > 1]
        else:
            graph = model.Subgraphs(0)
            ins = {f"input_{i}": describe(graph, graph.Inputs(i)) for i in range(graph.InputsLength())}
            outs = {f"output_{i}": describe(graph, graph.Outputs(i)) for i in range(graph.OutputsLength())}
            shared = []
    return ins, outs, shared


def _check_files(bundle: Path, man: dict, found: Found) -> None:
    from .bundle import resolve_in_bundle

    entries = []
    for name, entry in (man.get("components") or {}).items():
        if isinstance(entry, dict):
            entries.append((name, entry, True))
            if isinstance(entry.get("golden"), dict):
                entries.append((f"golden of {name}", entry["golden"], False))
    for key in tokenizer_blocks(man):
        for fname, entry in ((man.get(key) or {}).get("files") or {}).items():
            entries.append((f"{key} file {fname}", entry, False))
    if isinstance(man.get("time_embedding"), dict):
        entries.append(("time embedding table", man["time_embedding"], False))
    for base in CHUNKABLE:
        block = man.get(block_key(base))
        if isinstance(block, dict) and isinstance(block.get("golden"), dict):
            entries.append((f"golden of the chunked {base}", block["golden"], False))
    for what, entry, is_model in entries:
        try:
            path = Path(entry["_path"]) if "_path" in entry else resolve_in_bundle(bundle, entry.get("path"), what)
        except PocketdiffError as e:
            found.add(str(entry.get("path")), "path", str(e))
            continue
        if not path.is_file():
            found.add(str(entry.get("path")), "present", f"{what} file is missing")
            continue
        size = path.stat().st_size
        if is_int(entry.get("bytes")) and entry["bytes"] != size:
            found.add(str(entry.get("path")), "size", f"{size} bytes, the manifest says {entry['bytes']} ({what})")
        if is_model:
            _check_signature(path, entry, what.split()[-1], found)
    te = man.get("time_embedding")
    if isinstance(te, dict) and isinstance(te.get("shape"), list):
        _check_npy(bundle, te, found)


def _check_signature(path: Path, entry: dict, name: str, found: Found) -> None:
    try:
        check_component_io(name, entry, path)
    except BundleCheckError as e:
        if e.check != "manifest":  # a malformed io list is reported by the field checks
            found.add(str(entry.get("path")), "signature", f"components.{name}: {e.detail}")
    except Exception as e:  # noqa: BLE001 - flatbuffers raises plain errors on damaged files
        found.add(str(entry.get("path")), "signature", f"cannot read the model's inputs and outputs ({type(e).__name__}: {e})")


def _check_npy(bundle: Path, te: dict, found: Found) -> None:
    from .bundle import resolve_in_bundle

    rel = str(te.get("path"))
    try:
        path = Path(te["_path"]) if "_path" in te else resolve_in_bundle(bundle, te.get("path"), "time embedding table")
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)  # the header only: nothing is loaded or unpickled
    except (OSError, ValueError, PocketdiffError) as e:
        found.add(rel, "file", f"not a readable .npy ({e})")
        return
    if list(shape) != te["shape"]:
        found.add(rel, "shape", f"holds {list(shape)}, the manifest's time_embedding.shape says {te['shape']}")
    if dtype.hasobject or str(dtype) != str(te.get("dtype", "float32")):
        found.add(rel, "dtype", f"holds {dtype}, the manifest's time_embedding.dtype says {te.get('dtype', 'float32')}")


# ------------------------------------------------------------------------------- entry points


def manifest_problems(bundle: str | Path, manifest: dict, need: Optional[Iterable[str]] = None,
                      files: bool = True) -> list[Problem]:
    """Every problem of `manifest` (as `load_manifest` returns it, or the raw JSON) and, with
    `files`, of the files it names. `need`: components that must be present (default: what the
    runner needs: every stage's component, named with its stage by the pipeline check)."""
    found = Found()
    for check in FIELD_CHECKS:
        check(manifest, found)
    # need None: the pipeline's stages say what must be present, and its check names the stage that runs a missing one
    _check_components(manifest, () if need is None else need, found, runnable=need is None)
    if files:
        _check_files(Path(bundle), manifest, found)
    return found.items


def check_bundle(bundle: str | Path, manifest: Optional[dict] = None, need: Optional[Iterable[str]] = None,
                 ledger=None) -> dict:
    """`load_manifest` (with `ledger`, runtime/verified_files.py) + `manifest_problems`; raises the first problem as
    one line naming the field or file and the check. Returns the manifest."""
    from .bundle import load_manifest

    man = manifest if manifest is not None else load_manifest(bundle, ledger=ledger)
    problems = manifest_problems(bundle, man, need)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise PocketdiffError(problems[0].line(bundle) + more)
    return man


# ------------------------------------------------------------------------------- verify-bundle's API (issue 18)


def _io_list(entry: Any, component: str, key: str) -> list[dict]:
    items = entry.get(key)
    if not isinstance(items, list) or not items:
        raise BundleCheckError(component, "manifest", f"'{key}' must be a non-empty list of {{name, shape, dtype}}")
    for i, it in enumerate(items):
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            raise BundleCheckError(component, "manifest", f"{key}[{i}] has no name")
        shape = it.get("shape")
        if not isinstance(shape, list) or not all(is_int(d) and d > 0 for d in shape):
            raise BundleCheckError(component, "manifest", f"{key}[{i}] ({it['name']}): shape must be a list of positive ints, got {shape!r}")
        try:
            np.dtype(it.get("dtype"))
        except TypeError:
            raise BundleCheckError(component, "manifest", f"{key}[{i}] ({it['name']}): unknown dtype {it.get('dtype')!r}") from None
    return items


def tflite_io(path: str | Path) -> dict[str, list]:
    """{"inputs": [...], "outputs": [...]} of a .tflite's first signature: name, shape, dtype; and
    "shared_outputs": the groups of output names that name one tensor (none in a well-formed file)."""
    ins, outs, shared = _read_signature(path)
    return {**{key: [{"name": n, **d} for n, d in io.items()] for key, io in (("inputs", ins), ("outputs", outs))},
            "shared_outputs": shared}


def check_component_io(name: str, entry: dict, path: Optional[str | Path] = None) -> dict:
    """The manifest's inputs/outputs against the .tflite's signature (names, shapes, dtypes).
    Returns the .tflite's io. A single output is matched whatever its name (the converter's)."""
    io = tflite_io(path or entry["_path"])
    if io["shared_outputs"]:
        raise BundleCheckError(name, "io", f"outputs {' and '.join(io['shared_outputs'][0])} are one tensor in the .tflite, which "
                               "runners return under one name: re-export the bundle")
    for key in ("inputs", "outputs"):
        want = {i["name"]: i for i in _io_list(entry, name, key)}
        got = {i["name"]: i for i in io[key]}
        if key == "outputs" and len(want) == len(got) == 1:  # output names are the converter's
            want = {"_": next(iter(want.values()))}
            got = {"_": next(iter(got.values()))}
        if set(want) != set(got):
            raise BundleCheckError(name, "io", f"{key} {sorted(got)} in the .tflite, manifest says {sorted(want)}")
        for n, w in want.items():
            g = got[n]
            label = f"{key[:-1]} '{w['name']}'"
            if list(g["shape"]) != list(w["shape"]):
                raise BundleCheckError(name, "io", f"{label} has shape {g['shape']} in the .tflite, manifest says {w['shape']}")
            if np.dtype(g["dtype"]) != np.dtype(w["dtype"]):
                raise BundleCheckError(name, "io", f"{label} has dtype {g['dtype']} in the .tflite, manifest says {w['dtype']}")
    return io
