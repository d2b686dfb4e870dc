"""Package attributes that load on first use (PEP 562): a package names its public entry points and the module each
lives in, and `import package` imports none of those modules until one of the names is read."""
from __future__ import annotations

import importlib
from typing import Callable


def lazy_attributes(namespace: dict, entry_points: dict[str, str]) -> tuple[Callable, Callable]:
    """(__getattr__, __dir__) for the package whose globals are `namespace`: each name in `entry_points` is read from
    the package's module `entry_points[name]` when first asked for; any other name is an AttributeError."""
    package = namespace["__name__"]

    def __getattr__(name: str):
        if name not in entry_points:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{entry_points[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(entry_points))

    return __getattr__, __dir__
