"""Fixtures of the reliability tests: the synthetic bundle of bundle_builders.py."""
from __future__ import annotations

from pathlib import Path

import pytest
from bundle_builders import make_bundle


@pytest.fixture(scope="session")
def valid_bundle(tmp_path_factory) -> Path:
    """The intact synthetic bundle (copy it before editing)."""
    return make_bundle(tmp_path_factory.mktemp("valid_bundle") / "bundle")
