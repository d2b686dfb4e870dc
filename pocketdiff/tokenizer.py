"""A CLIP-compatible BPE tokenizer trained on a caption corpus.

Built models (``model.pretrained: null``) need a tokenizer without downloading OpenAI's.
`build_clip_tokenizer` trains byte-level BPE merges with the HF ``tokenizers`` trainer,
using CLIP's own normalisation (NFC, collapsed whitespace, lowercase) and pre-tokenisation
(CLIP's word regex, then byte-to-unicode mapping), with the ``</w>`` end-of-word suffix.
It then writes ``vocab.json`` + ``merges.txt`` laid out exactly as OpenAI's CLIP files are:

    ids 0..255      the 256 byte symbols, in CLIP's ``bytes_to_unicode`` order
    ids 256..511    the same symbols with ``</w>`` appended
    ids 512..       one token per merge, in merge order
    last two ids    ``<|startoftext|>``, ``<|endoftext|>``

so every byte sequence is encodable (no unknown tokens), the file pair loads in
``transformers.CLIPTokenizer`` / ``CLIPTokenizerFast`` (one class in transformers 5), and a
bundle's runner can re-implement the tokenizer from the two files alone. Same corpus and
arguments give byte-identical files.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional

from .errors import PocketdiffError

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
EOW = "</w>"
# CLIP's word splitter (same pattern as transformers' CLIPTokenizer and OpenAI's simple_tokenizer).
CLIP_WORD_PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
MIN_VOCAB_SIZE = 2 * 256 + 2  # byte symbols, byte symbols + </w>, two special tokens

# A small built-in corpus for building a tokenizer when no captions are given.
DEFAULT_CORPUS = [
    f"a {size} {color} {shape} on a {bg} background"
    for size in ("small", "large", "big", "tiny")
    for color in ("red", "green", "blue", "yellow", "purple", "orange", "black", "white", "pink", "brown")
    for shape in ("circle", "square", "triangle", "star", "heart", "hexagon", "ring", "cross")
    for bg in ("white", "black", "gray")
] + [
    "a photo of a cat", "a photo of a dog", "a photo of an airplane", "a photo of an automobile",
    "a photo of a bird", "a photo of a deer", "a photo of a frog", "a photo of a horse",
    "a photo of a ship", "a photo of a truck", "grinning face with big eyes", "smiling face with heart eyes",
    "thumbs up sign", "red apple", "rocket", "house with garden", "the number 0 1 2 3 4 5 6 7 8 9",
    "a painting of a mountain lake at sunset", "an astronaut riding a horse",
]


_WARNED_PROMPTS: set[str] = set()


def warn_if_truncated(tokenizer, prompts: Iterable[str], max_length: int) -> list[int]:
    """One warning line per prompt (once per process) longer than `max_length` tokens, start and end
    tokens included, naming its token count; the text encoder sees its first `max_length` tokens.
    Returns the token counts of the truncated prompts."""
    counts = []
    for prompt in prompts:
        n = len(tokenizer(prompt, truncation=False).input_ids)
        if n <= max_length:
            continue
        counts.append(n)
        if prompt not in _WARNED_PROMPTS:
            _WARNED_PROMPTS.add(prompt)
            print(f"warning: prompt is {n} tokens, the text encoder takes {max_length}: "
                  f"cut to the first {max_length} ({prompt[:40]!r}...)", file=sys.stderr)
    return counts


def bytes_to_unicode() -> dict[int, str]:
    """CLIP/GPT-2 reversible map from the 256 byte values to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    byte_values = printable[:]
    code_points = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            code_points.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(byte_values, code_points)}


def _backend_for_training():
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(unk_token=EOS, continuing_subword_prefix="", end_of_word_suffix=EOW, fuse_unk=False))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CLIP_WORD_PATTERN), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),  # as transformers.CLIPTokenizer
        ]
    )
    return tok


