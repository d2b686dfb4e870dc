"""`pocketdiff web --init-image/--mask/--strength/--lora/--lora-scale`: the CLI makes the page's reference from a picture
(or with a LoRA) as run-bundle's flags do (web/page.py PageConfig's fields, which only the Python API reached before),
and --check opens the page with the matching URL parameters (web/verb.check_params: the ones the check tests pass);
every contradiction is one line, exit 2, nothing written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from img2img_fixtures import graft_encoder, make_pictures  # tests/img2img_fixtures.py

SMOKE = Path(__file__).resolve().parent / "smoke_bundle"


def _web(*argv) -> int:
    from pocketdiff.cli import main as cli_main

    return cli_main(["web", *map(str, argv)])


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    return make_pictures(tmp_path_factory.mktemp("pictures"))


def test_check_params_name_the_reference_files():
    from pocketdiff.web.verb import check_params

    ref = {"init_image": "init_image.png", "mask": "mask.png", "strength": 0.75, "lora": "lora.safetensors", "lora_scale": 0.5}
    assert check_params(ref) == {"init_image": "reference/init_image.png", "mask": "reference/mask.png", "strength": 0.75,
                                 "lora": "reference/lora.safetensors", "lora_scale": 0.5}
    assert check_params({"init_image": "init_image.png", "mask": None, "strength": 0.8}) == {
        "init_image": "reference/init_image.png", "strength": 0.8}
    assert check_params({"prompt": "x", "seed": 0}) == {}


@pytest.mark.parametrize("flags,words", [
    (("--mask", "MASK"), "--mask"),
    (("--strength", "0.5"), "--strength"),
    (("--lora-scale", "0.5"), "--lora-scale"),
    (("--init-image", "PIC", "--no-reference"), "--init-image makes the reference: drop --no-reference"),
    (("--init-image", "PIC"), "not image_to_image"),  # the smoke bundle has no image encoder
])
def test_contradictions_are_one_line_and_write_nothing(pictures, tmp_path, capsys, flags, words):
    bundle = tmp_path / "bundle"
    shutil.copytree(SMOKE, bundle, ignore=shutil.ignore_patterns("README.md", "web"))
    argv = [{"PIC": pictures / "pic.png", "MASK": pictures / "mask.png"}.get(f, f) for f in flags]
    assert _web(bundle, *argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (bundle / "web").exists()


def test_the_reference_is_run_bundles_inpainting_from_the_picture(smoke_encoder_export, pictures, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(SMOKE, bundle, ignore=shutil.ignore_patterns("README.md", "web"))
    graft_encoder(bundle, smoke_encoder_export)
    assert _web(bundle, "--init-image", pictures / "pic.png", "--mask", pictures / "mask.png", "--strength", "0.75") == 0
    ref = json.loads((bundle / "web/reference/reference.json").read_text())
    assert ref["strength"] == 0.75 and ref["init_image"] == "init_image.png" and ref["mask"] == "mask.png"
    assert (bundle / "web/reference/init_image.png").read_bytes() == (pictures / "pic.png").read_bytes()
    assert (bundle / "web/reference/mask.png").is_file()
