"""The mobile bundle: manifest.json + one .tflite per component + tokenizer + goldens.

manifest.json (schema `pocketdiff-bundle`, version 3 with its `pipeline` block; bundles from before it: version 1,
version 2 with `unet_chunks`):

    schema, schema_version, created_by
    image: {height, width, channels}
    latent: {channels, height, width, vae_factor}
    guidance: {mode: cfg|embedded|none, scale, unet_batch}
    scheduler: {type: ddim, prediction_type, num_train_timesteps, steps, timesteps,
                alphas_cumprod, final_alpha_cumprod, timestep_spacing, steps_offset, eta, clip_sample_range}
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

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from pocketdiff.errors import PocketdiffError
from pocketdiff.outputs import read_json

from .tflite_file import check_tflite_file, sha256_file
from .verified_files import HashLedger
from .chunks import CHUNKABLE, CHUNKED_SCHEMA_VERSION, block_key, has_chunks
from .pipeline_spec import PIPELINE_SCHEMA_VERSION
from .manifest_fields import tokenizer_blocks

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


def _check_entry(bundle: Path, entry: dict, what: str, verify_sha: bool, hashes: Optional[dict] = None) -> Path:
    if not isinstance(entry, dict):
        raise PocketdiffError(f"manifest: {what} must be an object")
    path = resolve_in_bundle(bundle, entry.get("path"), what)
    if not path.is_file():
        raise PocketdiffError(f"bundle: {what} file {entry.get('path')} is missing")
    if verify_sha:
        want = entry.get("sha256")
        if not isinstance(want, str) or len(want) != 64:
            raise PocketdiffError(f"manifest: {what} has no sha256")
        got = hashes[path].result() if hashes and path in hashes else sha256_file(path)
        if got != want:
            raise PocketdiffError(f"bundle: sha256 mismatch for {entry.get('path')} ({what}): manifest {want[:12]}..., file {got[:12]}...")
    return path


def _check_version(mpath: Path, manifest: dict) -> None:
    """Version 3: the manifest declares its pipeline (`pipeline`, runtime/pipeline_spec.py), chunked or not. Bundles
    exported before it: version 1, or 2 for a model in chunks (`unet_chunks`, `text_encoder_chunks`), each with its own
    layout only, read as the pipeline their layout implies (`pipeline_spec.derive_pipeline`)."""
    version, chunked = manifest.get("schema_version"), has_chunks(manifest)
    if version not in (SCHEMA_VERSION, CHUNKED_SCHEMA_VERSION, PIPELINE_SCHEMA_VERSION):
        raise PocketdiffError(f"{mpath}: schema version {version!r} is not supported (expected {SCHEMA_VERSION}, "
                              f"{CHUNKED_SCHEMA_VERSION} or {PIPELINE_SCHEMA_VERSION}): re-export the bundle with this pocketdiff")
    if version == PIPELINE_SCHEMA_VERSION:
        if not isinstance(manifest.get("pipeline"), dict):
            raise PocketdiffError(f"{mpath}: schema version {version} declares its pipeline, but the manifest has no pipeline block")
        return
    if chunked != (version == CHUNKED_SCHEMA_VERSION):
        raise PocketdiffError(f"{mpath}: schema version {version} " + ("is for a model in chunks (unet_chunks or text_encoder_chunks), which this manifest lacks"
                              if not chunked else f"cannot hold {' or '.join(block_key(b) for b in CHUNKABLE if block_key(b) in manifest)} (a chunked model is version {CHUNKED_SCHEMA_VERSION})"))
    if "pipeline" in manifest:
        raise PocketdiffError(f"{mpath}: schema version {version} cannot hold a pipeline block (version {PIPELINE_SCHEMA_VERSION} does)")


def load_manifest(bundle: str | Path, verify_sha: bool = True, components: Optional[list[str]] = None,
                  ledger: Optional[HashLedger] = None) -> dict:
    """Read and check a bundle's manifest; returns it with absolute `_path`s added. `ledger`: files unchanged since
    they passed at an earlier launch are neither hashed nor structure-checked again (runtime/verified_files.py)."""
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
    _check_files(bundle, _file_entries(manifest, components), verify_sha, ledger)
    manifest["_bundle"] = str(bundle.resolve())
    return manifest


def _file_entries(manifest: dict, components: Optional[list[str]]) -> list[tuple[Any, str, bool]]:
    """(entry, what, is a model) of every file the manifest names, in the manifest's order (the order errors come in)."""
    out = []
    for name, entry in manifest["components"].items():
        if components is None or name in components:
            out.append((entry, f"component {name}", True))
            if isinstance(entry, dict) and entry.get("golden"):
                out.append((entry["golden"], f"golden of {name}", False))
    for key in tokenizer_blocks(manifest):  # `tokenizer`, and the others encode stages name (SDXL's tokenizer_2)
        tok = manifest.get(key) or {}
        out += [(entry, f"{key} file {fname}", False) for fname, entry in (tok.get("files") or {}).items()]
    if manifest.get("time_embedding"):
        out.append((manifest["time_embedding"], "time embedding table", False))
    for base in CHUNKABLE:
        chunks = manifest.get(block_key(base))
        if isinstance(chunks, dict) and isinstance(chunks.get("golden"), dict):
            out.append((chunks["golden"], f"golden of the chunked {base}", False))
    return out


def _hash_in_threads(bundle: Path, entries: list, ledger: Optional[HashLedger]) -> tuple[ThreadPoolExecutor, dict, dict]:
    """Every named file that exists in the bundle hashed in threads, largest first (hashlib lets the GIL go: an SD-2.1
    bundle's 1.3 GB hashes on several cores while the .tflite checks run) -> (pool, path -> future, path -> its stat
    before hashing). A file the ledger knows unchanged is not hashed: its future holds the ledger's sha256. Paths that
    fail to resolve are left to the ordered checks, which name them."""
    paths = set()
    for entry, what, _ in entries:
        try:
            path = resolve_in_bundle(bundle, entry.get("path"), what) if isinstance(entry, dict) else None
        except PocketdiffError:
            continue
        if path is not None and path.is_file():
            paths.add(path)
    stats = {p: p.stat() for p in paths}
    pool = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(paths))), thread_name_prefix="sha256")
    futures, hashed = {}, {}
    for p in sorted(paths, key=lambda p: -stats[p].st_size):
        sha = ledger.known(p, stats[p]) if ledger is not None else None
        if sha is None:
            futures[p], hashed[p] = pool.submit(sha256_file, p), stats[p]
        else:
            futures[p] = Future()
            futures[p].set_result(sha)
    return pool, futures, hashed


def _check_files(bundle: Path, entries: list, verify_sha: bool, ledger: Optional[HashLedger] = None) -> None:
    """Each entry in order: inside the bundle, present, its sha256, a model's .tflite complete; its `_path` added. A
    refused bundle leaves no hashing behind (the pending files are cancelled); a checked one's hashes go in `ledger`,
    whose unchanged files skip both the hash and the .tflite check they passed at an earlier launch."""
    pool, hashes, hashed = _hash_in_threads(bundle, entries, ledger) if verify_sha else (None, {}, {})
    known = hashes.keys() - hashed.keys()  # unchanged since they passed every check at an earlier launch
    try:
        for entry, what, is_model in entries:
            path = _check_entry(bundle, entry, what, verify_sha, hashes)
            if is_model and path not in known:
                check_tflite_file(path)
            entry["_path"] = str(path)
        if ledger is not None:
            for path, st in hashed.items():
                ledger.note(path, st, hashes[path].result())
            ledger.save()
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
