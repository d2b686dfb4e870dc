"""`pocketdiff serve BUNDLE [--host H] [--port P] [--https]`: serve a bundle folder and its page.

A plain static file server rooted at the bundle folder (`/` redirects to `/web/index.html`),
with the MIME types the page needs (`.wasm`, `.js`), no caching (a re-export is seen at
once), and one addition for scripts and tests: a POST of JSON to any path is kept (and
written under --reports when given), so the page's check mode can report back
(`index.html?check=1&report=/report/NAME`).

WebGPU needs a secure context: `http://localhost` is one (on a phone through
`adb reverse tcp:PORT tcp:PORT`); over the LAN use `--https`, which makes a self-signed
certificate with the openssl command line tool.
"""
from __future__ import annotations

import functools
import http.server
import json
import queue
import re
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Optional

from pocketdiff.errors import PocketdiffError

MAX_REPORT_BYTES = 16 * 2**20


class _Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".wasm": "application/wasm",
        ".js": "text/javascript",
        ".mjs": "text/javascript",
        ".json": "application/json",
        ".tflite": "application/octet-stream",
        ".npz": "application/octet-stream",
        ".npy": "application/octet-stream",
    }

    def __init__(self, *args, server_ref: "PageServer", **kwargs):
        self.server_ref = server_ref
        super().__init__(*args, **kwargs)

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path in ("/", "/index.html"):
            self.send_response(302)
            self.send_header("Location", "/web/index.html")
            self.end_headers()
            return
        super().do_GET()

    def do_POST(self) -> None:  # noqa: N802
        n = int(self.headers.get("Content-Length") or 0)
        if n <= 0 or n > MAX_REPORT_BYTES:
            self.send_error(413 if n > 0 else 411, "a JSON body of at most 16 MiB")
            return
        body = self.rfile.read(n)
        try:
            data = json.loads(body)
        except ValueError:
            self.send_error(400, "the body is not JSON")
            return
        self.server_ref._received(self.path.split("?")[0], data)
        self.send_response(204)
        self.end_headers()

    def log_message(self, fmt: str, *args) -> None:
        if self.server_ref.verbose:
            super().log_message(fmt, *args)


class PageServer:
    """The bundle folder over HTTP(S) in a background thread; POSTed reports arrive in `reports`."""

    def __init__(self, bundle: str | Path, host: str = "127.0.0.1", port: int = 8000, https: bool = False,
                 cert_dir: Optional[str | Path] = None, reports_dir: Optional[str | Path] = None, verbose: bool = False):
        self.bundle = Path(bundle).resolve()
        if not (self.bundle / "manifest.json").is_file():
            raise PocketdiffError(f"bundle {bundle}: no manifest.json (serve a folder made by `pocketdiff export`)")
        if not (self.bundle / "web" / "index.html").is_file():
            raise PocketdiffError(f"bundle {bundle}: no web/index.html; write it first with `pocketdiff web {bundle}`")
        self.verbose = verbose
        self.reports: "queue.Queue[tuple[str, dict]]" = queue.Queue()
        self.reports_dir = Path(reports_dir) if reports_dir else None
        handler = functools.partial(_Handler, directory=str(self.bundle), server_ref=self)
        try:
            self.httpd = http.server.ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise PocketdiffError(f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.scheme = "http"
        if https:
            cert, key = make_certificate(Path(cert_dir) if cert_dir else self.bundle.parent / ".pocketdiff-cert", host)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"
        self.host, self.port = self.httpd.server_address[:2]
        self.thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host = "localhost" if self.host in ("127.0.0.1", "0.0.0.0", "::") else self.host
        return f"{self.scheme}://{host}:{self.port}/web/index.html"

    def _received(self, path: str, data: dict) -> None:
        if self.reports_dir is not None:
            self.reports_dir.mkdir(parents=True, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.strip("/")) or "report"
            (self.reports_dir / f"{name}.json").write_text(json.dumps(data, indent=1))
        self.reports.put((path, data))
        if self.verbose:
            print(f"report {path}: ok={data.get('ok')}", flush=True)

    def start(self) -> "PageServer":
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="pocketdiff-serve", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "PageServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def make_certificate(folder: Path, host: str) -> tuple[Path, Path]:
    """A self-signed certificate for `host` (+ localhost and this machine's addresses), made once."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    if cert.is_file() and key.is_file():
        return cert, key
    openssl = shutil.which("openssl")
    if openssl is None:
        raise PocketdiffError("serve --https needs the openssl command line tool (Debian: apt-get install openssl)")
    folder.mkdir(parents=True, exist_ok=True)
    names = {"DNS:localhost", "IP:127.0.0.1"}
    for h in {host, socket.gethostname(), _lan_address()}:
        if h and h not in ("0.0.0.0", "::"):
            names.add(f"IP:{h}" if re.fullmatch(r"[0-9.]+|[0-9a-fA-F:]+", h) else f"DNS:{h}")
    cmd = [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "365", "-subj", "/CN=pocketdiff serve",
           "-addext", "subjectAltName=" + ",".join(sorted(names)), "-keyout", str(key), "-out", str(cert)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise PocketdiffError(f"serve --https: openssl failed: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}")
    key.chmod(0o600)
    return cert, key


def _lan_address() -> Optional[str]:
    """This machine's address on the default route (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
    except OSError:
        return None


def main(args) -> int:
    """CLI entry: bundle, host, port, https, reports."""
    srv = PageServer(args.bundle, host=args.host, port=args.port, https=args.https, reports_dir=args.reports, verbose=True)
    print(f"serving {srv.bundle} at {srv.url}")
    lan = _lan_address()
    if args.host in ("0.0.0.0", "::") and lan:
        print(f"  on the LAN: {srv.scheme}://{lan}:{srv.port}/web/index.html" + ("" if args.https else " (no WebGPU over plain http: use --https or adb reverse)"))
    print(f"  phone over USB: adb reverse tcp:{srv.port} tcp:{srv.port}, then open {srv.scheme}://localhost:{srv.port}/web/index.html")
    print("  check mode: append ?check=1&report=/report/check ; Ctrl-C stops", flush=True)
    try:
        srv.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.httpd.server_close()
    return 0