def train_clip_merges(captions: Iterable[str], num_merges: int, min_frequency: int = 2) -> list[tuple[str, str]]:
    """Learn up to `num_merges` BPE merges (CLIP symbols, ``</w>`` suffix) from `captions`."""
    from tokenizers import pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    corpus = [str(c) for c in captions if c is not None and str(c).strip()]
    if num_merges <= 0 or not corpus:
        return []
    tok = _backend_for_training()
    trainer = BpeTrainer(
        # The trainer counts the whole alphabet (<= 512 symbols) in its vocabulary size.
        vocab_size=2 * 256 + num_merges,
        min_frequency=min_frequency,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix=EOW,
        show_progress=False,
    )
    # Sorted, de-duplicated input: the trainer only sees word counts, so order is irrelevant,
    # but a canonical input keeps the result independent of how the corpus was iterated.
    tok.train_from_iterator(sorted(corpus), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = []
    for m in model["merges"]:
        pair = tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        merges.append((pair[0], pair[1]))
    return merges[:num_merges]


def clip_vocab_and_merges(merges: list[tuple[str, str]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary layout for a list of merges (see module docstring)."""
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + EOW for s in symbols]
    seen = set(tokens)
    kept = []
    for a, b in merges:
        merged = a + b
        if merged in seen or a not in seen or b not in seen:
            continue  # never happens with the trainer's output; keeps the file pair self-consistent
        seen.add(merged)
        tokens.append(merged)
        kept.append((a, b))
    tokens += [BOS, EOS]
    return {t: i for i, t in enumerate(tokens)}, kept


def write_vocab_merges(vocab: dict[str, int], merges: list[tuple[str, str]], out_dir: Path) -> None:
    """vocab.json and merges.txt in OpenAI CLIP's format (merges.txt starts with '#version: 0.2')."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    (out_dir / "vocab.json").write_text(json.dumps(ordered, ensure_ascii=False) + "\n", encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (out_dir / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_clip_files(vocab: dict[str, int], merges: list[tuple[str, str]], out_dir: Path, model_max_length: int = 77) -> None:
    """vocab.json, merges.txt (CLIP layout) and a tokenizer_config.json carrying max length and specials."""
    out_dir = Path(out_dir)
    write_vocab_merges(vocab, merges, out_dir)
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": int(model_max_length),
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": EOS,
        "pad_token": EOS,
        "do_lower_case": True,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def tokenizer_vocab_merges(tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE vocabulary and merges inside a loaded (tokenizers-backed) CLIPTokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise PocketdiffError(f"{type(tokenizer).__name__}: not a tokenizers-backed BPE tokenizer")
    model = json.loads(backend.to_str())["model"]
    if model.get("type") != "BPE":
        raise PocketdiffError(f"{type(tokenizer).__name__}: tokenizer model is {model.get('type')}, not BPE")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), [(a, b) for a, b in merges]


def export_vocab_merges(tokenizer, out_dir: Path) -> None:
    """Write a loaded CLIPTokenizer's vocab.json + merges.txt (transformers 5 saves only tokenizer.json)."""
    vocab, merges = tokenizer_vocab_merges(tokenizer)
    write_vocab_merges(vocab, merges, Path(out_dir))


def load_clip_tokenizer(folder: Path, model_max_length: Optional[int] = None):
    """Load a folder holding vocab.json + merges.txt as a transformers CLIPTokenizer."""
    from transformers import CLIPTokenizer

    folder = Path(folder)
    for name in ("vocab.json", "merges.txt"):
        if not (folder / name).is_file():
            raise PocketdiffError(f"{folder}: no {name} (not a CLIP tokenizer folder)")
    kwargs = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = int(model_max_length)
    return CLIPTokenizer.from_pretrained(str(folder), **kwargs)


def build_clip_tokenizer(
    captions: Optional[Iterable[str]],
    out_dir: Optional[Path] = None,
    vocab_size: int = 1024,
    model_max_length: int = 77,
):
    """Train a CLIP-format BPE tokenizer on `captions` and return it as a `transformers.CLIPTokenizer`.

    `vocab_size` is an upper bound (a small corpus runs out of merges earlier); it must be at
    least 514 (the 512 byte symbols and the two special tokens). When `out_dir` is given the
    files stay there (vocab.json, merges.txt, tokenizer_config.json); otherwise they are
    written to a temporary folder that is removed after loading.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise PocketdiffError(f"tokenizer vocab_size must be >= {MIN_VOCAB_SIZE} (byte symbols + specials), got {vocab_size}")
    if model_max_length < 2:
        raise PocketdiffError(f"tokenizer model_max_length must be >= 2, got {model_max_length}")
    corpus = list(DEFAULT_CORPUS if captions is None else captions)
    merges = train_clip_merges(corpus, vocab_size - MIN_VOCAB_SIZE)
    vocab, merges = clip_vocab_and_merges(merges)
    if out_dir is not None:
        write_clip_files(vocab, merges, Path(out_dir), model_max_length)
        return load_clip_tokenizer(Path(out_dir))
    with tempfile.TemporaryDirectory(prefix="pocketdiff-tok-") as tmp:
        write_clip_files(vocab, merges, Path(tmp), model_max_length)
        return load_clip_tokenizer(Path(tmp))
