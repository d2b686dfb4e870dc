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
- a folder that cannot be created or written: one warning line; when it holds an index (a read-only mount, a cache
  shipped with an app), each component whose entry has its key and whole files is read from it, the others compile
  without the cache, and nothing is written, removed or rebuilt there; without an index the run goes on without a cache.
- launches sharing the folder at once: a component compiled afresh is written into the launch's own private
  subfolder (`.tmp-<pid>-<component>`), then moved into the folder together with its index entry under an
  exclusive lock on `.lock` (the index re-read and merged there, so no launch's entries are lost and no entry
  fingerprints a file another launch is still writing). A file found changed against an index read earlier
  is checked again against the index on disk, under the lock, before it is called corrupt.

With `weight_cache` (run-bundle --weight-cache) the accelerator also keeps the converted weights
(`<key>_mldrift_weight_cache.bin`): the options add constant-tensor sharing and `serialize_external_tensors`
(WEIGHT_CACHE_OPTIONS, the leanest set benchmarks/weight_cache_repro.py showed to load and reuse). Those files are
recorded, checked and invalidated with the component's programs (one index entry, one key). The library is then
litert-lm-api's single build (runtime/litert_c.py); its identity (package version, size, sha256: `library_identity`,
hashed once and remembered in the folder's `library.json`) is part of every key, so a folder written by another
build is rebuilt. That library aborts the process on some graphs on the sharing path: a model's first compile with
sharing under a key is tried in a child process first (TRIAL_OPTION; runtime/sharing_trial.py), its verdict kept in the
folder's sharing.json, and a model that aborted there, or whose output with sharing was off from its output without it
(runtime/sharing_child.py; SHARING_MIN_COSINE, SHARING_MIN_PSNR_DB), loads without sharing. LiteRT itself rewrites a truncated weight
file (tried on lavapipe); the index's size + CRC-32 catches it before the accelerator sees it anyway.

