"""What a command prints: our own lines on the terminal, third-party native logs in a file.

LiteRT, TensorFlow and absl write their C++ logs (`INFO: Created TensorFlow Lite delegate`,
`WARNING: All log messages before absl::InitializeLog()`, ...) straight to file descriptor 2,
around our own output. Unless `--verbose`, `native_logs_to_file` points fd 2 at a file while
Python's own `sys.stderr` (our progress lines, tqdm, warnings, tracebacks) keeps the terminal;
the CLI then moves that file into the output folder as `logs/native.log`.

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
from typing import Iterator, Optional

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
    and notices (run-bundle passes False: it imports neither torch nor diffusers)."""
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


@contextlib.contextmanager
def native_logs_to_file(path: Optional[Path] = None) -> Iterator[Path]:
    """Send fd 2 (what native code writes) to `path` (a temporary file when None); Python's
    sys.stderr keeps writing to the terminal. Yields the log's path."""
    if path is None:
        fd, name = tempfile.mkstemp(prefix="pocketdiff-native-", suffix=".log")
        os.close(fd)
        path = Path(name)
    sys.stderr.flush()
    saved = os.dup(2)
    old_stderr = sys.stderr
    try:
        on_fd2 = old_stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # already captured in Python (pytest's capsys)
        on_fd2 = False
    terminal = None
    if on_fd2:  # Python's writes keep going where fd 2 went before
        terminal = io.TextIOWrapper(os.fdopen(os.dup(saved), "wb", buffering=0), encoding="utf-8",
                                    errors="backslashreplace", line_buffering=True, write_through=True)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    if terminal is not None:
        sys.stderr = terminal
    try:
        yield path
    finally:
        if terminal is not None:
            terminal.flush()
            sys.stderr = old_stderr
        os.dup2(saved, 2)
        os.close(saved)
        if terminal is not None:
            terminal.close()


def keep_native_log(log: Path, output_dir: Optional[Path], keep_orphan: bool = False) -> Optional[Path]:
    """Move the native log into `output_dir/logs/` (when that folder exists and the log is not
    empty). With no such folder it is deleted, or kept where it is with `keep_orphan` (a failed
    command whose folder was removed: the log may say why). Returns where it is, or None."""
    try:
        if log.stat().st_size == 0:
            log.unlink(missing_ok=True)
            return None
        if output_dir is None or not Path(output_dir).is_dir():
            if keep_orphan:
                return log
            log.unlink(missing_ok=True)
            return None
        dest = Path(output_dir) / NATIVE_LOG
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "ab") as out, open(log, "rb") as src:
            shutil.copyfileobj(src, out)
        log.unlink(missing_ok=True)
        return dest
    except OSError:
        return None
