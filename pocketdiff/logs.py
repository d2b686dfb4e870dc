"""What a command prints: our own lines on the terminal, third-party native logs in a file.

LiteRT, TensorFlow and absl write their C++ logs (`INFO: Created TensorFlow Lite delegate`,
`WARNING: All log messages before absl::InitializeLog()`, ...) straight to file descriptors
2 and 1, around our own output. Unless `--verbose`, `native_logs_to_file` points those fds at
an unnamed temporary file (no path in the temp folder, nothing left behind if the process is
killed) while Python's own `sys.stdout` / `sys.stderr` (our lines, tqdm, warnings, tracebacks)
keep the terminal; the CLI then copies it into the output folder as `logs/native.log`, or drops
it when the command has no output folder of its own.

`quiet_libraries` hides what a user cannot act on: the Hugging Face loading bars and the
diffusers notice that a model with no float32-only modules was cast with `.to()`.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator, Optional

NATIVE_LOG = Path("logs") / "native.log"

# Environment read by the native libraries when they load (set before they are imported).
QUIET_NATIVE_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",  # TensorFlow C++: errors only
    "GLOG_minloglevel": "2",
    "ABSL_MIN_LOG_LEVEL": "2",
}

# Messages that are not about the user's input and that the user cannot change.
_UNACTIONABLE = ("that should be kept in float32: []",)


class _DropUnactionable(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(s in msg for s in _UNACTIONABLE)


def quiet_libraries(huggingface: bool = True) -> None:
    """Native log levels (environment) and, with `huggingface`, the Hugging Face libraries' bars
    and notices (the runtime-only verbs pass False: they import neither torch nor diffusers)."""
    for key, value in QUIET_NATIVE_ENV.items():
        os.environ.setdefault(key, value)
    if not huggingface:
        return
    try:
        import diffusers.utils.logging as dl

        dl.disable_progress_bar()
        for name in ("diffusers.models.modeling_utils", "diffusers.pipelines.pipeline_utils"):
            logging.getLogger(name).addFilter(_DropUnactionable())
    except ImportError:
        pass
    try:
        import transformers.utils.logging as tl

        tl.disable_progress_bar()
    except ImportError:
        pass


_STREAMS = ((1, "stdout"), (2, "stderr"))  # native code logs to both (LiteRT: OpenCL probe on fd 1)


def _detach_python_stream(fd: int, attr: str) -> Optional[object]:
    """Point sys.<attr> at a copy of `fd`, so `fd` itself can be moved; returns the old stream
    (None when Python already captured the stream elsewhere, e.g. pytest's capsys)."""
    old = getattr(sys, attr)
    try:
        if old.fileno() != fd:
            return None
    except (AttributeError, OSError, ValueError):
        return None
    old.flush()
    setattr(sys, attr, io.TextIOWrapper(os.fdopen(os.dup(fd), "wb", buffering=0), encoding="utf-8",
                                        errors="backslashreplace", line_buffering=True, write_through=True))
    return old


@contextlib.contextmanager
def native_logs_to_file() -> Iterator[BinaryIO]:
    """Send fds 1 and 2 (what native code writes) to an unnamed temporary file; Python's
    sys.stdout / sys.stderr keep writing to the terminal. Yields the open log (hand it to
    `keep_native_log`, which closes it)."""
    log = tempfile.TemporaryFile(prefix="pocketdiff-native-")
    saved, olds = {}, {}
    for fd, attr in _STREAMS:
        olds[attr] = _detach_python_stream(fd, attr)
        saved[fd] = os.dup(fd)
    for fd, _ in _STREAMS:
        os.dup2(log.fileno(), fd)
    try:
        yield log
    finally:
        for fd, attr in _STREAMS:
            if olds[attr] is not None:
                getattr(sys, attr).flush()
                getattr(sys, attr).close()
                setattr(sys, attr, olds[attr])
            os.dup2(saved[fd], fd)
            os.close(saved[fd])


def native_logs_until_exit(path: Path) -> None:
    """For the rest of the process, native writes to fds 1 and 2 go to `path` (appended;
    os.devnull drops them): libraries also log while the interpreter shuts down (LiteRT:
    `DestroyAccelerator`). Only for a process that is the command itself; Python's sys.stdout /
    sys.stderr keep the terminal."""
    with open(path, "ab") as log:
        for fd, attr in _STREAMS:
            if _detach_python_stream(fd, attr) is not None:
                os.dup2(log.fileno(), fd)


def keep_native_log(log: BinaryIO, output_dir: Optional[Path]) -> Optional[Path]:
    """Copy the native log into `output_dir/logs/native.log` (when that folder exists and the log
    is not empty) and close it; with no such folder it is dropped. Returns where it is, or None."""
    try:
        log.flush()
        log.seek(0, os.SEEK_END)
        if log.tell() == 0 or output_dir is None or not Path(output_dir).is_dir():
            return None
        dest = Path(output_dir) / NATIVE_LOG
        dest.parent.mkdir(parents=True, exist_ok=True)
        log.seek(0)
        with open(dest, "ab") as out:
            shutil.copyfileobj(log, out)
        return dest
    except OSError:
        return None
    finally:
        log.close()