Default folder: `$POCKETDIFF_CACHE` or `$XDG_CACHE_HOME/pocketdiff/gpu` (`~/.cache/...`), one subfolder
per bundle (its name and a hash of its components' sha256), so two bundles never evict each other.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Callable, Optional

from pocketdiff.outputs import atomic_write_text, sha256_file

INDEX = "index.json"
LOCK = ".lock"
PRIVATE = ".tmp-"
WEIGHT_SUFFIX = "_mldrift_weight_cache.bin"
SUFFIXES = ("_mldrift_program_cache.bin", WEIGHT_SUFFIX, "_mldrift_compiled_cache.bin")
LIBRARY_RECORD = "library.json"
# the weight cache's options (with serialization_dir, model_cache_key, serialize_program_cache): the reproducer's
# `sharing_weights_cached` set; LiteRT-LM's extra convert_weights_on_gpu / madvise_original_shared_tensors loaded as
# well but slower on both of its models (cold 0.117 vs 0.100 s); --gpu-option adds them
WEIGHT_CACHE_OPTIONS = {"enable_constant_tensors_sharing": True, "serialize_external_tensors": True}
# a model's first compile with sharing under a key: tried in a child first (runtime/sharing_trial.py), verdicts kept here
TRIAL_OPTION = "_weight_cache_trial"  # in a gpu_options dict: {"folder", "key", "name", "golden"}; popped by litert_c.CompiledModel
VERDICTS = "sharing.json"
# the trial's parity floors: a model's outputs with sharing (cold and warm) against its compile without sharing, same
# GPU, options and inputs, in the child. On lavapipe (smoke bundle, litert-lm-api 0.18.1): the UNet bit-identical, the
# decoder 61.9 dB / cosine 0.9999995 (fp16 weights converted apart); 40 dB leaves ~22 dB for other GPUs' rounding and
# is the image bar the weight-cache tests hold (58.6 dB measured); NVIDIA's sharing path gave images 18.7 dB off
SHARING_MIN_PSNR_DB = 40.0  # PSNR over the reference output's own range (runtime/parity.metrics)
SHARING_MIN_COSINE = 0.9999
TRIAL_VERSION = "parity-1"  # in weight-cache keys: verdicts and weights of a trial without the parity check are not read


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



# ops whose constants the sharing path cannot take: litert-lm-api 0.18.1 aborts the process (a CHECK, "EMBEDDING_LOOKUP:
# Unsupported external weights type: 1") on a float embedding table; such a model keeps its programs cached only
UNSHAREABLE_OPS = {7: "EMBEDDING_LOOKUP"}


def unshareable_ops(path: str | Path) -> list[str]:
    """The ops of a .tflite that the accelerator's constant-sharing path aborts on (its operator codes only, read
    lazily from the mapped file: milliseconds for any size)."""
    from ai_edge_litert import schema_py_generated as schema

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        model = schema.Model.GetRootAs(mm, 0)
        codes = {max(c.BuiltinCode(), c.DeprecatedBuiltinCode())
                 for c in (model.OperatorCodes(i) for i in range(model.OperatorCodesLength()))}
        del model
    return sorted(UNSHAREABLE_OPS[c] for c in codes if c in UNSHAREABLE_OPS)


def read_verdicts(folder: str | Path) -> dict:
    """key -> {"name", "shared", "signal", "message"}: the trial compiles' verdicts in FOLDER's sharing.json ({} when
    none or unreadable: each model is tried again, which is safe)."""
    try:
        data = json.loads((Path(folder) / VERDICTS).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def write_verdict(folder: str | Path, key: str, verdict: dict) -> None:
    """VERDICT under KEY in FOLDER's sharing.json, merged with the file on disk under the folder's lock (launches at
    once keep each other's verdicts); the same component's verdicts under other keys (another build, driver, bundle)
    go. An OSError propagates."""
    folder, name = Path(folder), verdict.get("name", "")
    with folder_lock(folder):
        record = {k: v for k, v in read_verdicts(folder).items() if v.get("name") != name or k == key}
        record[key] = verdict
        atomic_write_text(folder / VERDICTS, json.dumps(record, indent=1, sort_keys=True))


def _figure(value, unit: str = "") -> str:
    return "NaN/Inf" if value in (None, "nan") else f"{value}{unit}"


def verdict_label(verdict: dict) -> str:
    """A kept-off verdict in the report: `aborted (SIGABRT)` or `output off (cosine 0.91, PSNR 20.0 dB)`."""
    if verdict.get("verdict") == "wrong output":
        return f"output off (cosine {_figure(verdict.get('cosine'))}, PSNR {_figure(verdict.get('psnr_db'), ' dB')})"
    return f"aborted ({verdict.get('signal') or 'a signal'})"


def trial_warning(name: str, verdict: dict, folder: str | Path) -> str:
    """The one line that tells of a model whose trial compile died or computed something else (no `warning: ` prefix)."""
    where = f"recorded in {Path(folder) / VERDICTS}, loaded without the weight cache"
    if verdict.get("verdict") == "wrong output":
        return (f"gpu weight cache: {name}'s output with constant sharing is off from its output without it in a trial "
                f"compile (cosine {_figure(verdict.get('cosine'))}, PSNR {_figure(verdict.get('psnr_db'), ' dB')}, "
                f"{verdict.get('where') or 'an output'}; floors SHARING_MIN_COSINE={verdict.get('min_cosine')}, "
                f"SHARING_MIN_PSNR_DB={verdict.get('min_psnr_db')}); {where}")
    return (f"gpu weight cache: {name} aborted LiteRT in a trial compile with constant sharing ({verdict.get('signal')}: "
            f"{verdict.get('message') or 'no message'}); {where}")


def library_identity(lib: Path, folder: Optional[Path], warn: Optional[Callable[[str], None]] = None,
                     write: bool = True) -> str:
    """A LiteRT library's identity for cache keys: its package's version, size and sha256. The sha256 (a 130 MB file)
    is remembered in FOLDER's library.json by path, size and mtime, and read back while those match; with `write`
    false (a read-only folder) it is only read."""
    lib = Path(lib)
    st = lib.stat()
    mark = {"path": str(lib), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    record = Path(folder) / LIBRARY_RECORD if folder is not None else None
    digest = None
    if record is not None and record.is_file():
        try:
            known = json.loads(record.read_text())
            digest = known.get("sha256") if {k: known.get(k) for k in mark} == mark else None
        except (OSError, ValueError, AttributeError):
            digest = None
    if not isinstance(digest, str):
        digest = sha256_file(lib)
        if record is not None and write:
            try:
                atomic_write_text(record, json.dumps({**mark, "sha256": digest}, indent=1))
            except OSError as e:
                (warn or (lambda m: None))(f"gpu cache {record}: not written ({e.strerror or e}); the library is hashed again next time")
    dist = next(iter(sorted(lib.parent.parent.glob("litert_lm_api-*.dist-info"))), None)  # beside the package, no scan
    version = dist.name[len("litert_lm_api-"):-len(".dist-info")] if dist is not None else "unknown"
    return f"litert-lm-api {version} {lib.name} {st.st_size} sha256:{digest[:16]}"


def write_error(folder: Path) -> Optional[str]:
    """None when FOLDER exists (made if missing) and a file can be written in it; else why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
        return None
    except OSError as e:
        return str(e.strerror or e)


def writable_folder(folder: Path, warn, what: str, without: str) -> bool:
    """FOLDER made if missing and a file written in it; else one warning line (WHAT: not writable (why); WITHOUT)."""
    why = write_error(folder)
    if why is not None:
        warn(f"{what}: not writable ({why}); {without}")
    return why is None


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

    def __init__(self, folder: str | Path, identity: str, warn: Optional[Callable[[str], None]] = None,
                 weight_cache: bool = False, _perturb_trials: Optional[dict] = None):
        """`_perturb_trials` (tests only): {component: fraction}: its trial child adds noise of that fraction of each
        output's range to its sharing outputs, standing for a sharing path that computes something else."""
        self.folder = Path(folder)
        self.weight_cache = bool(weight_cache)
        self._perturb_trials = dict(_perturb_trials or {})
        # GPU, driver, LiteRT version (library), options: what else the programs depend on; weights kept: other files
        self.identity = identity + (f"|weight_cache|{TRIAL_VERSION}" if self.weight_cache else "")
        self.warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        self.token = os.urandom(4).hex()  # two caches of one process (tests, workers) keep apart too
        self.read_only = False  # a folder this launch cannot write, holding an index: its valid entries read, nothing written
        self._why_not = write_error(self.folder)
        self.enabled = self._why_not is None
        if self.enabled:
            self._remove_orphans()
        self.index = self._read_index() if self.enabled else self._read_only_index()
        self.keys: dict[str, str] = {}
        self.hits: dict[str, bool] = {}
        self._warned_other = False
        self.unshared: dict[str, list[str]] = {}  # weight cache on: components kept off the sharing path, and why
        self.settled: set[str] = set()  # components whose files this process verified or recorded: not read again
        # weight cache: each model's first compile with sharing, tried in a child first (runtime/sharing_trial.py)
        self.sharing = read_verdicts(self.folder) if self.weight_cache and (self.enabled or self.read_only) else {}
        self.trials: dict[str, str] = {}  # this launch's trials: pending, then shared | aborted (SIG...) | output off (...) | undecided

    def _read_only_index(self) -> dict:
        """A folder this launch cannot write: its index read when it has one (entries checked at each load; nothing
        removed, written or rebuilt there: one warning line), else none (one warning line: no cache)."""
        try:
            data = json.loads((self.folder / INDEX).read_text())
            usable = isinstance(data, dict) and bool(data) and all(isinstance(v, dict) for v in data.values())
        except (OSError, ValueError):
            usable = False
        if not usable:
            self.warn(f"gpu cache {self.folder}: not writable ({self._why_not}); running without a program cache")
            return {}
        self.read_only = True
        self.warn(f"gpu cache {self.folder}: not writable ({self._why_not}); read-only: its valid cached programs"
                  f"{' and weights' if self.weight_cache else ''} are read, nothing is written (a model without a valid "
                  "entry compiles without the cache)")
        return data

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

    def shares(self, name: str, entry: dict) -> bool:
        """Weight cache on and the component's file free of ops the sharing path aborts on (checked once)."""
        if not self.weight_cache:
            return False
        if name not in self.unshared:
            path = entry.get("_path")
            self.unshared[name] = unshareable_ops(path) if path and Path(path).is_file() else []
            seen = self.sharing.get(self.key(name, entry)) or {}
            if not self.unshared[name] and seen.get("shared") is False:  # its trial aborted or was off at an earlier launch
                self.unshared[name] = [verdict_label(seen)]
        return not self.unshared[name]

    def key(self, name: str, entry: dict) -> str:
        h = hashlib.sha256(f"{entry.get('sha256', '')}|{self.identity}".encode()).hexdigest()[:16]
        return f"{name}-{h}"

    def options_for(self, name: str, entry: dict) -> dict:
        """The accelerator options that read and write this component's programs (empty: no cache). Weight cache on, a
        model's first compile with sharing carries TRIAL_OPTION: litert_c compiles it in a child first."""
        if not self.enabled:
            return self._read_only_options(name, entry) if self.read_only else {}
        key = self.key(name, entry)
        share = self.shares(name, entry)
        if name in self.settled and self.keys.get(name) == key:  # a streamed chunk's next load: checked already
            return self._options(key, share=share)
        self.keys[name] = key
        old = self.index.get(name)
        hit = False
        if old is not None and old.get("key") != key:
            if not self._warned_other:  # one line: the other components' entries share the cause (a new driver, library)
                self.warn(f"gpu cache {self.folder}: {name}'s programs were made for another model, driver or LiteRT version; rebuilding")
            self._warned_other = True
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
            elif share and key not in self.sharing:  # its trial told nothing (an error in the child): compiled and tried again
                self._drop(name, old)
            else:
                hit = True
                self.settled.add(name)
        self.hits[name] = hit
        if hit:
            return self._options(key, share=share)
        private = self._private(name)  # compiled afresh: written apart, moved in by record()
        shutil.rmtree(private, ignore_errors=True)
        private.mkdir()
        options = self._options(key, private, share)
        if share and key not in self.sharing:  # never compiled with sharing under this key: a trial in a child first
            golden = (entry.get("golden") or {}).get("_path")
            options[TRIAL_OPTION] = {"folder": str(self.folder), "key": key, "name": name, "golden": golden,
                                     **({"perturb": self._perturb_trials[name]} if name in self._perturb_trials else {})}
            self.trials[name] = "pending"
        return options

    def _read_only_options(self, name: str, entry: dict) -> dict:
        """A read-only folder: the component's cache options when its entry has this key and whole files (checked once
        per launch), else none (it compiles without the cache: nothing is written, no trial)."""
        key = self.key(name, entry)
        if name not in self.hits or self.keys.get(name) != key:
            old = self.index.get(name) or {}
            self.keys[name] = key
            self.hits[name] = old.get("key") == key and bool(old.get("files")) and not self._bad_files(old)
        return self._options(key, share=self.shares(name, entry)) if self.hits[name] else {}

    def _bad_files(self, entry: dict) -> list[str]:
        return [f for f, mark in (entry.get("files") or {}).items()
                if not (self.folder / f).is_file() or _fingerprint(self.folder / f) != mark]

    def _options(self, key: str, folder: Optional[Path] = None, share: bool = False) -> dict:
        return {"serialization_dir": str(folder or self.folder), "model_cache_key": key, "serialize_program_cache": True,
                **(WEIGHT_CACHE_OPTIONS if share else {})}

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
        if self.trials.get(name) == "pending":
            self._trial_verdict(name)
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

    def _trial_verdict(self, name: str) -> None:
        """After a load whose options carried a trial (run here or in a worker): its verdict, read from the folder."""
        self.sharing = read_verdicts(self.folder)
        seen = self.sharing.get(self.keys.get(name, ""))
        if seen is None:  # the child failed with an error, not a signal: loaded without sharing, tried again next launch
            self.trials[name] = "undecided"
            self.unshared[name] = ["trial undecided"]
            self.warn(f"gpu weight cache: {name}'s trial compile with constant sharing ended with an error (its output "
                      "not checked); loaded without the weight cache, tried again at the next launch")
        elif seen.get("shared"):
            self.trials[name] = "shared"
        else:
            self.trials[name] = verdict_label(seen)
            self.unshared[name] = [self.trials[name]]
            self.warn(trial_warning(name, seen, self.folder))

    def weight_files(self) -> dict[str, str]:
        """Per component: `reused` (its weight file read from the folder), `made` (written now), `none` (not written),
        `skipped: OP` (an op the sharing path aborts on: programs cached only), `skipped: aborted (SIG...)` (its trial
        compile died: programs cached only), `skipped: output off (cosine C, PSNR P dB)` (its trial's output with sharing
        missed the floors), `off` (a read-only folder without a valid entry for it: no cache)."""
        if not ((self.enabled or self.read_only) and self.weight_cache):
            return {}
        files = {n: any(f.endswith(WEIGHT_SUFFIX) for f in (self.index.get(n) or {}).get("files") or {}) for n in self.hits}

        def state(n: str) -> str:
            if self.read_only and not self.hits[n]:
                return "off"
            if self.unshared.get(n):
                return f"skipped: {','.join(self.unshared[n])}"
            return ("reused" if self.hits[n] else "made") if files[n] else "none"

        return {n: state(n) for n in self.hits}

    def summary(self) -> dict:
        """The folder (read-only or not), each component's program-cache hit, the weight cache (off, made, reused or
        made+reused, and per component), this launch's trial compiles."""
        by = self.weight_files()
        states = sorted({v for v in by.values() if v in ("made", "reused")})
        state = "off" if not ((self.enabled or self.read_only) and self.weight_cache) else "+".join(states) if states else "none"
        return {"folder": str(self.folder) if self.enabled or self.read_only else None, "read_only": self.read_only,
                "hits": dict(self.hits), "weight_cache": state, "weight_cache_by_model": by,
                "trial_compiles": dict(self.trials)}
