"""What `pocketdiff serve` may send, and nothing else: the bundle's own files and its page.

A URL path maps to a file only when it is
- `manifest.json`,
- a file the manifest names (a component, a golden, a tokenizer file, the time embedding table, a chunked model's
  golden: runtime/bundle.py's list), served only while it matches the manifest's sha256 and, for a model, passes
  the .tflite structure check, as run-bundle checks them (each file once per identity: size, times, device, inode;
  a file changed since is checked again before it is sent), or
- a regular file of the page folder `web/` (`pocketdiff web` writes it; no manifest names it), no dot-file.
Every path must resolve inside the bundle folder (a symbolic link that leaves it is refused), and a folder is never
listed. Anything else is a `Refused` with an HTTP status and a one-line reason.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import threading
import urllib.parse
from pathlib import Path
from typing import BinaryIO, Optional

from pocketdiff.errors import PocketdiffError
# the runtime's bundle reader and what it checks files with (tests/core/test_import_graph.py: web reads bundles
# through runtime.bundle alone)
from pocketdiff.runtime.bundle import MANIFEST, HashLedger, _file_entries, check_tflite_file, load_manifest, resolve_in_bundle

PAGE_DIR = "web"


class Refused(Exception):
    """A request serve answers with `status` and the one-line `reason`."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class MemoryLedger(HashLedger):
    """A HashLedger kept in memory for one serve: the files that passed, by identity (nothing is written)."""

    def __init__(self):  # noqa: D107 - no file behind it
        self.path, self.warn, self.files, self.changed = Path(os.devnull), lambda m: None, {}, False

    def save(self) -> None:
        self.changed = False


def url_to_relative(raw: str) -> str:
    """The request target's path as a bundle-relative POSIX path; `Refused` 400 for what no file name holds (bad
    %-escapes, NUL or control characters, backslashes), 404 for `/`, `.`, `..` and empty segments (a folder)."""
    path = raw.split("?", 1)[0].split("#", 1)[0]
    if not path.startswith("/"):
        raise Refused(400, "the request path must start with /")
    try:
        path = urllib.parse.unquote(path, errors="strict")
    except UnicodeDecodeError:
        raise Refused(400, "the request path is not UTF-8") from None
    if any(ord(c) < 32 or c in "\\\x7f" for c in path):
        raise Refused(400, "the request path holds a control character or a backslash")
    parts = path[1:].split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise Refused(404, "not found")
    return "/".join(parts)


class BundleFiles:
    """The files of `bundle` serve may send, each checked as the module docstring says (`verify=False`: the manifest's
    files are sent unchecked, for tests of the page's own checks)."""

    def __init__(self, bundle: str | Path, verify: bool = True):
        self.root = Path(bundle).resolve()
        self.verify = verify
        self.ledger = MemoryLedger()
        self._lock = threading.Lock()
        self._manifest_id: Optional[list] = None
        self._named: dict[str, tuple[dict, str, bool]] = {}

    def check_all(self) -> dict:
        """run-bundle's file checks on every file the manifest names, now (a bad bundle is refused before serving)."""
        return load_manifest(self.root, ledger=self.ledger)

    def open(self, rel: str) -> tuple[BinaryIO, os.stat_result]:
        """(the open file, its stat) for the bundle-relative path `rel`, or `Refused`."""
        if rel == MANIFEST:
            return self._open_inside(self.root / MANIFEST, self.root)
        if rel.split("/", 1)[0] == PAGE_DIR:
            if any(p.startswith(".") for p in rel.split("/")):
                raise Refused(404, "not found")
            return self._open_inside(self.root / rel, self.root / PAGE_DIR)
        named = self._manifest_files().get(rel)
        if named is None:
            raise Refused(404, "not found (serve sends manifest.json, the files it names and web/)")
        entry, what, is_model = named
        try:
            path = resolve_in_bundle(self.root, entry.get("path"), what)
        except PocketdiffError as e:
            raise Refused(403, str(e)) from None
        f, st = self._open_inside(path, self.root)
        if self.verify:
            try:
                self._check(f, st, path, entry, what, is_model)
            except BaseException:
                f.close()
                raise
        return f, st

    def _open_inside(self, path: Path, inside: Path) -> tuple[BinaryIO, os.stat_result]:
        """`path` opened when it resolves inside `inside` (itself inside the bundle) and is a regular file."""
        root = inside.resolve()
        full = path.resolve()
        if root != self.root and self.root not in root.parents:
            raise Refused(403, f"{inside.name}/ leaves the bundle folder (a link)")
        if root not in full.parents:
            raise Refused(403 if full.exists() else 404, "not found in the bundle folder" if not full.exists()
                          else "a link that leaves the bundle folder")
        try:
            f = open(full, "rb")  # noqa: SIM115 - the caller closes it after sending
        except (FileNotFoundError, NotADirectoryError):
            raise Refused(404, "not found") from None
        except IsADirectoryError:
            raise Refused(404, "a folder (serve lists none)") from None
        except OSError as e:
            raise Refused(403, f"cannot be read ({e.strerror or e})") from None
        st = os.fstat(f.fileno())
        if not _is_regular(st):
            f.close()
            raise Refused(404, "not a regular file")
        return f, st

    def _manifest_files(self) -> dict[str, tuple[dict, str, bool]]:
        """normalized path -> (entry, what, is a model) of the current manifest (read again when it changes)."""
        from pocketdiff.outputs import read_json

        mpath = self.root / MANIFEST
        with self._lock:
            try:
                st = mpath.stat()
                ident = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]
            except OSError:
                raise Refused(503, "the bundle has no manifest.json now") from None
            if ident != self._manifest_id:
                try:
                    man = read_json(mpath, f"bundle {self.root}")
                    comps = man.get("components") if isinstance(man, dict) else None
                    if not isinstance(comps, dict):
                        raise PocketdiffError(f"{mpath}: no components")
                    entries = _file_entries(man, None)
                except PocketdiffError as e:
                    raise Refused(503, str(e)) from None
                except (AttributeError, TypeError, KeyError, ValueError) as e:  # a field of the wrong kind
                    raise Refused(503, f"{mpath}: not a bundle manifest serve can read ({type(e).__name__}: {e})") from None
                self._named = {posixpath.normpath(e["path"]): (e, what, is_model) for e, what, is_model in entries
                               if isinstance(e, dict) and isinstance(e.get("path"), str) and e["path"]}
                self._manifest_id = ident
            return self._named

    def _check(self, f: BinaryIO, st: os.stat_result, path: Path, entry: dict, what: str, is_model: bool) -> None:
        """The manifest's sha256 (and a model's .tflite structure) for this identity of the file, once."""
        want = entry.get("sha256")
        if self.ledger.known(path, st) == want:
            return
        got = hashlib.file_digest(f, "sha256").hexdigest()
        f.seek(0)
        if got != want:
            raise Refused(409, f"sha256 mismatch for {entry.get('path')} ({what}): manifest {str(want)[:12]}..., "
                               f"file {got[:12]}...; serve sends no file that differs from its manifest")
        if is_model:
            try:
                check_tflite_file(path)
            except PocketdiffError as e:
                raise Refused(409, str(e)) from None
        self.ledger.note(path, st, got)


def _is_regular(st: os.stat_result) -> bool:
    import stat

    return stat.S_ISREG(st.st_mode)
