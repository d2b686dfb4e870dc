"""`pocketdiff serve --reports`: the one writable endpoint, POST /report/NAME, bounded in every way.

A report is a JSON object of at most MAX_REPORT_BYTES, sent with Content-Type application/json and a plain
Content-Length (no chunked body); its body must arrive within the connection's timeout. The server keeps at most
MAX_KEPT_REPORTS reports and MAX_KEPT_BYTES of bodies in memory until a caller takes them (`ReportInbox.get`), and
writes at most MAX_REPORT_FILES distinct names into its folder per run (a name posted again replaces its file).
What does not fit is refused (503) before its body is read.
"""
from __future__ import annotations

import collections
import json
import queue
import re
import threading
import time
from pathlib import Path
from typing import BinaryIO, Optional

from .serve_files import Refused

MAX_REPORT_BYTES = 2 * 2**20  # one report (the page's check report is a few kB)
MAX_KEPT_BYTES = 16 * 2**20  # the bodies held in memory at once, all reports together
MAX_KEPT_REPORTS = 32
MAX_REPORT_FILES = 64
REPORT_PATH = re.compile(r"/report/([A-Za-z0-9_.-]{1,64})")


def report_name(raw_path: str) -> str:
    """NAME of /report/NAME (a query is ignored); anything else is 404."""
    m = REPORT_PATH.fullmatch(raw_path.split("?", 1)[0])
    if m is None or m.group(1).startswith("."):
        raise Refused(404, "reports go to /report/NAME (NAME: letters, digits, _ . -)")
    return m.group(1)


def content_length(headers) -> int:
    """The body's declared size: a plain decimal Content-Length of 1 .. MAX_REPORT_BYTES, else a 4xx."""
    if headers.get("Transfer-Encoding") is not None:
        raise Refused(411, "a report is sent with a Content-Length, not a chunked body")
    values = headers.get_all("Content-Length") or []
    if not values:
        raise Refused(411, "a report needs a Content-Length")
    if len(set(v.strip() for v in values)) != 1 or not re.fullmatch(r"[0-9]{1,12}", values[0].strip()):
        raise Refused(400, f"Content-Length {values[0][:40]!r} is not one whole number of bytes")
    n = int(values[0])
    if n == 0:
        raise Refused(400, "an empty report")
    if n > MAX_REPORT_BYTES:
        raise Refused(413, f"a report is at most {MAX_REPORT_BYTES // 2**20} MiB, this one says {n} bytes")
    return n


def read_report(headers, rfile: BinaryIO, inbox: "ReportInbox") -> tuple[dict, int]:
    """Check the headers, take room in the inbox, read and parse the body -> (the report, its room in the inbox:
    `inbox.put` it or `inbox.release` the room)."""
    ctype = (headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        raise Refused(415, f"a report is application/json, not {ctype[:60]!r}")
    n = content_length(headers)
    inbox.reserve(n)
    try:
        body = _read_exactly(rfile, n)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            raise Refused(400, "the body is not JSON") from None
        if not isinstance(data, dict):
            raise Refused(400, "a report is a JSON object")
    except BaseException:
        inbox.release(n)
        raise
    return data, n


def _read_exactly(rfile: BinaryIO, n: int) -> bytes:
    """n bytes, or a 400 when the client sends fewer (closes, or stalls past the socket's timeout)."""
    chunks, left = [], n
    read = getattr(rfile, "read1", rfile.read)  # what has arrived, not a wait for the whole block
    try:
        while left:
            got = read(min(left, 1 << 16))
            if not got:
                break
            chunks.append(got)
            left -= len(got)
    except (TimeoutError, OSError):
        pass
    if left:
        raise Refused(400, f"the body ended after {n - left} of its {n} bytes (or stalled)")
    return b"".join(chunks)


class ReportInbox:
    """Reports taken: written to `folder` (when given) and, with `keep`, held for `get` within the bounds above."""

    def __init__(self, folder: Optional[str | Path], keep: bool = True):
        self.folder = Path(folder) if folder is not None else None
        self.keep = keep
        self._cv = threading.Condition()
        self._items: collections.deque = collections.deque()
        self._bytes = 0  # held plus reserved for bodies being read
        self._count = 0
        self._names: set[str] = set()

    def reserve(self, n: int) -> None:
        with self._cv:
            if self.keep and (self._bytes + n > MAX_KEPT_BYTES or self._count >= MAX_KEPT_REPORTS):
                raise Refused(503, "the reports taken so far fill this server's memory bound; try again once they are read")
            self._bytes += n
            self._count += 1

    def release(self, n: int) -> None:
        with self._cv:
            self._bytes -= n
            self._count -= 1
            self._cv.notify_all()

    def put(self, name: str, data: dict, n: int) -> Optional[Path]:
        """File the report (its room was reserved); -> the file written, if any."""
        written = None
        try:
            if self.folder is not None:
                written = self._write(name, data)
        except BaseException:
            self.release(n)
            raise
        with self._cv:
            if self.keep:
                self._items.append((f"/report/{name}", data, n))
                self._cv.notify_all()
            else:
                self._bytes -= n
                self._count -= 1
        return written

    def _write(self, name: str, data: dict) -> Path:
        from pocketdiff.outputs import atomic_write_text

        with self._cv:
            if name not in self._names and len(self._names) >= MAX_REPORT_FILES:
                raise Refused(507, f"this server wrote {MAX_REPORT_FILES} report files already; post to one of their names")
            self._names.add(name)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"report_{name}.json"
        atomic_write_text(path, json.dumps(data, indent=1))
        return path

    def get(self, timeout: Optional[float] = None) -> tuple[str, dict]:
        """The oldest report held, as (path, data); queue.Empty when none comes within `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not self._items:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise queue.Empty
                self._cv.wait(left)
            path, data, n = self._items.popleft()
            self._bytes -= n
            self._count -= 1
            return path, data

    def empty(self) -> bool:
        with self._cv:
            return not self._items

    def held_bytes(self) -> int:
        with self._cv:
            return self._bytes
