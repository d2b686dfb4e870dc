"""Import pocketdiff for a benchmark script: the installed package when there is one, else
this checkout (pyproject maps train/, compress/, export/, evaluate/ into pocketdiff.*)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_checkout() -> None:
    try:
        import pocketdiff.compress  # noqa: F401  (an installed package has every subpackage)
        return
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "pocketdiff" or m.startswith("pocketdiff.")]:
        del sys.modules[name]  # a half-found package (e.g. the checkout's pocketdiff/ alone)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import pocketdiff

    if str(ROOT) not in pocketdiff.__path__:
        pocketdiff.__path__.append(str(ROOT))
