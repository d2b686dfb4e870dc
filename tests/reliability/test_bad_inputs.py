"""Bad inputs, table-driven, through the CLI: each case asserts exit code 2, exactly one
`error:` line on stderr (the last line) naming the culprit (key, file or folder), no
traceback (only with --debug), and existing outputs untouched (a fresh --output is never
created; an existing one, e.g. a run resumed with --resume latest, keeps every file's bytes).
Most cases call `pocketdiff.cli.main` in process; the ones marked `sub` run
`python -m pocketdiff` as a real subprocess.

Tally of the distinct bad inputs in this file, per category (78; `test_the_table_meets_the_issue_count`
keeps it >= 50):

| category                                             | cases |
|------------------------------------------------------|-------|
| bad YAML (syntax, encoding, override value, folder)  |   5   |
| unknown keys                                         |   4   |
| wrong types                                          |   6   |
| invalid values (enums, batch, components)            |   4   |
| missing files / folders                              |   8   |
| corrupted safetensors, checkpoints, state JSON       |  12   |
| truncated / non-flatbuffer .tflite                   |   2   |
| bundle sha256 mismatch (tokenizer, golden)           |   2   |
| manifest paths escaping the bundle (link, ..)        |   2   |
| other manifest damage (not JSON, schema version)     |   2   |
| wrong dataset columns                                |   2   |
| empty dataset                                        |   2   |
| non-UTF-8 captions / prompt file                     |   2   |
| zero-size image                                      |   1   |
| resolution not fitting the VAE / UNet                |   4   |
| step counts the rounds cannot reach, zero steps      |   5   |
| NaN / Inf weights                                    |   5   |
| ratios / scales out of range (incl. inf, nan)        |   7   |
| output folder / --resume misuse                      |   3   |
| total                                                |  78   |

Not repeated here: the bad inputs other test files already check (about 130 pytest.raises /
exit-2 asserts outside tests/reliability, mostly at library level: config parsing, data
loaders, model folders, prune and calibrate values, distill round plans, the bundle's sha256 /
truncation / escape cases on a real export, the int8 format, CLIP and FD inputs).

Run alone: about 50 s on 2 cores (most cases fail before any model work).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Callable

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from pocketdiff.cli import main, run_stage

ROOT = Path(__file__).resolve().parents[2]
SMOKE = {v: str(ROOT / "configs" / "smoke" / f"{v}.yaml") for v in ("train-teacher", "distill", "calibrate", "prune", "evaluate", "export")}
TEACHER_TINY = ["data.shapes_count=8", "vae.steps=0", "train.batch_size=4", "train.max_steps=2", "train.checkpoint_every=1",
                "train.ema_decay=0.9", "samples.steps=1", "samples.prompts=[a red circle]"]
PRUNE_TINY = ["data.shapes_count=8", "prune.taylor.samples=4", "prune.taylor.batch_size=4", "train.batch_size=4",
              "train.max_steps=2", "train.checkpoint_every=1", "eval.probe_samples=0", "eval.steps=1", "eval.prompts=[a red circle]"]


# ----------------------------------------------------------------------------------- fixtures


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _png(path: Path, size=(32, 32)) -> None:
    Image.new("RGB", size, (200, 30, 30)).save(path)


def _zero_pixel_png() -> bytes:
    """A PNG whose header says 0 x 0 pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def _tiny_tflite() -> bytes:
    """A valid one-op (ADD) .tflite flatbuffer, written with the LiteRT schema's object API."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    m = schema.ModelT()
    m.version = 3
    code = schema.OperatorCodeT()
    code.builtinCode = code.deprecatedBuiltinCode = schema.BuiltinOperator.ADD
    code.version = 1
    m.operatorCodes, m.buffers = [code], [schema.BufferT()]
    g = schema.SubGraphT()
    g.tensors = []
    for name in ("a", "b", "out"):
        t = schema.TensorT()
        t.shape, t.type, t.buffer, t.name = [1, 4], schema.TensorType.FLOAT32, 0, name
        g.tensors.append(t)
    op = schema.OperatorT()
    op.opcodeIndex, op.inputs, op.outputs = 0, [0, 1], [2]
    g.inputs, g.outputs, g.operators = [0, 1], [2], [op]
    m.subgraphs = [g]
    b = flatbuffers.Builder(1024)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Work:
    """Shared inputs, built once per module: tiny pipelines (good and damaged), finished runs
    to resume, a synthetic bundle, image folders. `out(name)` is a fresh output path."""

    def __init__(self, root: Path):
        self.root = root
        from pocketdiff.models import ModelConfig, build_pipeline, perturb_norm_affines, save_pipeline

        pipe = build_pipeline(ModelConfig(arch="tiny", vocab_size=600), captions=["a red circle", "a blue square"], resolution=32)
        for i, comp in enumerate((pipe.unet, pipe.text_encoder, pipe.vae)):
            perturb_norm_affines(comp, i, scale=0.3)
        self.tiny = save_pipeline(pipe, root / "tiny")
        self.unet_file = "unet/diffusion_pytorch_model.safetensors"

        def variant(name: str, edit: Callable[[Path], None]) -> Path:
            d = root / name
            shutil.copytree(self.tiny, d)
            edit(d)
            return d

        def poison(d: Path, rel: str, key_end: str, value: float) -> None:
            state = load_file(str(d / rel))
            key = next(k for k in state if k.endswith(key_end))
            state[key].view(-1)[0] = value
            save_file(state, str(d / rel), metadata={"format": "pt"})

        self.nan = variant("nan", lambda d: poison(d, self.unet_file, "conv_in.weight", float("nan")))
        self.inf_te = variant("inf_te", lambda d: poison(d, "text_encoder/model.safetensors", "token_embedding.weight", float("inf")))
        self.garbage = variant("garbage", lambda d: (d / self.unet_file).write_bytes(b"\x00not safetensors" * 64))
        self.truncated = variant("truncated", lambda d: (d / self.unet_file).write_bytes((d / self.unet_file).read_bytes()[:5000]))
        self.bad_vae = variant("bad_vae", lambda d: (d / "vae/diffusion_pytorch_model.safetensors").write_bytes(b"\x01" * 300))
        self.no_index = variant("no_index", lambda d: (d / "model_index.json").unlink())

        self.teacher_run = root / "runs" / "teacher"
        run_stage("train-teacher", SMOKE["train-teacher"], self.teacher_run, TEACHER_TINY + [f"model.pretrained={self.tiny}"])
        self.prune_run = root / "runs" / "prune"
        run_stage("prune", SMOKE["prune"], self.prune_run, PRUNE_TINY + [f"model.pretrained={self.tiny}"])

        self.bundle = self._bundle(root / "bundle")
        self.files = root / "files"
        self.files.mkdir()
        self.int8_garbage = self._int8(root / "int8")

    @staticmethod
    def _int8(folder: Path) -> Path:
        """An int8 checkpoint in compress's format whose .safetensors is then overwritten with garbage
        (its recipe .json stays valid)."""
        from pocketdiff.compress.quant.int8_format import QuantRecipe, save_quantized

        folder.mkdir()
        path, _ = save_quantized({"conv_in.bias": torch.zeros(4)}, QuantRecipe(component="unet"), folder / "unet_int8.safetensors")
        path.write_bytes(b"\x00garbage" * 32)
        return path

    def _bundle(self, b: Path) -> Path:
        from pocketdiff.runtime.bundle import load_manifest

        b.mkdir()
        data = _tiny_tflite()
        comps = {}
        for name in ("text_encoder", "unet", "vae_decoder"):
            (b / f"{name}.tflite").write_bytes(data)
            comps[name] = {"path": f"{name}.tflite", "sha256": _sha(b / f"{name}.tflite"), "bytes": len(data)}
        (b / "golden").mkdir()
        (b / "golden" / "unet.npz").write_bytes(b"golden")
        comps["unet"]["golden"] = {"path": "golden/unet.npz", "sha256": _sha(b / "golden" / "unet.npz")}
        (b / "tokenizer").mkdir()
        (b / "tokenizer" / "tokenizer.json").write_text("{}")
        (b / "time_embedding.npy").write_bytes(b"table")
        manifest = {
            "schema": "pocketdiff-bundle", "schema_version": 1, "components": comps,
            "tokenizer": {"files": {"tokenizer.json": {"path": "tokenizer/tokenizer.json", "sha256": _sha(b / "tokenizer" / "tokenizer.json")}},
                          "max_length": 8, "pad_id": 0},
            "time_embedding": {"path": "time_embedding.npy", "sha256": _sha(b / "time_embedding.npy")},
        }
        (b / "manifest.json").write_text(json.dumps(manifest))
        load_manifest(b)  # the intact bundle passes every check: each case below breaks one thing
        return b

    def out(self, name: str) -> Path:
        return self.root / "outs" / name

    def copy(self, src: Path, name: str) -> Path:
        dst = self.out(name)
        shutil.copytree(src, dst)
        return dst

    def bundle_copy(self, name: str, edit: Callable[[Path, dict], None]) -> Path:
        b = self.root / "bundles" / name
        shutil.copytree(self.bundle, b, symlinks=True)
        man = json.loads((b / "manifest.json").read_text())
        edit(b, man)
        if man:
            (b / "manifest.json").write_text(json.dumps(man))
        return b

    def yaml(self, name: str, text: str | bytes) -> Path:
        p = self.files / name
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return p

    def folder(self, name: str, rows: list[dict] | None = None, n: int = 8, metadata: bytes | None = None,
               meta_name: str = "metadata.jsonl", edit: Callable[[Path], None] | None = None) -> Path:
        d = self.files / name
        d.mkdir()
        for i in range(n):
            _png(d / f"{i}.png")
        if metadata is None:
            rows = rows if rows is not None else [{"file_name": f"{i}.png", "text": "a red square"} for i in range(n)]
            metadata = "".join(json.dumps(r) + "\n" for r in rows).encode()
        (d / meta_name).write_bytes(metadata)
        if edit:
            edit(d)
        return d


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return Work(tmp_path_factory.mktemp("bad_inputs"))


# ----------------------------------------------------------------------------------- the table


@dataclasses.dataclass
class Case:
    id: str
    category: str
    build: Callable[[Work], tuple[list[str], list[str]]]  # -> (argv, culprit substrings of the error line)
    sub: bool = False  # through a real `python -m pocketdiff` subprocess


def verb(name: str, out: Path, *overrides: str, config: bool = True, resume: str | None = None) -> list[str]:
    argv = [name] + (["--config", SMOKE[name]] if config else []) + ["--output", str(out)]
    return argv + (["--resume", resume] if resume else []) + list(overrides)


def imagefolder(d: Path) -> list[str]:
    return ["data.source=imagefolder", f"data.path={d}"]


def damage_checkpoint(w: Work, name: str, rel: str, data: bytes | None = None, cut: bool = False) -> Path:
    run = w.copy(w.teacher_run, name)
    f = run / "checkpoints" / "unet" / "checkpoint-2" / rel
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2] if cut else data)
    return run


def _escape_via_link(b: Path, man: dict) -> None:
    outside = b.parent / "outside.npz"
    outside.write_bytes(b"golden")
    (b / "golden" / "unet.npz").unlink()
    os.symlink(outside, b / "golden" / "unet.npz")


CASES = [
    # --- bad YAML
    Case("yaml-tab-indentation", "bad YAML", lambda w: (
        verb("calibrate", w.out("y1"), config=False) + ["--config", str(w.yaml("tabs.yaml", "seed: 0\n\tmodel: x\n"))],
        ["tabs.yaml", "invalid YAML"])),
    Case("yaml-not-utf8", "bad YAML", lambda w: (
        ["calibrate", "--config", str(w.yaml("latin1.yaml", "seed: 0\n# caf\xe9\n".encode("latin-1"))), "--output", str(w.out("y2"))],
        ["latin1.yaml"])),
    Case("yaml-unclosed-flow-mapping", "bad YAML", lambda w: (
        ["prune", "--config", str(w.yaml("flow.yaml", "eval: {prompts: [a, b}\n")), "--output", str(w.out("y3"))],
        ["flow.yaml", "invalid YAML"])),
    Case("override-value-not-yaml", "bad YAML", lambda w: (
        ["prune", "--output", str(w.out("y4")), "eval.prompts=[a, b"], ["eval.prompts=[a, b", "invalid YAML"]), sub=True),
    Case("config-is-a-folder", "bad YAML", lambda w: (
        ["prune", "--config", str(w.files), "--output", str(w.out("y5"))], [str(w.files)])),
    # --- unknown keys
    Case("unknown-nested-key-in-file", "unknown keys", lambda w: (
        ["calibrate", "--config", str(w.yaml("nested.yaml", "recon:\n  nope: 1\n")), "--output", str(w.out("u1"))],
        ["nested.yaml", "recon.nope", "unknown key"])),
    Case("misspelt-section-override", "unknown keys", lambda w: (
        verb("train-teacher", w.out("u2"), "trian.max_steps=3"), ["trian", "unknown key"])),
    Case("unknown-key-in-list-item", "unknown keys", lambda w: (
        verb("evaluate", w.out("u3"), f"models=[{{name: x, path: {w.tiny}, colour: red}}]"), ["colour", "unknown key"])),
    Case("misspelt-nested-override", "unknown keys", lambda w: (
        verb("distill", w.out("u4"), "guided.train.max_stpes=3"), ["guided.train.max_stpes"])),
    # --- wrong types
    Case("list-for-a-section", "wrong types", lambda w: (
        ["prune", "--config", str(w.yaml("listsec.yaml", "train: [1, 2]\n")), "--output", str(w.out("t1"))], ["listsec.yaml", "list"])),
    Case("mapping-for-an-int", "wrong types", lambda w: (
        ["prune", "--config", str(w.yaml("dictint.yaml", "seed: {a: 1}\n")), "--output", str(w.out("t2"))], ["dictint.yaml", "seed"])),
    Case("string-for-a-list", "wrong types", lambda w: (
        ["calibrate", "--config", str(w.yaml("strlist.yaml", "calib:\n  prompts: hello\n")), "--output", str(w.out("t3"))],
        ["calib.prompts"])),
    Case("null-for-an-int", "wrong types", lambda w: (
        ["prune", "--config", str(w.yaml("nullint.yaml", "train:\n  max_steps: null\n")), "--output", str(w.out("t4"))],
        ["train.max_steps"])),
    Case("word-for-a-float", "wrong types", lambda w: (verb("prune", w.out("t5"), "prune.ratio=lots"), ["prune.ratio"])),
    Case("word-in-an-int-list", "wrong types", lambda w: (verb("evaluate", w.out("t6"), "steps=[four]"), ["steps[0]", "four"])),
    # --- invalid values
    Case("quant-group-size-1", "invalid values", lambda w: (verb("calibrate", w.out("v1"), "quant.group_size=1", config=False), ["quant.group_size"])),
    Case("evaluate-batch-size-0", "invalid values", lambda w: (verb("evaluate", w.out("v2"), "batch_size=0"), ["batch_size"])),
    Case("export-unknown-component", "invalid values", lambda w: (verb("export", w.out("v3"), "components=[unet, nope]"), ["components", "nope"])),
    Case("fewer-items-than-the-batch", "invalid values", lambda w: (
        verb("train-teacher", w.out("v4"), "data.shapes_count=2", "vae.steps=0"), ["train.batch_size=8"])),
    # --- missing files / folders
    Case("pretrained-folder-missing", "missing files", lambda w: (
        verb("prune", w.out("m1"), "model.pretrained=/nonexistent/teacher"), ["/nonexistent/teacher"])),
    Case("vae-folder-missing", "missing files", lambda w: (
        verb("train-teacher", w.out("m2"), f"model.pretrained={w.tiny}", "vae.steps=0", "model.vae=/nonexistent/vae"), ["/nonexistent/vae"])),
    Case("shipped-asset-missing", "missing files", lambda w: (
        verb("distill", w.out("m3"), "model.pretrained=pocketdiff:no-such-model"), ["pocketdiff:no-such-model"])),
    Case("pipeline-without-model-index", "missing files", lambda w: (
        verb("evaluate", w.out("m4"), f"models=[{{name: x, path: {w.no_index}}}]"), [str(w.no_index), "model_index.json"])),
    Case("int8-checkpoint-missing", "missing files", lambda w: (
        verb("export", w.out("m5"), "weights=int8", "int8.checkpoint=/nonexistent/unet_int8.safetensors"), ["/nonexistent/unet_int8.safetensors"])),
    Case("bundle-folder-missing", "missing files", lambda w: (
        ["run-bundle", "/nonexistent/bundle", "--prompt", "x", "--output", str(w.out("m6"))], ["/nonexistent/bundle"])),
    Case("bundle-component-file-missing", "missing files", lambda w: (
        ["run-bundle", str(w.bundle_copy("nofile", lambda b, m: (b / "vae_decoder.tflite").unlink())), "--prompt", "x",
         "--output", str(w.out("m7"))], ["vae_decoder.tflite", "missing"])),
    Case("resume-named-checkpoint-missing", "missing files", lambda w: (
        verb("prune", w.copy(w.prune_run, "m8"), *PRUNE_TINY, f"model.pretrained={w.tiny}", resume="checkpoint-99"), ["checkpoint-99"])),
    # --- corrupted safetensors, checkpoints, state files
    Case("pipeline-unet-not-safetensors", "corrupted files", lambda w: (
        verb("calibrate", w.out("c1"), f"model.pretrained={w.garbage}"), [f"{w.garbage}/unet/diffusion_pytorch_model.safetensors"])),
    Case("pipeline-unet-truncated", "corrupted files", lambda w: (
        verb("distill", w.out("c2"), f"model.pretrained={w.truncated}"), [f"{w.truncated}/unet/diffusion_pytorch_model.safetensors"])),
    Case("pipeline-vae-not-safetensors", "corrupted files", lambda w: (
        verb("evaluate", w.out("c3"), f"models=[{{name: x, path: {w.bad_vae}}}]"), [f"{w.bad_vae}/vae/diffusion_pytorch_model.safetensors"])),
    Case("int8-checkpoint-not-safetensors", "corrupted files", lambda w: (
        verb("export", w.out("c4"), "weights=int8", f"int8.checkpoint={w.int8_garbage}"), [str(w.int8_garbage), "safetensors"])),
    Case("resume-checkpoint-model-torn", "corrupted files", lambda w: (
        verb("train-teacher", damage_checkpoint(w, "c5", "model.safetensors", cut=True), *TEACHER_TINY, f"model.pretrained={w.tiny}",
             resume="latest"), ["checkpoint-2/model.safetensors"]), sub=True),
    Case("resume-checkpoint-ema-garbage", "corrupted files", lambda w: (
        verb("train-teacher", damage_checkpoint(w, "c6", "ema.safetensors", b"\x00" * 64), *TEACHER_TINY, f"model.pretrained={w.tiny}",
             resume="latest"), ["checkpoint-2/ema.safetensors"])),
    Case("resume-checkpoint-optimizer-garbage", "corrupted files", lambda w: (
        verb("train-teacher", damage_checkpoint(w, "c7", "optimizer.pt", b"PK\x03\x04 broken"), *TEACHER_TINY, f"model.pretrained={w.tiny}",
             resume="latest"), ["checkpoint-2/optimizer.pt"])),
    Case("resume-checkpoint-state-not-json", "corrupted files", lambda w: (
        verb("train-teacher", damage_checkpoint(w, "c8", "trainer_state.json", b"{not json"), *TEACHER_TINY, f"model.pretrained={w.tiny}",
             resume="latest"), ["checkpoint-2/trainer_state.json"])),
    Case("resume-checkpoint-of-another-model", "corrupted files", lambda w: (
        verb("train-teacher", w.copy(w.teacher_run, "c9"), *TEACHER_TINY, "model.pretrained=pocketdiff:shapes-teacher",
             resume="latest"), ["checkpoint-2/model.safetensors"])),
    Case("resume-pruned-unet-not-safetensors", "corrupted files", lambda w: (
        verb("prune", (lambda r: ((r / "pruned_unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 64), r)[1])(
            w.copy(w.prune_run, "c10")), *PRUNE_TINY, f"model.pretrained={w.tiny}", resume="latest"),
        ["pruned_unet/diffusion_pytorch_model.safetensors"])),
    Case("resume-prune-plan-not-json", "corrupted files", lambda w: (
        verb("prune", (lambda r: ((r / "plan.json").write_text("{"), r)[1])(w.copy(w.prune_run, "c11")), *PRUNE_TINY,
             f"model.pretrained={w.tiny}", resume="latest"), ["plan.json"])),
    Case("resume-pruning-spec-not-json", "corrupted files", lambda w: (
        verb("prune", (lambda r: ((r / "pruned_unet" / "pruning.json").write_text("[1"), r)[1])(w.copy(w.prune_run, "c12")),
             *PRUNE_TINY, f"model.pretrained={w.tiny}", resume="latest"), ["pruned_unet", "pruning.json"])),
    # --- .tflite files and bundle manifests (a synthetic bundle of one-op models)
    Case("tflite-empty-with-matching-sha", "truncated .tflite", lambda w: (
        ["run-bundle", str(w.bundle_copy("empty", lambda b, m: ((b / "unet.tflite").write_bytes(b""), _rehash_into(m, b, "unet")))),
         "--prompt", "x", "--output", str(w.out("f1"))], ["unet.tflite", "truncated"])),
    Case("tflite-not-a-flatbuffer", "truncated .tflite", lambda w: (
        ["run-bundle", str(w.bundle_copy("png", lambda b, m: ((b / "text_encoder.tflite").write_bytes(_zero_pixel_png()),
                                                            _rehash_into(m, b, "text_encoder")))),
         "--prompt", "x", "--output", str(w.out("f2"))], ["text_encoder.tflite", "not a .tflite"])),
    Case("sha256-mismatch-tokenizer", "bundle sha256", lambda w: (
        ["run-bundle", str(w.bundle_copy("tok", lambda b, m: (b / "tokenizer" / "tokenizer.json").write_text('{"x": 1}'))),
         "--prompt", "x", "--output", str(w.out("f3"))], ["tokenizer/tokenizer.json", "sha256 mismatch"])),
    Case("sha256-mismatch-golden", "bundle sha256", lambda w: (
        ["run-bundle", str(w.bundle_copy("gold", lambda b, m: (b / "golden" / "unet.npz").write_bytes(b"other"))),
         "--prompt", "x", "--output", str(w.out("f4"))], ["golden/unet.npz", "sha256 mismatch"])),
    Case("manifest-path-escapes-via-link", "manifest escape", lambda w: (
        ["run-bundle", str(w.bundle_copy("link", _escape_via_link)), "--prompt", "x", "--output", str(w.out("f5"))],
        ["golden/unet.npz", "escapes the bundle"])),
    Case("manifest-time-embedding-dotdot", "manifest escape", lambda w: (
        ["run-bundle", str(w.bundle_copy("dotdot", lambda b, m: m["time_embedding"].update(path="golden/../../time_embedding.npy"))),
         "--prompt", "x", "--output", str(w.out("f6"))], ["golden/../../time_embedding.npy", "escapes the bundle"])),
    Case("manifest-not-json", "manifest damage", lambda w: (
        ["run-bundle", str(w.bundle_copy("notjson", lambda b, m: (m.clear(), (b / "manifest.json").write_text("{")))),
         "--prompt", "x", "--output", str(w.out("f7"))], ["manifest.json", "not valid JSON"])),
    Case("manifest-schema-version-2", "manifest damage", lambda w: (
        ["run-bundle", str(w.bundle_copy("v2", lambda b, m: m.update(schema_version=2))), "--prompt", "x", "--output", str(w.out("f8"))],
        ["manifest.json", "schema version 2"])),
    # --- datasets
    Case("image-column-missing", "dataset columns", lambda w: (
        verb("prune", w.out("d1"), *imagefolder(w.folder("imgcol")), "data.image_column=picture"), ["picture"])),
    Case("caption-missing-in-one-row", "dataset columns", lambda w: (
        verb("distill", w.out("d2"), *imagefolder(w.folder("nocap", rows=[{"file_name": f"{i}.png", **({"text": "a red square"} if i != 3 else {})}
                                                                       for i in range(8)]))), ["metadata.jsonl", "text"])),
    Case("empty-metadata-csv", "empty dataset", lambda w: (
        verb("train-teacher", w.out("d3"), *imagefolder(w.folder("emptycsv", n=0, metadata=b"file_name,text\n", meta_name="metadata.csv"))),
        ["metadata.csv", "empty"])),
    Case("max-samples-0", "empty dataset", lambda w: (verb("train-teacher", w.out("d4"), "data.max_samples=0"), ["data.max_samples"])),
    Case("captions-csv-not-utf8", "non-UTF-8 captions", lambda w: (
        verb("distill", w.out("d5"), *imagefolder(w.folder("latincsv", meta_name="metadata.csv", metadata=b"file_name,text\n" + b"".join(
            f"{i}.png,caf".encode() + b"\xe9\n" for i in range(8))))), ["metadata.csv", "UTF-8"])),
    Case("prompt-file-not-utf8", "non-UTF-8 captions", lambda w: (
        verb("evaluate", w.out("d6"), "prompts.file=" + str(w.yaml("prompts.txt", b"a red circle\ncaf\xe9")), "prompts.from_reference=0"),
        ["prompts.file", "prompts.txt", "UTF-8"])),
    Case("zero-pixel-image", "zero-size images", lambda w: (
        verb("distill", w.out("d7"), *imagefolder(w.folder("zeropx", edit=lambda d: (d / "5.png").write_bytes(_zero_pixel_png())))),
        ["5.png"])),
    # --- resolutions
    Case("prune-resolution-36", "resolution", lambda w: (verb("prune", w.out("r1"), "data.resolution=36"), ["data.resolution=36"])),
    Case("prune-resolution-30", "resolution", lambda w: (verb("prune", w.out("r2"), "data.resolution=30"), ["data.resolution=30"])),
    Case("distill-resolution-36", "resolution", lambda w: (verb("distill", w.out("r3"), "data.resolution=36"), ["data.resolution=36"])),
    Case("evaluate-resolution-30", "resolution", lambda w: (verb("evaluate", w.out("r4"), "resolution=30"), ["resolution=30", "VAE factor 4"])),
    Case("evaluate-resolution-36", "resolution", lambda w: (verb("evaluate", w.out("r5"), "resolution=36"), ["resolution=36", "UNet downsampling"])),
    # --- step counts
    Case("distill-final-steps-0", "step counts", lambda w: (verb("distill", w.out("s1"), "progressive.final_steps=0"), ["progressive.final_steps"])),
    Case("distill-start-above-half-T", "step counts", lambda w: (
        verb("distill", w.out("s2"), "progressive.start_steps=1024", "progressive.final_steps=512"), ["progressive.start_steps: 1024"])),
    Case("distill-6-to-4-steps", "step counts", lambda w: (
        verb("distill", w.out("s3"), "progressive.start_steps=6", "progressive.final_steps=4"), ["progressive.final_steps: 4", "start_steps=6"])),
    Case("calibrate-sampler-steps-0", "step counts", lambda w: (verb("calibrate", w.out("s4"), "calib.steps=0"), ["calib.steps"])),
    Case("evaluate-steps-0", "step counts", lambda w: (verb("evaluate", w.out("s5"), "steps=[4, 0]"), ["steps"])),
    # --- NaN / Inf weights
    Case("evaluate-nan-unet", "NaN weights", lambda w: (
        verb("evaluate", w.out("n1"), f"models=[{{name: x, path: {w.nan}}}]"), [str(w.nan), "unet", "conv_in.weight", "NaN"]), sub=True),
    Case("prune-nan-unet", "NaN weights", lambda w: (verb("prune", w.out("n2"), f"model.pretrained={w.nan}"), [str(w.nan), "conv_in.weight"])),
    Case("distill-inf-text-encoder", "NaN weights", lambda w: (
        verb("distill", w.out("n3"), f"model.pretrained={w.inf_te}"), [str(w.inf_te), "text_encoder", "token_embedding"])),
    Case("export-nan-unet", "NaN weights", lambda w: (verb("export", w.out("n4"), f"model.pretrained={w.nan}"), [str(w.nan), "conv_in.weight"])),
    Case("teacher-from-nan-pipeline", "NaN weights", lambda w: (
        verb("train-teacher", w.out("n5"), f"model.pretrained={w.nan}", "vae.steps=0"), [str(w.nan), "conv_in.weight"])),
    # --- ratios and scales out of range
    Case("caption-dropout-1", "ratios", lambda w: (verb("train-teacher", w.out("x1"), "caption_dropout=1.0"), ["caption_dropout"])),
    Case("ema-decay-1", "ratios", lambda w: (verb("train-teacher", w.out("x2"), "train.ema_decay=1.0"), ["train.ema_decay"])),
    Case("prune-ratio-nan", "ratios", lambda w: (verb("prune", w.out("x3"), "prune.ratio=nan"), ["prune.ratio"])),
    Case("guidance-w-max-inf", "ratios", lambda w: (verb("distill", w.out("x4"), "guidance.w_max=inf"), ["guidance.w_max"])),
    Case("learning-rate-inf", "ratios", lambda w: (verb("train-teacher", w.out("x5"), "train.lr=inf"), ["train.lr"])),
    Case("evaluate-guidance-negative", "ratios", lambda w: (verb("evaluate", w.out("x6"), "guidance_scale=-1"), ["guidance_scale"])),
    Case("recovery-w-min-below-1", "ratios", lambda w: (
        verb("prune", w.out("x7"), "recovery.w_min=0.5", "recovery.w_max=4"), ["recovery.w_min"])),
    # --- output folder and --resume misuse
    Case("output-is-a-file", "output", lambda w: (verb("prune", w.yaml("a_file.txt", "mine"), "train.max_steps=1"), ["a_file.txt", "not a folder"])),
    Case("calibrate-resume-named-checkpoint", "output", lambda w: (
        verb("calibrate", w.out("o2"), resume="checkpoint-3"), ["--resume checkpoint-3"])),
    Case("resume-with-fewer-trained-parameters", "output", lambda w: (
        verb("train-teacher", w.copy(w.teacher_run, "o3"), *TEACHER_TINY, f"model.pretrained={w.tiny}", "train_text_encoder=false",
             resume="latest"), ["checkpoint-2/optimizer.pt"])),
]


def _rehash_into(man: dict, b: Path, name: str) -> None:
    man["components"][name]["sha256"] = _sha(b / man["components"][name]["path"])


# ----------------------------------------------------------------------------------- runner


def snapshot(path: Path) -> dict[str, str]:
    """sha256 of every file under `path` (or of `path` itself)."""
    if path.is_file():
        return {".": _sha(path)}
    return {str(p.relative_to(path)): _sha(p) for p in sorted(path.rglob("*")) if p.is_file()}


def _run(argv: list[str], sub: bool, capsys) -> tuple[int, str]:
    if sub:
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        r = subprocess.run([sys.executable, "-m", "pocketdiff", *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        return r.returncode, r.stderr
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def test_the_table_meets_the_issue_count():
    assert len({c.id for c in CASES}) == len(CASES) >= 50
    assert sum(c.sub for c in CASES) >= 3


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, work: Work, capsys):
    argv, culprits = case.build(work)
    out = Path(argv[argv.index("--output") + 1])
    before = snapshot(out) if out.exists() else None
    code, err = _run(argv, case.sub, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert code == 2, err[-3000:]
    assert len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    for culprit in culprits:
        assert culprit in errors[0], f"{culprit!r} not named in: {errors[0]}"
    assert "Traceback" not in err
    if before is None:
        assert not out.exists(), f"{out} was created by a refused run"
    else:
        assert snapshot(out) == before, f"a refused run changed files in {out}"


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["prune", "--output", str(tmp_path / "o"), "--debug", "prune.ratio=2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error:") and "prune.ratio" in err
    assert not (tmp_path / "o").exists()
