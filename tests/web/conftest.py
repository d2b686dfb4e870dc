"""Shared fixtures of the web tests: the shipped smoke bundle (tests/web/smoke_bundle, made by
`pocketdiff export`, see its README) copied to a temporary folder, node and Chromium."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SMOKE_BUNDLE = HERE / "smoke_bundle"


@pytest.fixture
def smoke_bundle(tmp_path) -> Path:
    """A writable copy of the shipped smoke bundle (the page is written into BUNDLE/web)."""
    dst = tmp_path / "bundle"
    shutil.copytree(SMOKE_BUNDLE, dst, ignore=shutil.ignore_patterns("README.md", "web"))
    return dst


@pytest.fixture(scope="session")
def node() -> str:
    exe = shutil.which("node")
    if exe is None:
        pytest.skip("node is not installed (the page's JS modules are tested under node; apt-get install nodejs)")
    return exe


@pytest.fixture(scope="session")
def chromium() -> str:
    from pocketdiff.web.headless import find_chromium

    exe = find_chromium()
    if exe is None:
        pytest.skip("Chromium is not installed (scripts/setup.sh installs Debian's chromium; or set POCKETDIFF_CHROMIUM)")
    return exe
