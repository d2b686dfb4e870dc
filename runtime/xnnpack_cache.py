"""XNNPACK's packed-weight cache for the models run-bundle runs on the CPU, kept between launches.

XNNPACK repacks a CPU model's float weights into its kernels' layout at every load (~3 s for the SD-2.1-size text
encoder's CPU variant on a 16-core H100 host, at every launch and every reload). ai-edge-litert's
`CpuOptions.xnnpack_weight_cache_path` names a FILE (not a folder) into which XNNPACK writes the packed weights at
the first load and from which it maps them at later ones. This module owns those files in `<cache folder>/xnnpack/`:

- a file's name holds a hash of everything the packed bytes depend on: the model file (its checked sha256 and, for an
  int8 file's CPU variant, the variant's version), ai-edge-litert's version, the CPU (model and instruction-set
  flags: XNNPACK packs for the kernels it picks on this CPU) and FORMAT. A file made for another model, LiteRT build
  or CPU is never read: its name differs.
- XNNPACK writes a new file under a private name (`.tmp-<pid>-<token>-<name>`); after the model's first run (a model
  released unrun keeps nothing: XNNPACK may pack some weights only at the first run) it is moved under its final name
  with a sidecar (`.ok`: size and a sampled CRC-32), under an exclusive lock on `.lock`; a launch that finds a good
  file already there (another launch made it meanwhile) drops its own. A killed launch thus leaves no
  half file under a final name, and XNNPACK never rewrites a file another launch may have mapped (it rewrites a file in
  place when it finds it damaged).
- a final file whose sidecar is missing or does not match (truncated, overwritten): one warning line, the files are
  removed and the weights packed afresh (and kept again). The sampled CRC (first and last MiB, 14 blocks between)
  catches a cut or replaced file, not a single flipped bit: the UNet-size files are gigabytes, read at each launch.
- a folder that cannot be created or written, or a load that fails with the cache: one warning line, and the model
  loads without it (as before). Files of other keys of the same component are removed when a new one is kept.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Callable, Optional

SUBFOLDER = "xnnpack"
FORMAT = 1  # bump when what goes into a file's key changes
SUFFIX = ".xnnpack"
PRIVATE = ".tmp-"


def cpu_identity() -> str:
    """The CPU's model name and instruction-set flags (Linux), else the platform's machine and processor."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        keep = [ln.split(":", 1)[1].strip() for ln in text.splitlines()
                if ln.split(":", 1)[0].strip() in ("model name", "flags", "Features", "CPU part")]
        if keep:
            return "|".join(sorted(set(keep)))
    except OSError:
        pass
    import platform

    return f"{platform.machine()}|{platform.processor()}"


