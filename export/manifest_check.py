"""Checks of a bundle's manifest that need no model run: shared by `pocketdiff verify-bundle`,
`pocketdiff run-bundle` and the end of `pocketdiff export`.

Each check raises `BundleCheckError` naming the component (or "manifest" / "tokenizer") and the
check that failed, so the CLI prints one line such as

    verify-bundle: unet: io: input 'sample' has shape [1, 4, 64, 64] in the .tflite, manifest says [2, 4, 64, 64]

Imports only numpy and the flatbuffer schema of ai-edge-litert (no torch).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from pocketdiff.errors import PocketdiffError

REQUIRED_SECTIONS = ("image", "latent", "guidance", "scheduler", "tokenizer", "components")
GUIDANCE_MODES = ("cfg", "embedded", "none")
PRECISIONS = ("fp16", "fp32")


class BundleCheckError(PocketdiffError):
    """A bundle failed one named check of one component."""

    def __init__(self, component: str, check: str, detail: str):
        self.component, self.check, self.detail = component, check, detail
        super().__init__(f"{component}: {check}: {detail}")


def _io_list(entry: Any, component: str, key: str) -> list[dict]:
    items = entry.get(key)
    if not isinstance(items, list) or not items:
        raise BundleCheckError(component, "manifest", f"'{key}' must be a non-empty list of {{name, shape, dtype}}")
    for i, it in enumerate(items):
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            raise BundleCheckError(component, "manifest", f"{key}[{i}] has no name")
        shape = it.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s > 0 for s in shape):
            raise BundleCheckError(component, "manifest", f"{key}[{i}] ({it['name']}): shape must be a list of positive ints, got {shape!r}")
        try:
            np.dtype(it.get("dtype"))
        except TypeError:
            raise BundleCheckError(component, "manifest", f"{key}[{i}] ({it['name']}): unknown dtype {it.get('dtype')!r}") from None
    return items


def check_manifest_fields(manifest: dict) -> None:
    """The sections and fields a runner reads, with their types (no file access)."""
    for sec in REQUIRED_SECTIONS:
        if sec not in manifest:
            raise BundleCheckError("manifest", "fields", f"missing section '{sec}'")
    g = manifest["guidance"]
    if not isinstance(g, dict) or g.get("mode") not in GUIDANCE_MODES:
        raise BundleCheckError("manifest", "fields", f"guidance.mode must be one of {GUIDANCE_MODES}, got {g.get('mode') if isinstance(g, dict) else g!r}")
    if g.get("unet_batch") not in (1, 2) or (g["mode"] == "cfg") != (g["unet_batch"] == 2):
        raise BundleCheckError("manifest", "fields", f"guidance.unet_batch {g.get('unet_batch')!r} does not fit mode {g['mode']!r} (cfg: 2, else 1)")
    s = manifest["scheduler"]
    ts = s.get("timesteps") if isinstance(s, dict) else None
    if not isinstance(ts, list) or not ts or not all(isinstance(t, int) for t in ts):
        raise BundleCheckError("manifest", "fields", "scheduler.timesteps must be a non-empty list of ints")
    n_train = s.get("num_train_timesteps")
    alphas = s.get("alphas_cumprod")
    if not isinstance(n_train, int) or not isinstance(alphas, list) or len(alphas) != n_train:
        raise BundleCheckError("manifest", "fields", f"scheduler.alphas_cumprod must hold num_train_timesteps={n_train!r} values")
    if any(t < 0 or t >= n_train for t in ts):
        raise BundleCheckError("manifest", "fields", f"scheduler.timesteps must lie in [0, {n_train})")
    lat = manifest["latent"]
    for k in ("channels", "height", "width"):
        if not isinstance(lat, dict) or not isinstance(lat.get(k), int) or lat[k] <= 0:
            raise BundleCheckError("manifest", "fields", f"latent.{k} must be a positive int")
    tok = manifest["tokenizer"]
    if not isinstance(tok, dict) or "tokenizer.json" not in (tok.get("files") or {}):
        raise BundleCheckError("tokenizer", "fields", "tokenizer.files must list tokenizer.json")
    for k in ("max_length", "pad_id"):
        if not isinstance(tok.get(k), int):
            raise BundleCheckError("tokenizer", "fields", f"tokenizer.{k} must be an int")
    comps = manifest["components"]
    if not isinstance(comps, dict) or not comps:
        raise BundleCheckError("manifest", "fields", "components must name at least one component")
    for name, entry in comps.items():
        if not isinstance(entry, dict):
            raise BundleCheckError(name, "manifest", "entry must be an object")
        _io_list(entry, name, "inputs")
        _io_list(entry, name, "outputs")
        golden = entry.get("golden")
        if golden is not None:
            tol = golden.get("tolerances") if isinstance(golden, dict) else None
            if not isinstance(tol, dict):
                raise BundleCheckError(name, "manifest", "golden.tolerances missing")
            for p, th in tol.items():
                if p not in PRECISIONS or not isinstance(th, dict) or not {"cosine_min", "psnr_min_db"} <= set(th):
                    raise BundleCheckError(name, "manifest", f"golden.tolerances.{p} must be fp16/fp32 with cosine_min and psnr_min_db")
    if "unet" in comps:  # the UNet's inputs must fit the latent and guidance sections
        ins = {i["name"]: i for i in comps["unet"]["inputs"]}
        want = [g["unet_batch"], lat["channels"], lat["height"], lat["width"]]
        if "sample" in ins and ins["sample"]["shape"] != want:
            raise BundleCheckError("unet", "manifest", f"input 'sample' shape {ins['sample']['shape']} does not fit latent/guidance {want}")


def tflite_io(path: str | Path) -> dict[str, list[dict]]:
    """{"inputs": [...], "outputs": [...]} of a .tflite's first signature: name, shape, dtype."""
    from .tflite_file import NP_TYPES, TfliteModel

    m = TfliteModel(path)
    sigs = m.model.signatureDefs or []
    out: dict[str, list[dict]] = {"inputs": [], "outputs": []}
    sg_index = sigs[0].subgraphIndex if sigs else 0
    graph = m.model.subgraphs[sg_index]

    def describe(name: str, tensor_index: int) -> dict:
        t = graph.tensors[tensor_index]
        return {"name": name, "shape": [int(s) for s in (t.shape if t.shape is not None else [])],
                "dtype": np.dtype(NP_TYPES.get(t.type, np.float32)).name}

    if sigs:
        for key, items in (("inputs", sigs[0].inputs), ("outputs", sigs[0].outputs)):
            for it in items or []:
                name = it.name.decode() if isinstance(it.name, bytes) else str(it.name)
                out[key].append(describe(name, int(it.tensorIndex)))
    else:
        for key, idx in (("inputs", graph.inputs), ("outputs", graph.outputs)):
            for j, ti in enumerate(idx if idx is not None else []):
                out[key].append(describe(f"{key[:-1]}_{j}", int(ti)))
    return out


