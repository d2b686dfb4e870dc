"""`pocketdiff serve BUNDLE [--host H] [--port P] [--https] [--reports DIR]`: a bundle and its page over HTTP(S).

It sends the bundle's own files and its page, nothing else (web/serve_files.py): manifest.json, the files the
manifest names while they match it (sha256, .tflite structure, as run-bundle checks them) and the page folder
web/; never a file through a symbolic link that leaves the bundle, never a folder listing. `/` redirects to
`/web/index.html`; the MIME types are the page's (`.wasm`, `.js`), nothing is cached (a re-export is seen at once).
It answers only requests whose Host is this machine (an IP address, localhost or its own name: a DNS-rebinding
page gets 421), with at most MAX_CONNECTIONS connections at once and a READ_TIMEOUT_S timeout on every read and write.

The one writable endpoint is POST /report/NAME, and only with --reports (the page's check mode posts its JSON
there, `index.html?check=1&report=/report/NAME`; `pocketdiff web --check` turns it on for its own server):
Content-Type application/json, an Origin (when the client sends one) of this server, a Content-Length of at most
MAX_REPORT_BYTES, a JSON object. Reports are written to DIR (at most MAX_REPORT_FILES names a run) or, for a
caller in this process, kept in memory up to MAX_KEPT_BYTES until taken. Bad headers are a 4xx, never a crash.

WebGPU needs a secure context: `http://localhost` is one (on a phone through `adb reverse tcp:PORT tcp:PORT`);
over the LAN use `--https` (web/serve_tls.py: a self-signed certificate in the user's config folder, or --cert/--key).
"""
from __future__ import annotations

import http.server
import socket
import ssl
import sys
import threading
from pathlib import Path
from typing import Optional

from pocketdiff.errors import PocketdiffError

from .serve_files import BundleFiles, Refused, url_to_relative
from .serve_reports import MAX_REPORT_BYTES, ReportInbox, read_report, report_name
from .serve_tls import default_cert_folder, lan_address, make_certificate, tls_context

READ_TIMEOUT_S = 15.0  # every read and write of a connection (a stalled client cannot hold a thread longer)
MAX_CONNECTIONS = 32  # served at once; more are closed at once (each holds a thread)
LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
MIME = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
        ".mjs": "text/javascript; charset=utf-8", ".json": "application/json", ".wasm": "application/wasm",
        ".png": "image/png", ".txt": "text/plain; charset=utf-8"}
__all__ = ["PageServer", "make_certificate", "MAX_REPORT_BYTES", "main"]


def own_host_names(host: str) -> set[str]:
    """The Host header names this server answers to besides IP addresses: localhost, this machine's names, --host."""
    names = {*LOCAL_NAMES, socket.gethostname().lower(), socket.gethostname().lower() + ".local", host.lower()}
    try:
        names.add(socket.getfqdn().lower())
    except OSError:
        pass
    return {n for n in names if n}


