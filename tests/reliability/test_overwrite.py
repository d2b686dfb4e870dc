"""`--overwrite` never destroys an input and removes only what pocketdiff wrote (pocketdiff/outputs.py).

1. The input rule, one case per verb through the CLI (in process): `runs/` is a finished
   pocketdiff output whose marker lists every file in it as the run's own, so the marker alone
   would let --overwrite delete them; the inputs inside it (a pipeline, an image folder, an int8
   checkpoint, a bundle, a recipe) are what the rule must protect. Each case: exit 2, one
   `error:` line naming the output and the input, every file under `runs/` byte-identical, no
   folder created.
2. The marker rule, table-driven at library level (prepare_output_dir / finish_output_dir):
   what --overwrite removes, keeps and refuses.
3. One real run (train-teacher, tiny) overwritten after a user dropped a file into its folder.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import pytest
from bundle_builders import make_bundle

from pocketdiff.cli import main, run_stage
from pocketdiff.errors import PocketdiffError
from pocketdiff.outputs import MARKER, config_inputs, finish_output_dir, prepare_output_dir
from pocketdiff.shipped import ASSETS

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def snapshot(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


# ----------------------------------------------------------------------------------- 1. inputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A finished pocketdiff output folder holding inputs of later runs, all recorded as its own."""
    root = tmp_path_factory.mktemp("overwrite")
    runs = prepare_output_dir(root / "runs", verb="test")
    shutil.copytree(ASSETS / "shapes-teacher", runs / "teacher")
    (runs / "images").mkdir()
    for i in range(2):
        (runs / "images" / f"{i}.png").write_bytes(b"\x89PNG not decoded: the run is refused first")
    (runs / "images" / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"{i}.png", "text": "x"}) + "\n" for i in range(2)))
    (runs / "unet_int8.safetensors").write_bytes(b"int8 codes")
    make_bundle(runs / "bundle")
    shutil.copyfile(SMOKE / "prune.yaml", runs / "recipe.yaml")
    finish_output_dir(runs)
    os.symlink(runs, root / "runs-link")
    os.symlink(runs / "teacher", root / "teacher-link")
    return runs


@dataclasses.dataclass
class InputCase:
    id: str
    build: Callable[[Path], list[str]]  # runs -> argv
    culprits: Callable[[Path], list[str]]  # runs -> substrings of the error line


def teacher(r: Path) -> str:
    return f"model.pretrained={r / 'teacher'}"


