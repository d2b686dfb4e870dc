"""Output folders, reports and atomic writes shared by every verb."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from .errors import PocketdiffError

log = logging.getLogger(__name__)


MARKER = ".pocketdiff-output.json"  # in every output folder: what pocketdiff wrote there


def prepare_output_dir(path: str | Path, overwrite: bool = False, resume: bool = False,
                       inputs: Iterable[tuple[str, str | Path]] = (), verb: str = "") -> Path:
    """Create `path` and mark it as a pocketdiff output; refuse to touch a non-empty folder unless asked to.

    `inputs` are the run's (label, path) inputs (`config_inputs` finds a config's): an output
    that equals one, contains one or lies inside one is refused before anything is touched
    (with `resume`, an input inside the folder is allowed: nothing is removed). `resume`
    reuses the folder as it is (checkpoints inside it are read); `overwrite` removes what
    earlier pocketdiff runs wrote there (as the folder's marker file records) and keeps, with
    one warning line, any file they did not write; a non-empty folder without a marker is
    refused. Without either, an existing non-empty folder is an error, so nothing a user had
    is lost. `finish_output_dir` records the files a run wrote.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise PocketdiffError(f"output {out} exists and is not a folder")
    check_output_vs_inputs(out, inputs, removing=overwrite and not resume)
    entries = _inventory(out) if out.is_dir() else {}
    kept: list[str] = []
    if entries:
        if resume:
            _begin_run(out, verb, _foreign_at_start(out, entries, adopt=True))
            return out
        if not overwrite:
            raise PocketdiffError(f"output folder {out} is not empty (pass --overwrite to replace it, or --resume latest)")
        kept = _remove_pocketdiff_files(out, entries)
    out.mkdir(parents=True, exist_ok=True)
    _begin_run(out, verb, kept)
    return out


def finish_output_dir(path: str | Path) -> None:
    """Record in the marker every file and folder now in `path` that the run wrote (all but the
    ones kept from before), so a later --overwrite removes exactly those."""
    out = Path(path)
    marker = _read_marker(out) if out.is_dir() else None
    if marker is None:
        return
    kept = set(marker.get("kept") or [])
    marker["files"] = sorted(rel for rel in _inventory(out) if rel not in kept)
    marker["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json(out / MARKER, marker)


# Config keys whose values are paths even when written as a bare name ("teacher"); any other
# string counts as a path only when it looks like one ("runs/teacher", "./x", "~/x"), so enum
# words ("shapes", "cpu") never do, even where a folder of that name happens to exist.
PATH_KEYS = ("pretrained", "path", "vae", "unet", "checkpoint", "clip", "inception_weights", "file", "cache_dir",
             "teacher", "student", "bundle", "resume")
PATH_SUFFIXES = ("_path", "_dir", "_file", "_checkpoint", "_weights", "_folder")


def config_inputs(cfg: Any, prefix: str = "") -> list[tuple[str, Path]]:
    """(dotted key, path) for every path-like string in a config (dataclasses, lists, dicts)
    that names an existing file or folder; `pocketdiff:NAME` resolves to the shipped folder.
    Path-like: under a key in PATH_KEYS / ending in PATH_SUFFIXES, or written with a path
    separator or a leading `~` / `.`. Hub ids and prompts name no local path and are skipped."""
    from .shipped import PREFIX, resolve_shipped

    found: list[tuple[str, Path]] = []
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        for f in dataclasses.fields(cfg):
            found += config_inputs(getattr(cfg, f.name), f"{prefix}{f.name}.")
    elif isinstance(cfg, dict):
        for k, v in cfg.items():
            found += config_inputs(v, f"{prefix}{k}.")
    elif isinstance(cfg, (list, tuple)):
        for i, v in enumerate(cfg):
            found += config_inputs(v, f"{prefix.rstrip('.')}[{i}].")
    elif isinstance(cfg, (str, Path)) and str(cfg) and "\n" not in str(cfg) and len(str(cfg)) < 4096:
        text, key = str(cfg), prefix.rstrip(".").split(".")[-1].split("[")[0]
        pathish = (text.startswith((PREFIX, "~", ".")) or "/" in text or os.sep in text
                   or key in PATH_KEYS or key.endswith(PATH_SUFFIXES))
        try:
            path = Path(resolve_shipped(text)) if text.startswith(PREFIX) else Path(text).expanduser()
            if pathish and (path.exists() or path.is_symlink()):
                found.append((prefix.rstrip("."), path))
        except (OSError, ValueError, PocketdiffError):  # a missing shipped model: the verb names it
            pass
    return found


def _forms(path: Path) -> set[Path]:
    """The path as written (absolute, normalised) and with every symlink resolved."""
    return {Path(os.path.abspath(path)), path.resolve()}


def check_output_vs_inputs(output: str | Path, inputs: Iterable[tuple[str, str | Path]], removing: bool) -> None:
    """Refuse an output folder that equals, contains or lies inside an input (one line naming both).

    An input inside the output is refused only when the output is to be emptied (`removing`);
    an output equal to or inside an input always is (the run would write into its own input)."""
    outs = _forms(Path(output).expanduser())
    for label, inp in inputs:
        inp = Path(inp).expanduser()
        for o in outs:
            for i in _forms(inp):
                if o == i:
                    relation = "is"
                elif i.is_relative_to(o):
                    if not removing:
                        continue
                    relation = "contains"
                elif o.is_relative_to(i) and not i.is_file():
                    relation = "lies inside"
                else:
                    continue
                consequence = "--overwrite would delete it" if removing else "the run would write into its own input"
                raise PocketdiffError(f"output folder {output} {relation} the input {label} ({inp}): {consequence}; "
                                      "choose an --output outside every input")


def _inventory(out: Path) -> dict[str, bool]:
    """Relative posix path -> is a folder, for everything under `out` (symlinks as files, not
    followed), the marker and its temporary files left out."""
    found: dict[str, bool] = {}
    for root, dirs, files in os.walk(out):
        rel_root = Path(root).relative_to(out)
        for name in list(dirs):
            full = Path(root) / name
            if full.is_symlink():
                dirs.remove(name)
                files.append(name)
            else:
                found[(rel_root / name).as_posix()] = True
        for name in files:
            if rel_root == Path(".") and name.startswith(MARKER):
                continue
            found[(rel_root / name).as_posix()] = False
    return found


def _read_marker(out: Path) -> Optional[dict]:
    path = out / MARKER
    if not path.exists():
        return None
    marker = read_json(path, "output marker")
    if not isinstance(marker, dict) or marker.get("written_by") != "pocketdiff" or not all(
            isinstance(marker.get(k, []), (list, type(None))) for k in ("kept", "files")):
        raise PocketdiffError(f"{path}: not a pocketdiff output marker, so pocketdiff cannot tell which files here it wrote; "
                              "empty the folder yourself or choose another --output")
    return marker


def _foreign_at_start(out: Path, entries: dict[str, bool], adopt: bool) -> list[str]:
    """What in `out` pocketdiff did not write, as its marker tells (`adopt`: a folder without a
    marker that a run resumes counts as the run's own)."""
    marker = _read_marker(out)
    if marker is None:
        return [] if adopt else sorted(entries)
    if marker.get("files") is not None:  # the last run finished: it listed its files
        ours = set(marker["files"])
        return sorted(rel for rel in entries if rel not in ours)
    kept = set(marker.get("kept") or [])  # the last run was interrupted: all but what it kept is its own
    return sorted(rel for rel in entries if rel in kept)


def _remove_pocketdiff_files(out: Path, entries: dict[str, bool]) -> list[str]:
    """Remove what pocketdiff wrote in `out`; returns what stays (files it did not write)."""
    if _read_marker(out) is None:
        raise PocketdiffError(f"output folder {out} was not written by pocketdiff (no {MARKER} in it); "
                              "--overwrite only replaces pocketdiff outputs: choose another --output or empty it yourself")
    foreign = set(_foreign_at_start(out, entries, adopt=False))
    for rel, is_dir in entries.items():
        if not is_dir and rel not in foreign:
            (out / rel).unlink(missing_ok=True)
    for rel in sorted((r for r, d in entries.items() if d and r not in foreign), key=lambda r: -r.count("/")):
        with contextlib.suppress(OSError):  # a folder that still holds kept files stays
            (out / rel).rmdir()
    kept = sorted(rel for rel in _inventory(out))
    files = [rel for rel in kept if not entries.get(rel)]
    if files:
        shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        log.warning("--overwrite kept %d file(s) in %s that pocketdiff did not write: %s", len(files), out, shown)
    return kept


def _begin_run(out: Path, verb: str, kept: list[str]) -> None:
    write_json(out / MARKER, {"written_by": "pocketdiff", "version": 1, "verb": verb,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "finished": None,
                              "kept": list(kept), "files": None})


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _jsonable(value.item())
    return value


def read_json(path: str | Path, where: str = "") -> Any:
    """Parse a JSON file; a broken file is a one-line PocketdiffError naming it (and `where`)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PocketdiffError(f"{where + ': ' if where else ''}{path} is not valid JSON ({first})") from None


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """The sha256 hex digest of a file, read in `chunk`-byte blocks (the one helper: the runtime's bundle checks, export's
    manifest, the LoRA provenance)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def read_safetensors(path: str | Path, where: str = "") -> dict:
    """Load a safetensors file; a damaged one is a one-line PocketdiffError naming it (and `where`)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for corrupt files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PocketdiffError(f"{where + ': ' if where else ''}{path}: not a readable safetensors file ({first})") from None


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path in `path`'s folder to write; on success it is fsynced and renamed
    onto `path`, so a kill leaves the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; outputs are ordinary files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n")


def fsync_tree(folder: str | Path) -> None:
    """fsync every file and folder under `folder` (before an atomic rename of the folder)."""
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit_folder(tmp: str | Path, final: str | Path) -> Path:
    """Make a fully written temporary folder `final`: fsync its files, rename it into place
    (replacing an older `final`), fsync the parent. A kill at any point leaves either the old
    folder or the new one, never a torn one under the final name."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final
