"""pocketdiff/lazy.py: a package's entry points load on first use (the compress packages' public names): importing the
package imports none of their modules, a name reads from its module, an unknown one is an AttributeError."""
from __future__ import annotations

import subprocess
import sys

import pytest


def test_the_compress_packages_load_their_entry_points_on_first_use():
    code = ("import sys, pocketdiff.compress.quant as q, pocketdiff.compress.prune as p; "
            "print(sorted(m for m in sys.modules if m.startswith(('pocketdiff.compress.quant.', 'pocketdiff.compress.prune.')))); "
            "from pocketdiff.compress.quant.int8_format import QuantRecipe; "
            "print(q.QuantRecipe is QuantRecipe, 'pocketdiff.compress.quant.int8_format' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["[]", "True True"], out


def test_dir_lists_the_entry_points_and_an_unknown_name_is_an_attribute_error():
    from pocketdiff.compress import prune, quant

    assert {"run", "Config", "ReconConfig", "save_quantized"} <= set(dir(quant)) and set(quant.__all__) <= set(dir(quant))
    assert "prune_unet" in dir(prune) and prune.__all__ == sorted(prune.__all__)
    with pytest.raises(AttributeError, match="module 'pocketdiff.compress.quant' has no attribute 'nothing'"):
        quant.nothing  # noqa: B018
    assert not hasattr(prune, "nothing")