INPUT_CASES = [
    InputCase("train-teacher-output-contains-pretrained", lambda r: [
        "train-teacher", "--config", str(SMOKE / "train-teacher.yaml"), "--output", str(r), "--overwrite", teacher(r)],
        lambda r: [str(r), "contains the input model.pretrained", str(r / "teacher")]),
    InputCase("distill-output-contains-pretrained", lambda r: [
        "distill", "--config", str(SMOKE / "distill.yaml"), "--output", str(r), "--overwrite", teacher(r)],
        lambda r: [str(r), "contains the input model.pretrained", str(r / "teacher")]),
    InputCase("calibrate-output-is-pretrained", lambda r: [
        "calibrate", "--config", str(SMOKE / "calibrate.yaml"), "--output", str(r / "teacher"), "--overwrite", teacher(r)],
        lambda r: [str(r / "teacher"), "is the input model.pretrained"]),
    InputCase("prune-output-contains-pretrained", lambda r: [  # the case
        "prune", "--config", str(SMOKE / "prune.yaml"), "--output", str(r), "--overwrite", teacher(r)],
        lambda r: [str(r), "contains the input model.pretrained", str(r / "teacher"), "--overwrite would delete it"]),
    InputCase("evaluate-output-contains-model-path", lambda r: [
        "evaluate", "--config", str(SMOKE / "evaluate.yaml"), "--output", str(r), "--overwrite", f"models=[{{name: t, path: {r / 'teacher'}}}]"],
        lambda r: [str(r), "models[0].path", str(r / "teacher")]),
    InputCase("export-output-contains-int8-checkpoint", lambda r: [
        "export", "--config", str(SMOKE / "export.yaml"), "--output", str(r), "--overwrite", "weights=int8",
        f"int8.checkpoint={r / 'unet_int8.safetensors'}"],
        lambda r: [str(r), "int8.checkpoint", str(r / "unet_int8.safetensors")]),
    InputCase("export-output-inside-pretrained", lambda r: [  # no --overwrite: writing into an input
        "export", "--config", str(SMOKE / "export.yaml"), "--output", str(r / "teacher" / "bundle"), teacher(r)],
        lambda r: [str(r / "teacher" / "bundle"), "lies inside the input model.pretrained", "write into its own input"]),
    InputCase("train-clip-output-contains-data", lambda r: [
        "train-clip", "--output", str(r), "--overwrite", "data.source=imagefolder", f"data.path={r / 'images'}"],
        lambda r: [str(r), "data.path", str(r / "images")]),
    InputCase("prune-output-contains-its-config", lambda r: [
        "prune", "--config", str(r / "recipe.yaml"), "--output", str(r), "--overwrite"],
        lambda r: [str(r), "contains the input --config", str(r / "recipe.yaml")]),
    InputCase("run-bundle-output-is-the-bundle", lambda r: [  # the case
        "run-bundle", str(r / "bundle"), "--prompt", "x", "--output", str(r / "bundle"), "--overwrite", "--accelerator", "cpu"],
        lambda r: [str(r / "bundle"), "is the input bundle"]),
    InputCase("run-bundle-output-is-the-bundles-parent", lambda r: [  # the case
        "run-bundle", str(r / "bundle"), "--prompt", "x", "--output", str(r), "--overwrite", "--accelerator", "cpu"],
        lambda r: [str(r), "contains the input bundle", str(r / "bundle")]),
    InputCase("run-bundle-output-inside-the-bundle", lambda r: [
        "run-bundle", str(r / "bundle"), "--prompt", "x", "--output", str(r / "bundle" / "out"), "--accelerator", "cpu"],
        lambda r: [str(r / "bundle" / "out"), "lies inside the input bundle"]),
    InputCase("output-through-a-symlink", lambda r: [
        "prune", "--config", str(SMOKE / "prune.yaml"), "--output", str(r.parent / "runs-link"), "--overwrite", teacher(r)],
        lambda r: [str(r.parent / "runs-link"), "contains the input model.pretrained"]),
    InputCase("input-through-a-symlink", lambda r: [
        "prune", "--config", str(SMOKE / "prune.yaml"), "--output", str(r), "--overwrite", f"model.pretrained={r.parent / 'teacher-link'}"],
        lambda r: [str(r), "contains the input model.pretrained", str(r.parent / "teacher-link")]),
    InputCase("demo-output-inside-its-recipes", lambda r: ["demo", "--output", str(ROOT / "configs" / "demo" / "out-test-overwrite")],
              lambda r: [str(ROOT / "configs" / "demo" / "out-test-overwrite"), "lies inside the input demo recipes"]),
]


def _output_of(argv: list[str]) -> Path:
    return Path(argv[argv.index("--output") + 1])


@pytest.mark.parametrize("case", INPUT_CASES, ids=[c.id for c in INPUT_CASES])
def test_output_never_holds_an_input(case: InputCase, runs: Path, capsys):
    argv = case.build(runs)
    out = _output_of(argv)
    existed = out.exists()
    before = snapshot(runs)
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    try:
        assert code == 2, err
        assert len(lines) == 1 and lines[0].startswith("error: output folder "), err
        for culprit in case.culprits(runs):
            assert culprit in lines[0], f"{culprit!r} not named in: {lines[0]}"
        assert snapshot(runs) == before, "a refused run changed files under runs/"
        assert out.exists() == existed, f"{out} was created by a refused run"
    finally:
        if not existed and out.exists() and out.is_relative_to(ROOT):
            shutil.rmtree(out)  # never leave a folder in the checkout