def check_component_io(name: str, entry: dict, path: Optional[str | Path] = None) -> dict:
    """The manifest's inputs/outputs against the .tflite's signature (names, shapes, dtypes).
    Returns the .tflite's io."""
    io = tflite_io(path or entry["_path"])
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


def load_golden(name: str, entry: dict) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(inputs by manifest name, reference output) of a component's golden file, checked
    against the manifest's io."""
    golden = entry.get("golden")
    if not golden or "_path" not in golden:
        raise BundleCheckError(name, "golden", "the manifest lists no golden file")
    try:
        data = np.load(golden["_path"], allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BundleCheckError(name, "golden", f"{golden.get('path')} does not load ({type(e).__name__}: {e})") from None
    with data:
        inputs = {}
        for i in entry["inputs"]:
            key = f"input_{i['name']}"
            if key not in data.files:
                raise BundleCheckError(name, "golden", f"{golden.get('path')} has no {key}")
            a = data[key]
            if list(a.shape) != list(i["shape"]):
                raise BundleCheckError(name, "golden", f"{key} has shape {list(a.shape)}, manifest says {i['shape']}")
            inputs[i["name"]] = a
        if "output_0" not in data.files:
            raise BundleCheckError(name, "golden", f"{golden.get('path')} has no output_0")
        ref = data["output_0"]
    if list(ref.shape) != list(entry["outputs"][0]["shape"]):
        raise BundleCheckError(name, "golden", f"output_0 has shape {list(ref.shape)}, manifest says {entry['outputs'][0]['shape']}")
    if not np.isfinite(ref).all():
        raise BundleCheckError(name, "golden", "the reference output holds NaN/Inf")
    return inputs, ref
