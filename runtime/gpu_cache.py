"""The GPU accelerator's compiled-program cache, kept in a folder between launches.

LiteRT's GPU accelerator can write what it compiled (`<key>_mldrift_program_cache.bin`) into a
serialization folder under a model cache key, and read it back at the next load instead of compiling
again. This module owns that folder for a runner:

- the key of a component is its name plus a hash of everything the compiled programs depend on: the
  .tflite's sha256 (from the manifest), ai-edge-litert's version, the GPU and driver, and the options
  (precision, ...). A file made for another model, driver or version is never read: its key differs.
- `index.json` records, per component, the key and the size and CRC-32 of each file the accelerator wrote. At
  the next load an entry with another key ("made for another model, driver or LiteRT version"), a file
  whose bytes changed or went missing ("corrupt"), or an unreadable index gets ONE warning line, its
  files are removed, and the component is compiled afresh (and cached again). A corrupt file is thus
  never handed to the accelerator.
- a folder that cannot be created or written: one warning line, and the run goes on without a cache.
- launches sharing the folder at once: a component compiled afresh is written into the launch's own private
  subfolder (`.tmp-<pid>-<component>`), then moved into the folder together with its index entry under an
  exclusive lock on `.lock` (the index re-read and merged there, so no launch's entries are lost and no entry
  fingerprints a file another launch is still writing). A file found changed against an index read earlier
  is checked again against the index on disk, under the lock, before it is called corrupt.

Default folder: `$POCKETDIFF_CACHE` or `$XDG_CACHE_HOME/pocketdiff/gpu` (`~/.cache/...`), one subfolder
per bundle (its name and a hash of its components' sha256), so two bundles never evict each other.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Callable, Optional

INDEX = "index.json"
LOCK = ".lock"
PRIVATE = ".tmp-"
SUFFIXES = ("_mldrift_program_cache.bin", "_mldrift_weight_cache.bin", "_mldrift_compiled_cache.bin")


def default_cache_root() -> Path:
    if os.environ.get("POCKETDIFF_CACHE"):
        return Path(os.environ["POCKETDIFF_CACHE"]) / "gpu"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pocketdiff" / "gpu"


def bundle_digest(components: dict) -> str:
    """A hash of a bundle's components (their names and sha256): what its cached files belong to."""
    h = hashlib.sha256()
    for name in sorted(components):
        h.update(f"{name}:{components[name].get('sha256', '')};".encode())
    return h.hexdigest()


def bundle_cache_folder(bundle: str | Path, components: dict, root: Optional[Path] = None) -> Path:
    """`root/<bundle folder name>-<12 hex of its components' sha256>`."""
    return (root or default_cache_root()) / f"{Path(bundle).resolve().name}-{bundle_digest(components)[:12]}"


def _fingerprint(path: Path) -> str:
    """Size and CRC-32 of a cache file, in one read: enough to catch a truncated or damaged file (not a
    forgery), at several times sha256's speed: the UNet's file is 1.7 GB. Read once per launch and component
    (a streamed chunk loads once per step)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return f"{size}:{crc:08x}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def litert_version() -> str:
    """ai-edge-litert's version: the package's own `__version__` (importlib.metadata's lookup scans every installed
    distribution: ~0.1 s of start-up in a full environment), else the installed distribution's."""
    try:
        import ai_edge_litert

        if isinstance(getattr(ai_edge_litert, "__version__", None), str):
            return ai_edge_litert.__version__
        from importlib.metadata import version

        return version("ai-edge-litert")
    except Exception:  # noqa: BLE001 - an unknown version only means a narrower cache hit
        return "unknown"