def fingerprint(path: Path) -> str:
    """Size and a CRC-32 of the first and last MiB and 14 blocks of 64 KiB between: a cut or replaced file, cheaply."""
    size = path.stat().st_size
    spots = [(0, 1 << 20), (max(0, size - (1 << 20)), 1 << 20)] + [(size * k // 15, 1 << 16) for k in range(1, 15)]
    crc = 0
    with open(path, "rb") as f:
        for at, n in spots:
            f.seek(at)
            crc = zlib.crc32(f.read(n), crc)
    return f"{size}:{crc:08x}"


class Slot:
    """One model's cache file for one load: `path` to give XNNPACK ("" for none), `state` made | reused | off."""

    def __init__(self, path: str, state: str, final: Optional[Path] = None):
        self.path, self.state, self.final = path, state, final


class XnnpackWeightCache:
    """The packed-weight files of one cache folder: `slot(name, source_key)` before a CPU model's load, `keep(slot)`
    after it loaded, `drop(slot)` when it failed. `warn` prints one line per problem (stderr by default)."""

    def __init__(self, folder, warn: Optional[Callable[[str], None]] = None):
        from .gpu_cache import litert_version

        self.folder = Path(folder)
        self.warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        self.token = os.urandom(4).hex()
        self.identity = f"{FORMAT}|{litert_version()}|{cpu_identity()}"
        self.enabled = self._writable()
        if self.enabled:
            self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Private files of launches that are gone (killed while packing)."""
        from .gpu_cache import _alive

        for p in self.folder.glob(f"{PRIVATE}*"):
            pid = p.name[len(PRIVATE):].split("-", 1)[0]
            if p.is_file() and pid.isdigit() and not _alive(int(pid)):
                p.unlink(missing_ok=True)

    def _writable(self) -> bool:
        from .gpu_cache import writable_folder

        return writable_folder(self.folder, self.warn, f"xnnpack cache {self.folder}", "CPU models load without a weight cache")

    def _locked(self):
        from .gpu_cache import folder_lock

        return folder_lock(self.folder)  # the program cache's lock file name, in this cache's own folder

    def final_path(self, name: str, source_key: str) -> Path:
        key = hashlib.sha256(f"{source_key}|{self.identity}".encode()).hexdigest()[:20]
        return self.folder / f"{name}-{key}{SUFFIX}"

    @staticmethod
    def _good(final: Path) -> bool:
        ok = final.with_name(final.name + ".ok")
        try:
            return json.loads(ok.read_text()).get("fingerprint") == fingerprint(final)
        except (OSError, ValueError, AttributeError):
            return False

    def slot(self, name: str, source_key: str) -> Slot:
        """The file to load NAME's packed weights from (reused) or to pack them into (made, a private name)."""
        if not self.enabled or not source_key:
            return Slot("", "off")
        final = self.final_path(name, source_key)
        if final.exists() or final.with_name(final.name + ".ok").exists():
            if self._good(final):
                return Slot(str(final), "reused", final)
            self.warn(f"xnnpack cache {final}: damaged or incomplete (size or checksum differs); packed again")
            for p in (final, final.with_name(final.name + ".ok")):
                p.unlink(missing_ok=True)  # unlinked, not rewritten: a launch that mapped it keeps its bytes
        private = self.folder / f"{PRIVATE}{os.getpid()}-{self.token}-{final.name}"
        return Slot(str(private), "made", final)

    def keep(self, slot: Slot) -> None:
        """After a load that packed into `slot`: its file moved under the final name with its sidecar (unless another
        launch kept a good one meanwhile), other keys of the component removed. Failures: one warning, nothing kept."""
        if slot.state != "made":
            return
        private, final = Path(slot.path), slot.final
        try:
            if not private.is_file() or private.stat().st_size == 0:
                raise OSError("XNNPACK wrote no cache file")
            fp = fingerprint(private)
            with self._locked():
                if self._good(final):
                    private.unlink()
                    return
                for other in self.folder.glob(f"{final.name.rsplit('-', 1)[0]}-*{SUFFIX}*"):
                    if other.name not in (final.name, final.name + ".ok"):
                        other.unlink(missing_ok=True)
                self._publish(private, final, fp)
        except OSError as e:
            self.warn(f"xnnpack cache {final}: not kept ({e.strerror or e}); packed again at the next load")
            self.drop(slot)
            with contextlib.suppress(OSError), self._locked():
                if not self._good(final):  # a half-moved file (a full disk) is not left under the final name
                    for p in (final, final.with_name(final.name + ".ok")):
                        p.unlink(missing_ok=True)

    def _publish(self, private: Path, final: Path, fp: str) -> None:
        """The packed file under its final name, then its sidecar (written privately, then renamed)."""
        os.replace(private, final)
        tmp = final.with_name(f"{PRIVATE}{os.getpid()}-{self.token}-{final.name}.ok")
        try:
            tmp.write_text(json.dumps({"fingerprint": fp, "identity": self.identity}))
            os.replace(tmp, final.with_name(final.name + ".ok"))
        except OSError:
            tmp.unlink(missing_ok=True)
            final.unlink(missing_ok=True)  # without its sidecar it would only be packed again, with a warning
            raise

    def drop(self, slot: Slot) -> None:
        """A private file this load made and will not keep."""
        if slot.state == "made":
            Path(slot.path).unlink(missing_ok=True)
            Path(slot.path).with_name(Path(slot.path).name + ".ok").unlink(missing_ok=True)
