"""The runtime's tokenizer: a prompt over the text encoder's length is cut, with one warning naming its token count."""
from __future__ import annotations

import json
from pathlib import Path

from pocketdiff.runtime.run_bundle import bundle_tokenize

BUNDLE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle"


def _tok() -> dict:
    return json.loads((BUNDLE / "manifest.json").read_text())["tokenizer"]


def test_long_prompt_is_cut_with_a_warning_naming_its_token_count(capsys):
    ids = bundle_tokenize(BUNDLE / "tokenizer" / "tokenizer.json", "a red circle " * 40, _tok())
    assert ids.shape == (77,)
    err = capsys.readouterr().err
    assert "prompt is 122 tokens, the text encoder takes 77" in err  # 120 words + start + end


def test_short_prompt_says_nothing(capsys):
    tok = _tok()
    ids = bundle_tokenize(BUNDLE / "tokenizer" / "tokenizer.json", tok["golden"]["prompt"], tok)
    assert ids.tolist() == tok["golden"]["ids"]
    assert "warning" not in capsys.readouterr().err
