"""A script that is not a package module (benchmarks/*.py, scripts/gpu/*.py) imported by its path, for tests."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(rel: str, name: str):
    """The module at ROOT/REL, registered in sys.modules as NAME (dataclasses and pickling need it there). Its folder is
    on sys.path while it loads, as when it runs as a script (benchmarks/*.py import `_checkout` and their siblings)."""
    folder = str((ROOT / rel).parent)
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(folder)
    return mod