def writable_folder(folder: Path, warn, what: str, without: str) -> bool:
    """FOLDER made if missing and a file written in it; else one warning line (WHAT: not writable (why); WITHOUT)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
        return True
    except OSError as e:
        warn(f"{what}: not writable ({e.strerror or e}); {without}")
        return False


@contextlib.contextmanager
def folder_lock(folder: Path):
    """An exclusive lock on FOLDER's lock file (another launch writing the same cache waits for it)."""
    with open(folder / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

class GpuProgramCache:
    """One folder of cached compiled programs; `options_for(name, entry)` before a component's load,
    `record(name)` after it. `warn` prints one line per problem (stderr by default)."""

    def __init__(self, folder: str | Path, identity: str, warn: Optional[Callable[[str], None]] = None):
        self.folder = Path(folder)
        self.identity = identity  # GPU, driver, LiteRT version, options: what else the programs depend on
        self.warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        self.token = os.urandom(4).hex()  # two caches of one process (tests, workers) keep apart too
        self.enabled = self._writable()
        if self.enabled:
            self._remove_orphans()
        self.index = self._read_index() if self.enabled else {}
        self.keys: dict[str, str] = {}
        self.hits: dict[str, bool] = {}
        self.settled: set[str] = set()  # components whose files this process verified or recorded: not read again

    def _writable(self) -> bool:
        return writable_folder(self.folder, self.warn, f"gpu cache {self.folder}", "running without a program cache")

    def _locked(self):
        """An exclusive lock on the folder (another launch's move and index update wait for it)."""
        return folder_lock(self.folder)

    def _private(self, name: str) -> Path:
        return self.folder / f"{PRIVATE}{os.getpid()}-{self.token}-{name}"

    def _remove_orphans(self) -> None:
        """Private subfolders of launches that are gone (killed mid-compile)."""
        for p in self.folder.glob(f"{PRIVATE}*"):
            pid = p.name[len(PRIVATE):].split("-", 1)[0]
            if p.is_dir() and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)

    def _read_index(self) -> dict:
        path = self.folder / INDEX
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
                raise ValueError("not an object of entries")
            return data
        except (OSError, ValueError) as e:
            self.warn(f"gpu cache {path}: unreadable ({e}); rebuilding it")
            self._remove_files(lambda name: True)
            return {}

    def _write_index(self) -> None:
        tmp = self.folder / f".{INDEX}.{os.getpid()}-{self.token}.tmp"
        try:
            tmp.write_text(json.dumps(self.index, indent=1, sort_keys=True))
            os.replace(tmp, self.folder / INDEX)
        except OSError as e:
            self.warn(f"gpu cache {self.folder}: index not written ({e.strerror or e}); the next launch compiles again")

    def _remove_files(self, match: Callable[[str], bool]) -> None:
        for p in self.folder.iterdir() if self.folder.is_dir() else []:
            if p.is_file() and p.name.endswith(SUFFIXES) and match(p.name):
                p.unlink(missing_ok=True)

    def key(self, name: str, entry: dict) -> str:
        h = hashlib.sha256(f"{entry.get('sha256', '')}|{self.identity}".encode()).hexdigest()[:16]
        return f"{name}-{h}"

    def options_for(self, name: str, entry: dict) -> dict:
        """The accelerator options that read and write this component's programs (empty: no cache)."""
        if not self.enabled:
            return {}
        key = self.key(name, entry)
        if name in self.settled and self.keys.get(name) == key:  # a streamed chunk's next load: checked already
            return self._options(key)
        self.keys[name] = key
        old = self.index.get(name)
        hit = False
        if old is not None and old.get("key") != key:
            self.warn(f"gpu cache {self.folder}: {name}'s programs were made for another model, driver or LiteRT version; rebuilding")
            self._drop(name, old)
        elif old is not None:
            bad = self._bad_files(old)
            if bad:  # another launch may have replaced the files since this one read the index: ask the disk
                with self._locked():
                    old = self._read_index().get(name) or old
                    bad = self._bad_files(old) if old.get("key") == key else bad
            if bad or not old.get("files"):
                self.warn(f"gpu cache {self.folder}: {name}'s cached programs are corrupt or missing ({', '.join(bad) or 'no files'}); rebuilding")
                self._drop(name, old)
            else:
                hit = True
                self.settled.add(name)
        self.hits[name] = hit
        if hit:
            return self._options(key)
        private = self._private(name)  # compiled afresh: written apart, moved in by record()
        shutil.rmtree(private, ignore_errors=True)
        private.mkdir()
        return self._options(key, private)

    def _bad_files(self, entry: dict) -> list[str]:
        return [f for f, mark in (entry.get("files") or {}).items()
                if not (self.folder / f).is_file() or _fingerprint(self.folder / f) != mark]

    def _options(self, key: str, folder: Optional[Path] = None) -> dict:
        return {"serialization_dir": str(folder or self.folder), "model_cache_key": key, "serialize_program_cache": True}

    def _drop(self, name: str, old: dict) -> None:
        key = old.get("key", "")
        with self._locked():
            self.index = self._read_index()
            current = self.index.get(name)
            if current is not None and current != old:
                return  # another launch rebuilt it meanwhile: its files stand
            self._remove_files(lambda f: bool(key) and f.startswith(key + "_"))
            for f in old.get("files") or {}:
                (self.folder / Path(f).name).unlink(missing_ok=True)
            self.index.pop(name, None)
            self._write_index()

    def record(self, name: str) -> None:
        """After a load: the files the accelerator wrote for this component, with their size and CRC-32."""
        if not self.enabled or name not in self.keys or self.hits.get(name) or name in self.settled:
            return
        key, private = self.keys[name], self._private(name)
        made = sorted(p for p in private.iterdir() if p.is_file() and p.name.startswith(key + "_")) if private.is_dir() else []
        files = {p.name: _fingerprint(p) for p in made}
        if files:
            with self._locked():  # files and their index entry together, merged into the index on disk
                self.index = self._read_index()
                for p in made:
                    os.replace(p, self.folder / p.name)
                self.index[name] = {"key": key, "files": files}
                self._write_index()
            self.settled.add(name)
        shutil.rmtree(private, ignore_errors=True)

    def summary(self) -> dict:
        return {"folder": str(self.folder) if self.enabled else None, "hits": dict(self.hits)}
