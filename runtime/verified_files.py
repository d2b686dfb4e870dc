"""Which bundle files passed run-bundle's checks already, so a second launch does not check them again.

run-bundle checks every file's sha256 against the manifest, and every .tflite's structure (runtime/tflite_file.py),
before anything loads: at SD-2.1 size (1.2 GB, 22 graphs) 0.9 s of every launch on one H200's host
(benchmarks/results/weight_path_ledger_h200.json), 2.9 s on 2 cores. A
`HashLedger` remembers, per file that passed, the sha256 it had and the file's identity when it was hashed: size,
modification and status-change times in ns, device and inode. A later launch takes the remembered hash only
when all of them are unchanged (any write to the file, a copy over it, a rename of another file onto it
changes one; the status-change time cannot be set back by a user's tools); otherwise the file is hashed
again. A missing, unreadable or malformed ledger is the same as an empty one (a warning for the latter two),
and a ledger that cannot be written costs only the saving. Launches writing one ledger at once each
replace it whole (pocketdiff.outputs.atomic_write_text), so it is never half-written.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from pocketdiff.outputs import atomic_write_text

LEDGER_VERSION = 1
FILE_NAME = "verified.json"


def file_identity(st: os.stat_result) -> list:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]


def ledger_path(bundle: str | Path, cache_folder: Optional[Path] = None) -> Path:
    """`cache_folder/verified.json` (run-bundle's --gpu-cache FOLDER), else one file per bundle folder under the
    default cache root (runtime/gpu_cache.py) beside the GPU programs."""
    if cache_folder is not None:
        return Path(cache_folder) / FILE_NAME
    from .gpu_cache import default_cache_root

    where = Path(bundle).resolve()
    return default_cache_root().parent / "verified" / f"{where.name}-{hashlib.sha256(str(where).encode()).hexdigest()[:12]}.json"


class HashLedger:
    """path -> (identity, sha256) of the files that passed at earlier launches; `known` answers only for unchanged files."""

    def __init__(self, path: Path, warn: Callable[[str], None] = lambda m: print(f"warning: {m}", file=sys.stderr)):
        self.path, self.warn = Path(path), warn
        self.files: dict[str, list] = self._read()
        self.changed = False

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (FileNotFoundError, NotADirectoryError):  # none yet (or no folder for one: save() says so)
            return {}
        except (OSError, ValueError) as e:
            self.warn(f"hash ledger {self.path}: unreadable ({e}); every file is hashed again")
            return {}
        files = data.get("files") if isinstance(data, dict) and data.get("version") == LEDGER_VERSION else None
        if not isinstance(files, dict) or not all(isinstance(v, list) and len(v) == 2 for v in files.values()):
            self.warn(f"hash ledger {self.path}: not a version-{LEDGER_VERSION} ledger; every file is hashed again")
            return {}
        return files

    def known(self, path: Path, st: os.stat_result) -> Optional[str]:
        """The sha256 hashed earlier when the file is unchanged since, else None."""
        seen = self.files.get(str(path))
        return seen[1] if seen and seen[0] == file_identity(st) and isinstance(seen[1], str) else None

    def note(self, path: Path, st: os.stat_result, sha: str) -> None:
        """`sha` was read from `path` whose identity before the read was `st`."""
        self.files[str(path)] = [file_identity(st), sha]
        self.changed = True

    def save(self) -> None:
        if not self.changed:
            return
        try:
            atomic_write_text(self.path, json.dumps({"version": LEDGER_VERSION, "files": self.files}, sort_keys=True))
        except OSError as e:
            self.warn(f"hash ledger {self.path}: not written ({e.strerror or e}); the next launch hashes every file again")
        self.changed = False