def test_config_inputs_finds_paths_not_words(tmp_path, monkeypatch):
    @dataclasses.dataclass
    class Inner:
        path: Optional[str] = None
        prompts: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass
    class Cfg:
        model: str = "pocketdiff:shapes-teacher"
        pretrained: str = "teacher"  # a bare name under a path key: a folder in the working directory
        source: str = "shapes"  # an enum word, though ./shapes exists (an earlier `--output shapes`)
        hub: str = "stabilityai/stable-diffusion-2-1"
        device: str = "cpu"
        empty: str = ""
        missing: str = "/nonexistent/model"
        inner: list = dataclasses.field(default_factory=list)
        extra: dict = dataclasses.field(default_factory=dict)

    monkeypatch.chdir(tmp_path)
    for name in ("data", "teacher", "shapes", "cpu"):
        (tmp_path / name).mkdir()
    (tmp_path / "w.safetensors").write_bytes(b"x")
    cfg = Cfg(inner=[Inner(), Inner(path=str(tmp_path / "data"), prompts=["a red circle"])],
              extra={"ckpt": "./w.safetensors"})
    assert config_inputs(cfg) == [("model", ASSETS / "shapes-teacher"), ("pretrained", Path("teacher")),
                                  ("inner[1].path", tmp_path / "data"), ("extra.ckpt", Path("w.safetensors"))]


# ----------------------------------------------------------------------------------- 2. the marker


def _finished(folder: Path) -> Path:
    """A finished run in `folder` that wrote a.txt, sub/b.bin, link -> (outside file)."""
    prepare_output_dir(folder, verb="test")
    (folder / "a.txt").write_text("run")
    (folder / "sub").mkdir()
    (folder / "sub" / "b.bin").write_bytes(b"run")
    outside = folder.parent / "outside.txt"
    outside.write_text("the user's")
    os.symlink(outside, folder / "link")
    finish_output_dir(folder)
    return folder


def _user_files_added(folder: Path) -> Path:
    _finished(folder)
    (folder / "notes.md").write_text("mine")
    (folder / "sub" / "mine.txt").write_text("mine")
    return folder


def _interrupted(folder: Path) -> Path:
    """A run that kept a user's file (an earlier --overwrite), then was killed mid-way."""
    _user_files_added(folder)
    prepare_output_dir(folder, overwrite=True, verb="test")  # keeps notes.md, sub/mine.txt
    (folder / "checkpoint-2").mkdir()
    (folder / "checkpoint-2" / "model.safetensors").write_bytes(b"partial")
    return folder  # no finish_output_dir: the marker says the run did not end


def _unmarked(folder: Path) -> Path:
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    return folder


def _damaged_marker(folder: Path) -> Path:
    _finished(folder)
    (folder / MARKER).write_text("{not json")
    return folder


def _foreign_marker(folder: Path) -> Path:
    _finished(folder)
    (folder / MARKER).write_text(json.dumps({"written_by": "someone else"}))
    return folder


def _only_marker(folder: Path) -> Path:
    prepare_output_dir(folder, verb="test")
    return folder


def _resumed_after_user_file(folder: Path) -> Path:
    """A user's file dropped in between a run and its --resume stays the user's."""
    _finished(folder)
    (folder / "notes.md").write_text("mine")
    prepare_output_dir(folder, resume=True, verb="test")
    (folder / "sub" / "c.bin").write_bytes(b"resumed run")
    finish_output_dir(folder)
    return folder


@dataclasses.dataclass
class MarkerCase:
    id: str
    setup: Callable[[Path], Path]
    overwrite: bool
    error: Optional[str]  # substring of the refusal, or None
    left: Optional[set]  # what remains after (marker excluded); None: everything untouched
    warned: tuple = ()  # files named in the warning


