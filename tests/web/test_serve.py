"""`pocketdiff serve`: the bundle folder and its page over HTTP(S), POSTed reports kept."""
from __future__ import annotations

import json
import shutil
import ssl
import urllib.error
import urllib.request

import pytest

from pocketdiff.errors import PocketdiffError
from pocketdiff.web.page import PageConfig, write_page
from pocketdiff.web.serve import PageServer, make_certificate


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def test_serves_page_bundle_and_keeps_reports(smoke_bundle, tmp_path):
    write_page(PageConfig(bundle=str(smoke_bundle), reference=False))
    with PageServer(smoke_bundle, port=0, reports_dir=tmp_path / "reports", check_at_start=True) as srv:
        root = f"http://127.0.0.1:{srv.port}"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.build_opener(_NoRedirect).open(root + "/")
        assert e.value.code == 302 and e.value.headers["Location"] == "/web/index.html"
        with urllib.request.urlopen(root + "/web/litertjs/core/wasm/litert_wasm_internal.wasm") as r:
            assert r.headers["Content-Type"] == "application/wasm"
            assert r.read(4) == b"\0asm"
        with urllib.request.urlopen(root + "/web/app.js") as r:
            assert r.headers["Content-Type"].startswith("text/javascript")
            assert r.headers["Cache-Control"] == "no-store"
        with urllib.request.urlopen(root + "/manifest.json") as r:
            assert json.load(r)["schema"] == "pocketdiff-bundle"
        body = json.dumps({"ok": True, "n": 1}).encode()
        req = urllib.request.Request(root + "/report/check?x=1", data=body, headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req) as r:
            assert r.status == 204
        assert srv.reports.get(timeout=5) == ("/report/check", {"ok": True, "n": 1})
        assert json.loads((tmp_path / "reports/report_check.json").read_text()) == {"ok": True, "n": 1}
        bad = urllib.request.Request(root + "/report/x", data=b"not json", headers={"Content-Type": "application/json"}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(bad)
        assert e.value.code == 400
        assert srv.reports.empty()


def test_bundle_without_page_is_refused(smoke_bundle):
    with pytest.raises(PocketdiffError, match="pocketdiff web"):
        PageServer(smoke_bundle, port=0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="serve --https makes its certificate with the openssl tool")
def test_https_with_generated_certificate(smoke_bundle, tmp_path):
    write_page(PageConfig(bundle=str(smoke_bundle), reference=False))
    with PageServer(smoke_bundle, port=0, https=True, cert_dir=tmp_path / "cert") as srv:
        assert srv.url.startswith("https://localhost:")
        ctx = ssl.create_default_context(cafile=str(tmp_path / "cert/cert.pem"))
        with urllib.request.urlopen(f"https://localhost:{srv.port}/web/index.html", context=ctx) as r:
            assert b"importmap" in r.read()
    cert = (tmp_path / "cert/cert.pem").read_bytes()
    assert make_certificate(tmp_path / "cert", "127.0.0.1")[0].read_bytes() == cert  # made once, reused
