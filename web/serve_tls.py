"""`pocketdiff serve --https`: the certificate, kept in the user's config folder (never beside a bundle).

By default a self-signed certificate for the served host, localhost and this machine's names and LAN address is
made with the openssl command line tool in `$XDG_CONFIG_HOME/pocketdiff/serve-cert/` (else
`~/.config/pocketdiff/serve-cert/`), folder 0700 and key 0600, with `names.json` listing the names it was made for.
It is made again when a name it must hold is missing (another `--host`, another LAN address), when it expires within
a day, or when it no longer parses. `--cert FILE --key FILE` serve the user's own pair, never changed; one that does
not load is one line naming the file.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from pocketdiff.errors import PocketdiffError

CERT_FOLDER = "serve-cert"


def config_folder() -> Path:
    """The user's pocketdiff config folder: $XDG_CONFIG_HOME/pocketdiff, else ~/.config/pocketdiff."""
    base = os.environ.get("XDG_CONFIG_HOME") or ""
    return (Path(base) if os.path.isabs(base) else Path.home() / ".config") / "pocketdiff"


def default_cert_folder() -> Path:
    return config_folder() / CERT_FOLDER


def lan_address() -> Optional[str]:
    """This machine's address on the default route (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
    except OSError:
        return None


def certificate_names(host: str) -> list[str]:
    """subjectAltName entries for `host`, localhost, this machine's name and its LAN address."""
    names = {"DNS:localhost", "IP:127.0.0.1"}
    for h in {host, socket.gethostname(), lan_address()}:
        if h and h not in ("0.0.0.0", "::"):
            names.add(f"IP:{h}" if re.fullmatch(r"[0-9.]+|[0-9a-fA-F:]+", h) else f"DNS:{h}")
    return sorted(names)


def _openssl() -> str:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise PocketdiffError("serve --https needs the openssl command line tool (Debian: apt-get install openssl), or pass --cert and --key")
    return openssl


def _still_good(openssl: str, cert: Path, key: Path, names: list[str]) -> bool:
    """The made pair is there, holds every name, parses and lasts another day."""
    try:
        made = json.loads((cert.parent / "names.json").read_text())
    except (OSError, ValueError):
        return False
    if not (key.is_file() and isinstance(made, list) and set(names) <= set(made)):
        return False
    checks = ([openssl, "x509", "-in", str(cert), "-noout", "-checkend", "86400"], [openssl, "pkey", "-in", str(key), "-noout"])
    return all(subprocess.run(cmd, capture_output=True).returncode == 0 for cmd in checks)


def make_certificate(folder: Path, host: str) -> tuple[Path, Path]:
    """A self-signed certificate for `host` (+ localhost and this machine's names) in `folder`: the one made
    earlier while it still holds every name and lasts, else a new one (written whole, then moved in)."""
    openssl = _openssl()
    folder = Path(folder)
    cert, key = folder / "cert.pem", folder / "key.pem"
    names = certificate_names(host)
    if _still_good(openssl, cert, key, names):
        return cert, key
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=folder))
    except OSError as e:
        raise PocketdiffError(f"serve --https: cannot write the certificate folder {folder}: {e.strerror or e}") from None
    try:
        cmd = [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "365", "-subj", "/CN=pocketdiff serve",
               "-addext", "subjectAltName=" + ",".join(names), "-keyout", str(tmp / "key.pem"), "-out", str(tmp / "cert.pem")]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            said = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"
            raise PocketdiffError(f"serve --https: openssl failed: {said}")
        (tmp / "key.pem").chmod(0o600)
        (tmp / "names.json").write_text(json.dumps(names))
        for name in ("key.pem", "cert.pem", "names.json"):  # names.json last: a half-replaced pair is made again
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cert, key


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context for the pair; one that does not load is one line naming the file at fault."""
    for what, path in (("certificate", cert), ("key", key)):
        if not Path(path).is_file():
            raise PocketdiffError(f"serve: {what} {path}: no such file")
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.load_verify_locations(cafile=str(cert))
    except (ssl.SSLError, ValueError, UnicodeDecodeError) as e:
        raise PocketdiffError(f"serve: certificate {cert} is not a PEM certificate ({_reason(e)}); pass another --cert, "
                              f"or delete it to have --https make one") from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, ValueError) as e:
        raise PocketdiffError(f"serve: key {key} does not load or does not match certificate {cert} ({_reason(e)})") from None
    return ctx


def _reason(e: Exception) -> str:
    return getattr(e, "reason", None) or str(e).splitlines()[0] if str(e) else type(e).__name__