MARKER_CASES = [
    MarkerCase("finished-run-is-emptied", _finished, True, None, set()),
    MarkerCase("user-files-added-later-are-kept", _user_files_added, True, None, {"notes.md", "sub", "sub/mine.txt"},
               ("notes.md", "sub/mine.txt")),
    MarkerCase("interrupted-run-keeps-only-what-it-kept", _interrupted, True, None, {"notes.md", "sub", "sub/mine.txt"},
               ("notes.md", "sub/mine.txt")),
    MarkerCase("resume-leaves-the-users-file-the-users", _resumed_after_user_file, True, None, {"notes.md"}, ("notes.md",)),
    MarkerCase("unmarked-folder-is-refused", _unmarked, True, "was not written by pocketdiff", None),
    MarkerCase("damaged-marker-is-refused", _damaged_marker, True, "is not valid JSON", None),
    MarkerCase("foreign-marker-is-refused", _foreign_marker, True, "not a pocketdiff output marker", None),
    MarkerCase("no-overwrite-is-refused", _finished, False, "is not empty", None),
    MarkerCase("a-folder-holding-only-the-marker-is-empty", _only_marker, False, None, set()),
]


@pytest.mark.parametrize("case", MARKER_CASES, ids=[c.id for c in MARKER_CASES])
def test_overwrite_removes_only_what_pocketdiff_wrote(case: MarkerCase, tmp_path, caplog):
    folder = case.setup(tmp_path / "out")
    outside = tmp_path / "outside.txt"
    outside_before = outside.read_text() if outside.exists() else None
    before = snapshot(folder)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pocketdiff.outputs"):
        if case.error:
            with pytest.raises(PocketdiffError, match=None) as e:
                prepare_output_dir(folder, overwrite=case.overwrite, verb="test")
            assert case.error in str(e.value) and str(folder) in str(e.value)
        else:
            prepare_output_dir(folder, overwrite=case.overwrite, verb="test")
    if case.left is None:
        assert snapshot(folder) == before
    else:
        assert set(snapshot(folder)) - {MARKER} == case.left
        marker = json.loads((folder / MARKER).read_text())
        assert marker["files"] is None and set(marker["kept"]) == case.left  # a new run began
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if case.warned:
        assert len(warnings) == 1 and all(f in warnings[0] for f in case.warned), warnings
    else:
        assert not warnings
    if outside_before is not None:
        assert outside.read_text() == outside_before  # a symlink the run wrote is removed, never followed


# ----------------------------------------------------------------------------------- 3. a real run


TEACHER_TINY = ["data.shapes_count=8", "vae.steps=0", "train.batch_size=4", "train.max_steps=1", "train.checkpoint_every=1",
                "samples.steps=1", "samples.prompts=[a red circle]", "model.pretrained=null"]


def test_a_real_run_overwritten_keeps_the_users_file(tmp_path, caplog):
    out = tmp_path / "teacher"
    run_stage("train-teacher", str(SMOKE / "train-teacher.yaml"), out, TEACHER_TINY)
    marker = json.loads((out / MARKER).read_text())
    assert marker["verb"] == "train-teacher" and "report.json" in marker["files"] and "config.yaml" in marker["files"]
    (out / "notes.md").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="pocketdiff.outputs"):
        assert main(["train-teacher", "--config", str(SMOKE / "train-teacher.yaml"), "--output", str(out), "--overwrite", *TEACHER_TINY]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "pocketdiff.outputs"]
    assert len(warnings) == 1 and "--overwrite kept 1 file(s)" in warnings[0] and "notes.md" in warnings[0]
    assert (out / "notes.md").read_text() == "mine" and (out / "report.json").is_file()
    marker = json.loads((out / MARKER).read_text())
    assert marker["kept"] == ["notes.md"] and "notes.md" not in marker["files"] and "report.json" in marker["files"]
