"""The mobile bundle: manifest.json + one .tflite per component + tokenizer + goldens.

manifest.json (schema `pocketdiff-bundle`, version 1; version 2 with `unet_chunks`):

    schema, schema_version, created_by
    image: {height, width, channels}
    latent: {channels, height, width, vae_factor}
    guidance: {mode: cfg|embedded|none, scale, unet_batch}
    scheduler: {type: ddim, prediction_type, num_train_timesteps, steps, timesteps,
                alphas_cumprod, final_alpha_cumprod, timestep_spacing, steps_offset, eta}
    tokenizer: {files: {name: {path, sha256}}, max_length, pad_id, bos_id, eos_id, golden: {prompt, ids}}
    time_embedding: null | {path, sha256, shape, dtype}  (table [num_train_timesteps, T])
    components: {name: {path, sha256, bytes, weights, inputs: [{name, shape, dtype}],
                        outputs: [...], fully_accelerated, golden: {path, sha256, tolerances}}}
    vae_tiling: absent | {tile, overlap, passes, factor, norms: [K, G], features, components,
                          parity_psnr_db}  (the decoder as vae_decoder_head + vae_up_tile)
    unet_chunks: absent | {components: [unet.0, ...], inputs, golden, stages, params, parity, aliases}
                 (schema_version 2: the UNet as K files run in sequence; runtime/unet_chunks.py)
    provenance: {source, arch, versions, config}

Every path is relative to the bundle folder; `load_manifest` refuses paths that escape it
(absolute, `..`, symlinks pointing outside), missing files, sha256 mismatches and truncated
or corrupted .tflite files. The converter writes the manifest (pocketdiff.export.bundle);
manifest_check.py holds the field-by-field checks a runner relies on.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pocketdiff.errors import PocketdiffError
from pocketdiff.outputs import read_json

from .tflite_file import check_tflite_file, sha256_file
from .chunks import CHUNKABLE, CHUNKED_SCHEMA_VERSION, block_key, has_chunks

SCHEMA = "pocketdiff-bundle"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


def resolve_in_bundle(bundle: Path, rel: Any, what: str) -> Path:
    """`bundle / rel`, refusing anything that leaves the bundle folder."""
    if not isinstance(rel, str) or not rel:
        raise PocketdiffError(f"manifest: {what} path must be a non-empty string, got {rel!r}")
    p = Path(rel)
    if p.is_absolute() or rel.startswith(("/", "\\")) or ".." in p.parts or (len(rel) > 1 and rel[1] == ":"):
        raise PocketdiffError(f"manifest: {what} path {rel!r} escapes the bundle folder")
    root = bundle.resolve()
    full = (bundle / p).resolve()
    if full != root and root not in full.parents:
        raise PocketdiffError(f"manifest: {what} path {rel!r} escapes the bundle folder (via a link)")
    return full


def _check_entry(bundle: Path, entry: dict, what: str, verify_sha: bool) -> Path:
    if not isinstance(entry, dict):
        raise PocketdiffError(f"manifest: {what} must be an object")
    path = resolve_in_bundle(bundle, entry.get("path"), what)
    if not path.is_file():
        raise PocketdiffError(f"bundle: {what} file {entry.get('path')} is missing")
    if verify_sha:
        want = entry.get("sha256")
        if not isinstance(want, str) or len(want) != 64:
            raise PocketdiffError(f"manifest: {what} has no sha256")
        got = sha256_file(path)
        if got != want:
            raise PocketdiffError(f"bundle: sha256 mismatch for {entry.get('path')} ({what}): manifest {want[:12]}..., file {got[:12]}...")
    return path


def _check_version(mpath: Path, manifest: dict) -> None:
    """Version 1, or 2 for a model in chunks (`unet_chunks`, `text_encoder_chunks`): each version with its own layout only."""
    version, chunked = manifest.get("schema_version"), has_chunks(manifest)
    if version not in (SCHEMA_VERSION, CHUNKED_SCHEMA_VERSION):
        raise PocketdiffError(f"{mpath}: schema version {version!r} is not supported (expected {SCHEMA_VERSION} or {CHUNKED_SCHEMA_VERSION})")
    if chunked != (version == CHUNKED_SCHEMA_VERSION):
        raise PocketdiffError(f"{mpath}: schema version {version} " + ("is for a model in chunks (unet_chunks or text_encoder_chunks), which this manifest lacks"
                              if not chunked else f"cannot hold {' or '.join(block_key(b) for b in CHUNKABLE if block_key(b) in manifest)} (a chunked model is version {CHUNKED_SCHEMA_VERSION})"))


def load_manifest(bundle: str | Path, verify_sha: bool = True, components: Optional[list[str]] = None) -> dict:
    """Read and check a bundle's manifest; returns it with absolute `_path`s added."""
    bundle = Path(bundle)
    mpath = bundle / MANIFEST
    if not bundle.is_dir():
        raise PocketdiffError(f"bundle {bundle}: not a folder")
    if not mpath.is_file():
        raise PocketdiffError(f"bundle {bundle}: no {MANIFEST}")
    manifest = read_json(mpath, f"bundle {bundle}")
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise PocketdiffError(f"{mpath}: not a pocketdiff bundle manifest")
    _check_version(mpath, manifest)
    comps = manifest.get("components")
    if not isinstance(comps, dict) or not comps:
        raise PocketdiffError(f"{mpath}: no components")
    for name, entry in comps.items():
        if components is not None and name not in components:
            continue
        path = _check_entry(bundle, entry, f"component {name}", verify_sha)
        check_tflite_file(path)
        entry["_path"] = str(path)
        golden = entry.get("golden")
        if golden:
            golden["_path"] = str(_check_entry(bundle, golden, f"golden of {name}", verify_sha))
    tok = manifest.get("tokenizer") or {}
    for fname, entry in (tok.get("files") or {}).items():
        entry["_path"] = str(_check_entry(bundle, entry, f"tokenizer file {fname}", verify_sha))
    te = manifest.get("time_embedding")
    if te:
        te["_path"] = str(_check_entry(bundle, te, "time embedding table", verify_sha))
    for base in CHUNKABLE:
        chunks = manifest.get(block_key(base))
        if isinstance(chunks, dict) and isinstance(chunks.get("golden"), dict):
            chunks["golden"]["_path"] = str(_check_entry(bundle, chunks["golden"], f"golden of the chunked {base}", verify_sha))
    manifest["_bundle"] = str(bundle.resolve())
    return manifest
