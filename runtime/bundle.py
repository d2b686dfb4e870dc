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

import os
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


class _Hashes:
    """The sha256 of every file a manifest names, computed in threads from the start (hashlib lets the GIL go while it
    hashes: the files hash on several cores at once while the .tflite checks run in the caller's thread; an SD-2.1
    bundle's 1.3 GB was ~2 s of run-bundle's start-up, one file after another). `get` waits for one. Plain daemon
    threads (concurrent.futures costs ~15 ms to import; a refused bundle leaves no pool to join at exit)."""

    def __init__(self, paths: list[Path]):
        import threading

        self.todo, self.named, self.done = list(paths), set(paths), {}
        self.cond = threading.Condition()
        for _ in range(max(1, min(8, os.cpu_count() or 1, len(paths)))):
            threading.Thread(target=self._work, name="sha256", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self.cond:
                if not self.todo:
                    return
                path = self.todo.pop(0)
            try:
                got = (sha256_file(path), None)
            except Exception as e:  # noqa: BLE001 - raised by `get`, in the caller's order
                got = (None, e)
            with self.cond:
                self.done[path] = got
                self.cond.notify_all()

    def get(self, path: Path) -> str:
        if path not in self.named:
            return sha256_file(path)
        with self.cond:
            self.cond.wait_for(lambda: path in self.done)
            digest, error = self.done[path]
        if error is not None:
            raise error
        return digest

    def close(self) -> None:
        with self.cond:
            self.todo.clear()  # the threads end after the file each one is hashing


def _named_files(bundle: Path, manifest: dict, components: Optional[list[str]]) -> list[Path]:
    """The files load_manifest checks, largest first (a problem with one is raised by the check itself, in order)."""
    entries = []
    for name, entry in (manifest.get("components") or {}).items():
        if isinstance(entry, dict) and (components is None or name in components):
            entries += [entry, entry.get("golden")]
    files = manifest["tokenizer"].get("files") if isinstance(manifest.get("tokenizer"), dict) else None
    entries += (list(files.values()) if isinstance(files, dict) else []) + [manifest.get("time_embedding")]
    entries += [(manifest.get(block_key(base)) or {}).get("golden") for base in CHUNKABLE if isinstance(manifest.get(block_key(base)), dict)]
    found = set()
    for entry in entries:
        try:
            path = resolve_in_bundle(bundle, entry.get("path"), "file") if isinstance(entry, dict) else None
        except PocketdiffError:
            continue
        if path is not None and path.is_file():
            found.add(path)
    return sorted(found, key=lambda p: -p.stat().st_size)


def _check_entry(bundle: Path, entry: dict, what: str, verify_sha: bool, hashes: Optional[_Hashes] = None) -> Path:
    if not isinstance(entry, dict):
        raise PocketdiffError(f"manifest: {what} must be an object")
    path = resolve_in_bundle(bundle, entry.get("path"), what)
    if not path.is_file():
        raise PocketdiffError(f"bundle: {what} file {entry.get('path')} is missing")
    if verify_sha:
        want = entry.get("sha256")
        if not isinstance(want, str) or len(want) != 64:
            raise PocketdiffError(f"manifest: {what} has no sha256")
        got = hashes.get(path) if hashes is not None else sha256_file(path)
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
    hashes = _Hashes(_named_files(bundle, manifest, components)) if verify_sha else None
    try:
        _check_files(bundle, manifest, components, verify_sha, hashes)
    finally:
        if hashes is not None:
            hashes.close()
    manifest["_bundle"] = str(bundle.resolve())
    return manifest


def _check_files(bundle: Path, manifest: dict, components: Optional[list[str]], verify_sha: bool, hashes: Optional[_Hashes]) -> None:
    """Every file the manifest names: inside the bundle, present, its sha256 (`hashes`), a .tflite complete; `_path`s added."""
    check = lambda entry, what: _check_entry(bundle, entry, what, verify_sha, hashes)  # noqa: E731
    for name, entry in manifest["components"].items():
        if components is not None and name not in components:
            continue
        path = check(entry, f"component {name}")
        check_tflite_file(path)
        entry["_path"] = str(path)
        golden = entry.get("golden")
        if golden:
            golden["_path"] = str(check(golden, f"golden of {name}"))
    tok = manifest.get("tokenizer") or {}
    for fname, entry in (tok.get("files") or {}).items():
        entry["_path"] = str(check(entry, f"tokenizer file {fname}"))
    te = manifest.get("time_embedding")
    if te:
        te["_path"] = str(check(te, "time embedding table"))
    for base in CHUNKABLE:
        chunks = manifest.get(block_key(base))
        if isinstance(chunks, dict) and isinstance(chunks.get("golden"), dict):
            chunks["golden"]["_path"] = str(check(chunks["golden"], f"golden of the chunked {base}"))
