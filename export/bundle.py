"""Writing a bundle's manifest: the converter's side of runtime/bundle.py's contract.

`write_manifest` stamps the schema and version the runtime reads (`pocketdiff.runtime.bundle`);
`file_entry` is one file's {path, sha256, bytes}, relative to the bundle folder.
"""
from __future__ import annotations

import os
from pathlib import Path

from pocketdiff.outputs import write_json
from pocketdiff.runtime.bundle import MANIFEST, SCHEMA, SCHEMA_VERSION
from pocketdiff.runtime.tflite_file import sha256_file
from pocketdiff.runtime.chunks import CHUNKED_SCHEMA_VERSION, has_chunks
from pocketdiff.runtime.pipeline_spec import PIPELINE_SCHEMA_VERSION


def file_entry(bundle: Path, path: Path) -> dict:
    return {"path": os.path.relpath(path, bundle), "sha256": sha256_file(path), "bytes": path.stat().st_size}


def write_manifest(bundle: Path, manifest: dict) -> Path:
    # version 3: the manifest declares its pipeline (stages, roles); 1 and 2 (chunked) are what earlier exports wrote
    if "pipeline" in manifest:
        version = PIPELINE_SCHEMA_VERSION
    else:
        version = CHUNKED_SCHEMA_VERSION if has_chunks(manifest) else SCHEMA_VERSION  # version 1 readers refuse chunked models
    manifest = {"schema": SCHEMA, "schema_version": version, **manifest}
    path = bundle / MANIFEST
    write_json(path, manifest)
    return path