def _is_ip(name: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in name else socket.AF_INET, name)
        return True
    except OSError:
        return False


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_Server"
    server_version = "pocketdiff-serve"
    sys_version = ""
    timeout = READ_TIMEOUT_S

    def handle(self) -> None:
        if isinstance(self.connection, ssl.SSLSocket):
            try:  # the TLS handshake here, under this thread's timeout, not in the accepting thread
                self.connection.do_handshake()
            except (ssl.SSLError, OSError):
                return
        super().handle()

    def end_headers(self) -> None:
        for k, v in (("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
                     ("Cross-Origin-Resource-Policy", "same-origin"), ("Referrer-Policy", "no-referrer")):
            self.send_header(k, v)
        super().end_headers()

    def _refuse(self, status: int, reason: str) -> None:
        self.close_connection = True
        try:
            self.send_error(status, reason.splitlines()[0][:300])
        except OSError:
            pass

    def _host_ok(self) -> bool:
        """Host is an IP address or one of this machine's names (no DNS rebinding of another site onto the port)."""
        host = (self.headers.get("Host") or "").strip().lower()
        name = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        if not host or _is_ip(name) or name in self.server.ref.host_names:
            return True
        self._refuse(421, f"this server answers to its own addresses, not {host[:80]!r}")
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._send(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._send(body=False)

    def _send(self, body: bool) -> None:
        if not self._host_ok():
            return
        if self.path.split("?", 1)[0] in ("/", "/index.html", "/web", "/web/"):
            self.send_response(302)
            self.send_header("Location", "/web/index.html")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        try:
            f, st = self.server.ref.files.open(url_to_relative(self.path))
        except Refused as e:
            self._refuse(e.status, e.reason)
            return
        with f:
            self.send_response(200)
            self.send_header("Content-Type", MIME.get(Path(f.name).suffix.lower(), "application/octet-stream"))
            self.send_header("Content-Length", str(st.st_size))
            self.end_headers()
            if body:
                try:
                    self.connection.sendfile(f, 0, st.st_size)
                except OSError:  # the client went away or stalled past the timeout
                    self.close_connection = True

    def do_POST(self) -> None:  # noqa: N802
        self.close_connection = True
        if not self._host_ok():
            return
        ref = self.server.ref
        try:
            if ref.reports is None:
                raise Refused(405, "this server takes no reports (serve --reports DIR)")
            name = report_name(self.path)
            self._check_origin()
            data, n = read_report(self.headers, self.rfile, ref.reports)
            written = ref.reports.put(name, data, n)
        except Refused as e:
            self._refuse(e.status, e.reason)
            return
        except OSError as e:
            self._refuse(500, f"the report could not be written: {e.strerror or e}")
            return
        ref.received(f"/report/{name}", data, written)
        self.send_response(204)
        self.end_headers()

    def _check_origin(self) -> None:
        """A browser's POST from another site (or a sandboxed frame) is refused; tools that send no Origin may post."""
        origin, site = self.headers.get("Origin"), self.headers.get("Sec-Fetch-Site")
        own = f"{self.server.ref.scheme}://{(self.headers.get('Host') or '').strip()}".lower()
        if origin is not None and origin.strip().lower() != own:
            raise Refused(403, f"a report from another origin ({origin[:80]!r}) is refused")
        if site is not None and site.strip().lower() not in ("same-origin", "none"):
            raise Refused(403, f"a report from a {site[:40]!r} request is refused")

    def log_message(self, fmt: str, *args) -> None:
        if self.server.ref.verbose:
            super().log_message(fmt, *args)


class _Server(http.server.ThreadingHTTPServer):
    """ThreadingHTTPServer with at most MAX_CONNECTIONS at once and one line (not a traceback) per failed request."""

    daemon_threads = True

    def __init__(self, address, ref: "PageServer"):
        self.ref = ref
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        if self.ref.verbose:
            e = sys.exc_info()[1]
            print(f"serve: request from {client_address[0]} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


class PageServer:
    """The bundle and its page over HTTP(S) in a background thread. `reports` (or `reports_dir`): POST /report/NAME
    is taken; kept in memory (`.reports.get()`) unless `keep_reports` is off, and written to `reports_dir` when given.
    `verify_files`: the manifest's files are sent only while they match it; `check_at_start`: all of them are checked
    before listening (the CLI does; a bad bundle is one line)."""

    def __init__(self, bundle: str | Path, host: str = "127.0.0.1", port: int = 8000, https: bool = False,
                 cert_dir: Optional[str | Path] = None, reports_dir: Optional[str | Path] = None, verbose: bool = False,
                 reports: bool = False, keep_reports: bool = True, cert: Optional[str | Path] = None,
                 key: Optional[str | Path] = None, verify_files: bool = True, check_at_start: bool = False):
        self.bundle = Path(bundle).resolve()
        if not (self.bundle / "manifest.json").is_file():
            raise PocketdiffError(f"bundle {bundle}: no manifest.json (serve a folder made by `pocketdiff export`)")
        if not (self.bundle / "web" / "index.html").is_file():
            raise PocketdiffError(f"bundle {bundle}: no web/index.html; write it first with `pocketdiff web {bundle}`")
        self.verbose = verbose
        self.files = BundleFiles(self.bundle, verify=verify_files)
        if check_at_start:
            self.files.check_all()
        on = reports or reports_dir is not None
        self.reports: Optional[ReportInbox] = ReportInbox(reports_dir, keep=keep_reports) if on else None
        self.host_names = own_host_names(host)
        self.scheme = "https" if https or cert or key else "http"
        ctx = self._tls(host, cert_dir, cert, key) if self.scheme == "https" else None
        try:
            self.httpd = _Server((host, port), self)
        except (OSError, OverflowError) as e:
            raise PocketdiffError(f"serve: cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
        if ctx is not None:
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.host, self.port = self.httpd.server_address[:2]
        self.thread: Optional[threading.Thread] = None

    @staticmethod
    def _tls(host: str, cert_dir, cert, key) -> ssl.SSLContext:
        if (cert is None) != (key is None):
            raise PocketdiffError("serve: --cert and --key go together (a certificate and its private key)")
        if cert is None:
            cert, key = make_certificate(Path(cert_dir) if cert_dir else default_cert_folder(), host)
        return tls_context(Path(cert), Path(key))

    @property
    def url(self) -> str:
        host = "localhost" if self.host in ("127.0.0.1", "0.0.0.0", "::", "::1") else self.host
        return f"{self.scheme}://{host}:{self.port}/web/index.html"

    def received(self, path: str, data: dict, written: Optional[Path]) -> None:
        if self.verbose:
            print(f"report {path}: ok={data.get('ok')}" + (f" -> {written}" if written else ""), flush=True)

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


def check_port(port: int) -> int:
    if not 0 <= port <= 65535:
        raise PocketdiffError(f"--port {port}: a TCP port is 1 to 65535 (0: any free one)")
    return port


def main(args) -> int:
    """CLI entry: bundle, host, port, https, cert, key, reports."""
    from pocketdiff.runtime.cli_checks import check_outside_bundle

    check_port(args.port)
    check_outside_bundle(args.reports, "--reports", args.bundle)  # serve writes nothing into the bundle it serves
    srv = PageServer(args.bundle, host=args.host, port=args.port, https=args.https, reports_dir=args.reports, verbose=True,
                     keep_reports=False, cert=getattr(args, "cert", None), key=getattr(args, "key", None), check_at_start=True)
    print(f"serving {srv.bundle} at {srv.url}")
    lan = lan_address()
    if args.host in ("0.0.0.0", "::"):
        print(f"  every machine that reaches this one can read the bundle and its page{': ' + srv.scheme + '://' + lan + ':' + str(srv.port) + '/web/index.html' if lan else ''}"
              + ("" if srv.scheme == "https" else " (no WebGPU over plain http off localhost: use --https or adb reverse)"))
    print(f"  phone over USB: adb reverse tcp:{srv.port} tcp:{srv.port}, then open {srv.scheme}://localhost:{srv.port}/web/index.html")
    print("  reports: " + (f"POST /report/NAME -> {args.reports}; check mode: append ?check=1&report=/report/check" if args.reports
                           else "off (--reports DIR takes the check mode's POST)") + "; Ctrl-C stops", flush=True)
    try:
        srv.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.httpd.server_close()
    return 0

