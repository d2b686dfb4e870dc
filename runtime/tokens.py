"""Prompt -> token ids with a bundle's tokenizer.json (the `tokenizers` library), padded and truncated as the
manifest's tokenizer block says; and the seed check every runner shares. numpy and tokenizers only."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from pocketdiff.errors import PocketdiffError


def bundle_tokenizer(tokenizer_json: str | Path, tok: dict):
    """The bundle's `tokenizers.Tokenizer`, padding and truncating to the manifest's max_length."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tokenizer_json))
    L = int(tok["max_length"])
    t.enable_truncation(max_length=L)
    t.enable_padding(length=L, pad_id=int(tok["pad_id"]), pad_token=str(tok.get("pad_token", "")))
    return t


def prompt_ids(tokenizer, prompt: str, tok: dict) -> np.ndarray:
    """ids [max_length] int32 of one prompt; a prompt over max_length tokens warns once and is cut."""
    L = int(tok["max_length"])
    enc = tokenizer.encode(prompt)
    if enc.overflowing:  # each overflow piece carries its own start and end tokens
        n = len(enc.ids) + sum(sum(o.attention_mask) - 2 for o in enc.overflowing)
        print(f"warning: prompt is {n} tokens, the text encoder takes {L}: cut to the first {L} ({prompt[:40]!r}...)",
              file=sys.stderr)
    return np.asarray(enc.ids[:L], dtype=np.int32)


def bundle_tokenize(tokenizer_json: str | Path, prompt: str, tok: dict) -> np.ndarray:
    """ids [max_length] int32, as CLIPTokenizer(padding="max_length", truncation=True) gives them."""
    return prompt_ids(bundle_tokenizer(tokenizer_json, tok), prompt, tok)


def check_seed(seed, what: str = "seed") -> int:
    """The seed of numpy's latents: a non-negative integer, else one line naming `what`."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise PocketdiffError(f"{what} must be a non-negative integer, got {seed!r}")
    return int(seed)
