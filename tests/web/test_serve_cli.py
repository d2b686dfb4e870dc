"""`pocketdiff serve` as a mistyped command or a broken certificate meets it: one line naming the flag or file,
exit 2, nothing listening and nothing written; `--https` keeps its certificate in the user's config folder."""
from __future__ import annotations

import json
import shutil
import ssl
import urllib.request
from pathlib import Path

import pytest

from pocketdiff.cli import main
from pocketdiff.errors import PocketdiffError
from pocketdiff.web import serve_tls
from pocketdiff.web.page import PageConfig, write_page
from pocketdiff.web.serve import PageServer
from pocketdiff.web.serve_tls import make_certificate

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="--https makes its certificate with the openssl tool")


@pytest.fixture
def page_bundle(smoke_bundle):
    write_page(PageConfig(bundle=str(smoke_bundle), reference=False))
    return smoke_bundle


def refused(argv: list[str], capsys) -> str:
    """The CLI's one error line (exit 2, no traceback)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_a_port_out_of_range_is_one_line(page_bundle, capsys, port):
    assert f"--port {port}" in refused(["serve", str(page_bundle), "--port", port], capsys)


def test_reports_inside_the_bundle_are_refused(page_bundle, capsys):
    line = refused(["serve", str(page_bundle), "--port", "0", "--reports", str(page_bundle / "web" / "reports")], capsys)
    assert "--reports" in line and "inside the input bundle" in line
    assert not (page_bundle / "web" / "reports").exists()


def test_a_bundle_whose_file_differs_from_its_manifest_is_refused_before_listening(page_bundle, capsys):
    tok = page_bundle / "tokenizer" / "vocab.json"
    tok.write_bytes(tok.read_bytes() + b" ")
    assert "sha256 mismatch for tokenizer/vocab.json" in refused(["serve", str(page_bundle), "--port", "0"], capsys)


def test_a_bundle_without_its_page_is_refused(smoke_bundle, capsys):
    assert "pocketdiff web" in refused(["serve", str(smoke_bundle), "--port", "0"], capsys)


def test_cert_without_key_is_one_line(page_bundle, tmp_path, capsys):
    (tmp_path / "c.pem").write_text("x")
    assert "--cert and --key" in refused(["serve", str(page_bundle), "--port", "0", "--cert", str(tmp_path / "c.pem")], capsys)


def test_a_corrupt_certificate_names_the_file(page_bundle, tmp_path, capsys):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    key.write_text("nothing")
    line = refused(["serve", str(page_bundle), "--port", "0", "--cert", str(cert), "--key", str(key)], capsys)
    assert f"certificate {cert}" in line
    assert f"certificate {tmp_path / 'missing.pem'}: no such file" in refused(
        ["serve", str(page_bundle), "--port", "0", "--cert", str(tmp_path / "missing.pem"), "--key", str(key)], capsys)


@needs_openssl
def test_a_key_that_does_not_match_names_the_key(page_bundle, tmp_path, capsys):
    cert_a, _ = make_certificate(tmp_path / "a", "127.0.0.1")
    _, key_b = make_certificate(tmp_path / "b", "127.0.0.1")
    line = refused(["serve", str(page_bundle), "--port", "0", "--cert", str(cert_a), "--key", str(key_b)], capsys)
    assert f"key {key_b}" in line


def test_missing_openssl_is_one_line(page_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(serve_tls.shutil, "which", lambda name: None)
    with pytest.raises(PocketdiffError, match="openssl"):
        PageServer(page_bundle, port=0, https=True)


@needs_openssl
def test_https_certificate_lives_in_the_user_config_folder(page_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    before = sorted(str(p) for p in page_bundle.rglob("*"))
    with PageServer(page_bundle, port=0, https=True) as srv:
        folder = tmp_path / "config" / "pocketdiff" / "serve-cert"
        ctx = ssl.create_default_context(cafile=str(folder / "cert.pem"))
        with urllib.request.urlopen(f"https://localhost:{srv.port}/web/index.html", context=ctx) as r:
            assert b"importmap" in r.read()
    assert (folder / "key.pem").stat().st_mode & 0o077 == 0 and folder.stat().st_mode & 0o077 == 0
    assert sorted(str(p) for p in page_bundle.rglob("*")) == before  # nothing in the bundle
    assert not (page_bundle.parent / ".pocketdiff-cert").exists()  # nor beside it (where it went before)
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert serve_tls.default_cert_folder() == tmp_path / "home" / ".config" / "pocketdiff" / "serve-cert"


@needs_openssl
def test_the_certificate_is_made_again_when_the_host_changes_or_it_breaks(tmp_path):
    folder = tmp_path / "cert"
    cert, _ = make_certificate(folder, "127.0.0.1")
    first = cert.read_bytes()
    assert make_certificate(folder, "127.0.0.1")[0].read_bytes() == first  # reused while it holds every name
    make_certificate(folder, "10.9.8.7")
    second = cert.read_bytes()
    assert second != first and "IP:10.9.8.7" in json.loads((folder / "names.json").read_text())
    assert make_certificate(folder, "127.0.0.1")[0].read_bytes() == second  # it holds 127.0.0.1 too
    cert.write_text("garbage")
    assert make_certificate(folder, "127.0.0.1")[0].read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert not [p for p in folder.iterdir() if p.name.startswith(".new-")]


@needs_openssl
def test_a_tls_client_that_never_says_hello_does_not_block_others(page_bundle, tmp_path, monkeypatch):
    """The handshake runs in the connection's thread under its timeout, not in the thread that accepts."""
    import socket

    from pocketdiff.web import serve as serve_module

    monkeypatch.setattr(serve_module._Handler, "timeout", 0.5)
    with PageServer(page_bundle, port=0, https=True, cert_dir=tmp_path / "cert") as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as silent:
            ctx = ssl.create_default_context(cafile=str(tmp_path / "cert" / "cert.pem"))
            with urllib.request.urlopen(f"https://localhost:{srv.port}/manifest.json", context=ctx, timeout=30) as r:
                assert json.load(r)["schema"] == "pocketdiff-bundle"
            assert silent.recv(1024) == b""  # dropped after its timeout
    assert Path(tmp_path / "cert" / "names.json").is_file()
