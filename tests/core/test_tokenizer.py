"""CLIP-format BPE tokenizer trained on captions (pocketdiff.tokenizer)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import regex
from transformers import CLIPTokenizer, CLIPTokenizerFast

from pocketdiff.errors import PocketdiffError
from pocketdiff.tokenizer import BOS, EOS, build_clip_tokenizer, bytes_to_unicode, export_vocab_merges

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
SHAPES = ["circle", "square", "triangle", "star", "heart", "hexagon"]
CORPUS = [
    f"a {size} {c} {s} on a {bg} background"
    for size in ("small", "large")
    for c in COLORS
    for s in SHAPES
    for bg in ("white", "gray")
] + ["Grinning Face with Big Eyes", "smiling  face with heart-eyes", "thumbs up", "the number 42"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_clip_tokenizer(CORPUS, out_dir=out, vocab_size=640)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return CLIPTokenizer.from_pretrained(str(tok_dir))


class ReferenceClipBpe:
    """An independent re-implementation of OpenAI CLIP's simple_tokenizer BPE over vocab.json +
    merges.txt (whitespace-collapsed lowercase text, CLIP's word regex, bytes -> unicode,
    rank-ordered merges, '</w>' on each word's last symbol). Checks that the files are in
    CLIP's format, not just loadable by one implementation."""

    PAT = regex.compile(
        r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
        regex.IGNORECASE,
    )

    def __init__(self, folder: Path):
        self.encoder = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
        assert lines[0].startswith("#version")
        self.ranks = {tuple(line.split()): i for i, line in enumerate(lines[1:]) if line}
        self.byte_encoder = bytes_to_unicode()

    def bpe(self, token: str) -> list[str]:
        word = list(token[:-1]) + [token[-1] + "</w>"]
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def encode(self, text: str) -> list[int]:
        text = " ".join(text.split()).lower()
        ids = [self.encoder[BOS]]
        for piece in self.PAT.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(mapped))
        return ids + [self.encoder[EOS]]


def test_files_have_clip_layout(tok_dir):
    vocab = json.loads((tok_dir / "vocab.json").read_text(encoding="utf-8"))
    merges = (tok_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    symbols = list(bytes_to_unicode().values())
    by_id = sorted(vocab, key=vocab.get)
    assert list(vocab.values()) == list(range(len(vocab)))  # dense ids, written in id order
    assert by_id[:256] == symbols
    assert by_id[256:512] == [s + "</w>" for s in symbols]
    assert by_id[-2:] == [BOS, EOS]
    assert merges[0] == "#version: 0.2"
    assert len(merges) - 1 == len(vocab) - 514
    # merge i produces token 512 + i
    for i, line in enumerate(merges[1:]):
        a, b = line.split(" ")
        assert vocab[a + b] == 512 + i
    assert 514 < len(vocab) <= 640


def test_loads_as_slow_and_fast_and_matches_reference(tok_dir, tok):
    fast = CLIPTokenizerFast.from_pretrained(str(tok_dir))
    ref = ReferenceClipBpe(tok_dir)
    texts = CORPUS[:20] + CORPUS[-4:] + ["an UNSEEN wörd, émoji 🙂 and 123!?"]
    for text in texts:
        ids = tok(text).input_ids
        assert ids == fast(text).input_ids
        assert ids == ref.encode(text), text


def test_round_trip_on_corpus_captions(tok):
    for caption in CORPUS[::7] + ["Grinning Face with Big Eyes", "smiling  face with heart   eyes "]:
        ids = tok(caption).input_ids
        assert tok.decode(ids, skip_special_tokens=True) == " ".join(caption.lower().split())
    # learned merges are used: corpus words become single tokens
    assert len(tok("a small red circle on a white background").input_ids) == 2 + 8


def test_special_ids_and_padding(tok):
    vocab = tok.get_vocab()
    assert tok.bos_token == BOS and tok.eos_token == EOS and tok.pad_token == EOS
    assert tok.bos_token_id == vocab[BOS] == len(vocab) - 2
    assert tok.eos_token_id == tok.pad_token_id == vocab[EOS] == len(vocab) - 1
    assert tok.model_max_length == 77
    enc = tok(["a red star", "a small blue hexagon on a gray background"], padding="max_length",
              max_length=tok.model_max_length, truncation=True, return_tensors="pt")
    ids = enc.input_ids
    assert ids.shape == (2, 77)
    assert ids[0, 0].item() == tok.bos_token_id
    n = len(tok("a red star").input_ids)
    assert ids[0, n - 1].item() == tok.eos_token_id
    assert (ids[0, n:] == tok.pad_token_id).all()
    assert enc.attention_mask[0].sum().item() == n
    # no unknown tokens: eos (= unk) appears only where the text ends
    odd = tok("zebra quokka ÿ 🙂").input_ids
    assert tok.eos_token_id not in odd[:-1]
    # truncation keeps eos last
    long = tok(" ".join(["red"] * 200), padding="max_length", max_length=77, truncation=True).input_ids
    assert len(long) == 77 and long[-1] == tok.eos_token_id and long[0] == tok.bos_token_id


def test_deterministic_same_files(tmp_path, tok_dir):
    build_clip_tokenizer(CORPUS, out_dir=tmp_path / "a", vocab_size=640)
    # a second build in a fresh process (hash seeds differ) and with the corpus shuffled
    code = (
        "import sys; from pocketdiff.tokenizer import build_clip_tokenizer; "
        "import json; corpus = json.loads(sys.argv[1]); "
        "build_clip_tokenizer(corpus[::-1], out_dir=sys.argv[2], vocab_size=640)"
    )
    subprocess.run([sys.executable, "-c", code, json.dumps(CORPUS), str(tmp_path / "b")], check=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        a = (tmp_path / "a" / name).read_bytes()
        assert a == (tmp_path / "b" / name).read_bytes(), name
        assert a == (tok_dir / name).read_bytes(), name


def test_vocab_size_is_an_upper_bound(tmp_path):
    tok = build_clip_tokenizer(CORPUS, vocab_size=520)
    assert len(tok) == 520
    with pytest.raises(PocketdiffError, match="vocab_size"):
        build_clip_tokenizer(CORPUS, vocab_size=100)


def test_builtin_corpus_and_export(tmp_path):
    tok = build_clip_tokenizer(None)
    assert len(tok) > 514
    assert tok.decode(tok("a small red circle").input_ids, skip_special_tokens=True) == "a small red circle"
    # transformers 5 save_pretrained writes tokenizer.json only; export_vocab_merges adds CLIP's pair back
    tok.save_pretrained(str(tmp_path / "saved"))
    export_vocab_merges(tok, tmp_path / "saved")
    reloaded = CLIPTokenizer.from_pretrained(str(tmp_path / "saved"))
    ref = ReferenceClipBpe(tmp_path / "saved")
    text = "a large purple heart on a black background"
    assert reloaded(text).input_ids == tok(text).input_ids == ref.encode(text)
