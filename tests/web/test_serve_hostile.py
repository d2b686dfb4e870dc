"""`pocketdiff serve` against what a hostile page, a bundle from someone else or a broken client brings: a real
server on an ephemeral port, driven with http.client and raw sockets. It sends only the bundle's own files and its
page (no link out, no listing, no file that differs from the manifest), takes reports only when asked and only
within its bounds, and answers bad requests with a 4xx without dying (each test ends with a good request)."""
from __future__ import annotations

import http.client
import json
import os
import socket

import pytest

from pocketdiff.web import serve as serve_module
from pocketdiff.web import serve_reports
from pocketdiff.web.page import PageConfig, write_page
from pocketdiff.web.serve import PageServer

JSON = {"Content-Type": "application/json"}


@pytest.fixture
def page_bundle(smoke_bundle):
    write_page(PageConfig(bundle=str(smoke_bundle), reference=False))
    return smoke_bundle


@pytest.fixture
def quick_timeout(monkeypatch):
    """A stalled client is dropped after 0.5 s instead of READ_TIMEOUT_S (the test waits less, asserts the same)."""
    monkeypatch.setattr(serve_module._Handler, "timeout", 0.5)


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        conn.close()


def raw(port: int, data: bytes, wait: float = 30.0) -> bytes:
    """Send `data` as is and read until the server closes (a server that hangs fails the test after `wait`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def still_serving(port: int) -> None:
    code, body, _ = request(port, "GET", "/manifest.json")
    assert code == 200 and json.loads(body)["schema"] == "pocketdiff-bundle"


# --- what it sends ---------------------------------------------------------------------------------------------

def test_links_that_leave_the_bundle_are_not_followed(page_bundle, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the page")
    os.symlink(outside / "secret.txt", page_bundle / "web" / "secret.txt")
    os.symlink(outside, page_bundle / "web" / "elsewhere")
    os.symlink("/etc/passwd", page_bundle / "web" / "passwd")
    vocab = page_bundle / "tokenizer" / "vocab.json"  # a file the manifest names, swapped for a link out
    vocab.rename(outside / "vocab.json")
    os.symlink(outside / "vocab.json", vocab)
    with PageServer(page_bundle, port=0) as srv:
        for path in ("/web/secret.txt", "/web/elsewhere/secret.txt", "/web/passwd", "/web/elsewhere/", "/tokenizer/vocab.json"):
            code, body, _ = request(srv.port, "GET", path)
            assert code in (403, 404), path
            assert b"not for the page" not in body and b"root:" not in body, path
        still_serving(srv.port)


def test_a_page_folder_that_is_a_link_out_is_not_served(page_bundle, tmp_path):
    (page_bundle / "web").rename(tmp_path / "web_elsewhere")
    os.symlink(tmp_path / "web_elsewhere", page_bundle / "web")
    with PageServer(page_bundle, port=0) as srv:
        code, _, _ = request(srv.port, "GET", "/web/index.html")
        assert code == 403


def test_no_folder_listing_and_no_file_the_manifest_does_not_name(page_bundle):
    (page_bundle / "notes.txt").write_text("private")
    (page_bundle / "web" / ".hidden").write_text("private")
    with PageServer(page_bundle, port=0) as srv:
        for path in ("/tokenizer/", "/tokenizer", "/golden/", "/web/litertjs/", "/web/litertjs/core/",
                     "/notes.txt", "/config.yaml", "/web/.hidden", "/.pocketdiff-cert/key.pem"):
            code, body, _ = request(srv.port, "GET", path)
            assert code == 404, path
            assert b"private" not in body and b"Directory listing" not in body, path
        code, _, headers = request(srv.port, "GET", "/web/")
        assert code == 302 and headers["Location"] == "/web/index.html"
        code, body, headers = request(srv.port, "GET", "/tokenizer/vocab.json")
        assert code == 200 and headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Cross-Origin-Resource-Policy"] == "same-origin"


@pytest.mark.parametrize("path", ["/../manifest.json", "/%2e%2e/%2e%2e/etc/passwd", "/web/..%2f..%2fetc%2fpasswd",
                                  "//etc/passwd", "/web/%00", "/web/%ff%fe", "/web/a%5c..%5cindex.html",
                                  "/./manifest.json", "/web//index.html", "manifest.json"])
def test_paths_that_try_to_leave_the_bundle(page_bundle, path):
    with PageServer(page_bundle, port=0) as srv:
        answer = raw(srv.port, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        assert status_of(answer) in (400, 403, 404), answer[:200]
        assert b"root:" not in answer and b"pocketdiff-bundle" not in answer
        still_serving(srv.port)


def test_a_file_that_differs_from_the_manifest_is_refused_until_restored(page_bundle):
    tok = page_bundle / "tokenizer" / "tokenizer.json"
    original = tok.read_bytes()
    with PageServer(page_bundle, port=0) as srv:
        assert request(srv.port, "GET", "/tokenizer/tokenizer.json")[0] == 200
        tok.write_bytes(original + b" ")  # changed while served: checked again before it is sent
        code, body, _ = request(srv.port, "GET", "/tokenizer/tokenizer.json")
        assert code == 409 and b"sha256 mismatch for tokenizer/tokenizer.json" in body
        code, _, _ = request(srv.port, "HEAD", "/tokenizer/tokenizer.json")
        assert code == 409
        tok.write_bytes(original)
        code, body, _ = request(srv.port, "GET", "/tokenizer/tokenizer.json")
        assert code == 200 and body == original


def test_a_truncated_model_is_refused(page_bundle):
    """A .tflite whose manifest sha256 was made to match its cut bytes still fails the structure check run-bundle runs."""
    import hashlib

    unet = page_bundle / "unet.tflite"
    cut = unet.read_bytes()[:4096]
    unet.write_bytes(cut)
    man = json.loads((page_bundle / "manifest.json").read_text())
    man["components"]["unet"]["sha256"] = hashlib.sha256(cut).hexdigest()
    (page_bundle / "manifest.json").write_text(json.dumps(man))
    with PageServer(page_bundle, port=0) as srv:
        code, body, _ = request(srv.port, "GET", "/unet.tflite")
        assert code == 409 and b"unet.tflite" in body


def test_methods_other_than_get_head_and_post_are_refused(page_bundle):
    with PageServer(page_bundle, port=0) as srv:
        for method in ("PUT", "DELETE", "OPTIONS", "PATCH"):
            assert request(srv.port, method, "/manifest.json", body=b"x")[0] == 501, method
        code, body, headers = request(srv.port, "HEAD", "/manifest.json")
        assert code == 200 and body == b"" and int(headers["Content-Length"]) == (page_bundle / "manifest.json").stat().st_size


def test_a_host_that_is_not_this_machine_is_refused(page_bundle):
    """DNS rebinding: a site whose name is made to point at 127.0.0.1 reaches the port with its own Host."""
    with PageServer(page_bundle, port=0) as srv:
        assert request(srv.port, "GET", "/manifest.json", headers={"Host": "attacker.example"})[0] == 421
        assert request(srv.port, "GET", "/manifest.json", headers={"Host": "attacker.example:80"})[0] == 421
        for host in (f"localhost:{srv.port}", f"127.0.0.1:{srv.port}", "[::1]", socket.gethostname()):
            assert request(srv.port, "GET", "/manifest.json", headers={"Host": host})[0] == 200, host


# --- reports ---------------------------------------------------------------------------------------------------

def test_reports_are_off_unless_asked(page_bundle):
    with PageServer(page_bundle, port=0) as srv:
        code, body, _ = request(srv.port, "POST", "/report/check", body=b'{"ok": true}', headers=JSON)
        assert code == 405 and b"--reports" in body
        still_serving(srv.port)


@pytest.mark.parametrize("path, body, headers, want", [
    ("/report/check", b'{"ok": true}', {"Content-Type": "text/plain"}, 415),  # a form or a no-cors fetch
    ("/report/check", b"ok=true", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("/report/check", b'{"ok": true}', {**JSON, "Origin": "https://attacker.example"}, 403),
    ("/report/check", b'{"ok": true}', {**JSON, "Origin": "null"}, 403),  # a sandboxed frame or a file:// page
    ("/report/check", b'{"ok": true}', {**JSON, "Sec-Fetch-Site": "cross-site"}, 403),
    ("/manifest.json", b'{"ok": true}', JSON, 404),  # the one writable path is /report/NAME
    ("/report/../manifest", b'{"ok": true}', JSON, 404),
    ("/report/a/b", b'{"ok": true}', JSON, 404),
    ("/report/check", b"[1, 2]", JSON, 400),  # a report is a JSON object
    ("/report/check", b"not json", JSON, 400),
    ("/report/check", b"\xff\xfe{}", JSON, 400),
    ("/report/check", b"[" * 200_000 + b"]" * 200_000, JSON, 400),  # nesting deeper than the parser's recursion
])
def test_reports_are_refused_unless_well_formed(page_bundle, tmp_path, path, body, headers, want):
    with PageServer(page_bundle, port=0, reports=True, reports_dir=tmp_path / "reports") as srv:
        code, _, _ = request(srv.port, "POST", path, body=body, headers=headers)
        assert code == want
        assert srv.reports.empty() and not (tmp_path / "reports").exists()
        still_serving(srv.port)


def test_a_report_from_the_page_s_own_origin_is_taken(page_bundle):
    with PageServer(page_bundle, port=0, reports=True) as srv:
        own = {**JSON, "Origin": f"http://localhost:{srv.port}", "Host": f"localhost:{srv.port}", "Sec-Fetch-Site": "same-origin"}
        assert request(srv.port, "POST", "/report/check", body=b'{"ok": true}', headers=own)[0] == 204
        assert srv.reports.get(timeout=5) == ("/report/check", {"ok": True})


@pytest.mark.parametrize("headers, want", [
    (b"Content-Length: abc\r\n", 400),
    (b"Content-Length: -1\r\n", 400),
    (b"Content-Length: 1e3\r\n", 400),
    (b"Content-Length: 10\r\nContent-Length: 12\r\n", 400),
    (b"Content-Length: 0\r\n", 400),
    (b"", 411),
    (b"Transfer-Encoding: chunked\r\n", 411),
    (b"Content-Length: 99999999999\r\n", 413),  # refused before a byte of the body is read
])
def test_bad_content_length_is_a_4xx_not_a_crash(page_bundle, headers, want, capfd):
    with PageServer(page_bundle, port=0, reports=True) as srv:
        answer = raw(srv.port, b"POST /report/check HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + headers + b"\r\n{}")
        assert status_of(answer) == want, answer[:200]
        still_serving(srv.port)
    assert "Traceback" not in capfd.readouterr().err


def test_a_body_shorter_than_its_content_length_times_out(page_bundle, quick_timeout, capfd):
    with PageServer(page_bundle, port=0, reports=True) as srv:
        answer = raw(srv.port, b"POST /report/check HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"ok\": ")
        assert status_of(answer) == 400 and b"ended after 7 of its 1000 bytes" in answer
        assert srv.reports.empty() and srv.reports.held_bytes() == 0  # the room it reserved is given back
        still_serving(srv.port)
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_that_sends_nothing_is_dropped(page_bundle, quick_timeout):
    with PageServer(page_bundle, port=0) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"GET /manifest.json HTTP/1.1\r\n")  # and never the rest of the headers
            assert s.recv(1024) == b""  # closed by the server's read timeout (the socket's own 30 s would fail)
        still_serving(srv.port)


def test_connections_at_once_are_bounded(page_bundle, monkeypatch):
    monkeypatch.setattr(serve_module, "MAX_CONNECTIONS", 2)
    with PageServer(page_bundle, port=0) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(2)]
        try:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as third:
                third.sendall(b"GET /manifest.json HTTP/1.0\r\n\r\n")
                assert third.recv(1024) == b""  # closed at once: both slots are held
        finally:
            for s in idle:
                s.close()
        for _ in range(100):  # the idle ones' threads see the close and give their slots back
            try:
                still_serving(srv.port)
                break
            except (ConnectionError, http.client.HTTPException):
                continue
        else:
            still_serving(srv.port)


def test_what_reports_keep_in_memory_is_bounded(page_bundle, monkeypatch):
    body = json.dumps({"ok": True, "pad": "x" * 10}).encode()
    monkeypatch.setattr(serve_reports, "MAX_KEPT_BYTES", 2 * len(body) + 1)  # two fit, a third does not
    monkeypatch.setattr(serve_reports, "MAX_KEPT_REPORTS", 3)
    with PageServer(page_bundle, port=0, reports=True) as srv:
        assert [request(srv.port, "POST", f"/report/r{i}", body=body, headers=JSON)[0] for i in range(3)] == [204, 204, 503]
        assert srv.reports.held_bytes() == 2 * len(body)
        assert srv.reports.get(timeout=5)[0] == "/report/r0"  # taken: its room is free again
        assert request(srv.port, "POST", "/report/r3", body=body, headers=JSON)[0] == 204
    with PageServer(page_bundle, port=0, reports=True, keep_reports=False) as srv:  # the CLI keeps none in memory
        assert [request(srv.port, "POST", f"/report/r{i}", body=body, headers=JSON)[0] for i in range(5)] == [204] * 5
        assert srv.reports.empty() and srv.reports.held_bytes() == 0


def test_report_files_are_bounded_and_named_by_the_path(page_bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(serve_reports, "MAX_REPORT_FILES", 2)
    monkeypatch.setattr(serve_reports, "MAX_REPORT_BYTES", 100)
    out = tmp_path / "reports"
    with PageServer(page_bundle, port=0, reports_dir=out, keep_reports=False) as srv:
        codes = [request(srv.port, "POST", f"/report/{n}", body=b'{"ok": true}', headers=JSON)[0] for n in ("a", "b", "c", "a")]
        assert codes == [204, 204, 507, 204]  # a third name is refused, a known name replaces its file
        assert request(srv.port, "POST", "/report/a", body=b'{"x": "' + b"y" * 100 + b'"}', headers=JSON)[0] == 413
    assert sorted(p.name for p in out.iterdir()) == ["report_a.json", "report_b.json"]


def test_a_manifest_damaged_while_served_is_a_503_not_a_crash(page_bundle, capfd):
    mpath = page_bundle / "manifest.json"
    good = mpath.read_text()
    with PageServer(page_bundle, port=0) as srv:
        for damage in ('{"components": {"unet": {"path": "unet.tflite"}}, "tokenizer": 7}', "[1, 2", '{"components": 3}'):
            mpath.write_text(damage)
            code, body, _ = request(srv.port, "GET", "/unet.tflite")
            assert code == 503 and b"manifest" in body, damage
            assert request(srv.port, "GET", "/manifest.json")[0] == 200  # the page reads it and says what is wrong
        mpath.write_text(good)
        assert request(srv.port, "GET", "/unet.tflite")[0] == 200
    assert "Traceback" not in capfd.readouterr().err
