from __future__ import annotations

import pytest

from pocketdiff.errors import PocketdiffError
from pocketdiff.evaluate.run import PromptConfig, read_prompt_file, resolve_prompts


def test_empty_prompt_file_is_named(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("\n   \n\n")
    with pytest.raises(PocketdiffError, match=rf"prompts.file: {f} is empty"):
        read_prompt_file(f)
    with pytest.raises(PocketdiffError, match="not found"):
        read_prompt_file(tmp_path / "missing.txt")


def test_prompts_from_file_list_and_cycling(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a red circle\n\n a blue square \n")
    assert resolve_prompts(PromptConfig(file=str(f), texts=["x"])) == ["a red circle", "a blue square", "x"]
    assert resolve_prompts(PromptConfig(texts=["a", "b"], num_samples=5)) == ["a", "b", "a", "b", "a"]
    assert resolve_prompts(PromptConfig(from_reference=2), lambda: ["c1", "c2", "c3"]) == ["c1", "c2"]


def test_no_prompts_or_empty_prompt_is_an_error():
    with pytest.raises(PocketdiffError, match="prompts: none given"):
        resolve_prompts(PromptConfig())
    with pytest.raises(PocketdiffError, match="empty prompt"):
        resolve_prompts(PromptConfig(texts=["ok", "  "]))
    with pytest.raises(PocketdiffError, match="needs a reference"):
        resolve_prompts(PromptConfig(from_reference=3))
