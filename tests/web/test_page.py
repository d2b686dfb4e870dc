"""`pocketdiff web BUNDLE`: the page folder, its vendored LiteRT.js, its reference, bad input."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pocketdiff.cli import main as cli_main
from pocketdiff.errors import PocketdiffError
from pocketdiff.web.page import LITERTJS_FILES, PAGE_FILES, PageConfig, default_litertjs_dir, write_page


def test_page_folder_is_complete_offline_and_has_run_bundles_reference(smoke_bundle):
    info = write_page(PageConfig(bundle=str(smoke_bundle)))
    web = smoke_bundle / "web"
    for name in PAGE_FILES:
        text = (web / name).read_text()
        assert re.search(r"https?://", text) is None, f"{name} names a network URL: the page must work offline"
    for rel in LITERTJS_FILES:  # vendored byte for byte from the npm package setup installed
        assert (web / "litertjs" / rel).read_bytes() == (default_litertjs_dir() / rel).read_bytes()
    assert json.loads((web / "litertjs/core/package.json").read_text())["version"] == info["litertjs"]
    man = json.loads((smoke_bundle / "manifest.json").read_text())
    ref = json.loads((web / "reference/reference.json").read_text())
    assert ref["prompt"] == man["tokenizer"]["golden"]["prompt"] and ref["seed"] == 0
    lat = man["latent"]
    latents = np.fromfile(web / "reference/latents.bin", dtype="<f4")
    want = np.random.default_rng(0).standard_normal((1, lat["channels"], lat["height"], lat["width"])).astype(np.float32)
    np.testing.assert_array_equal(latents, want.reshape(-1))  # numpy's noise, as run-bundle --seed 0 draws it
    image = np.fromfile(web / "reference/image.bin", dtype="<f4").reshape(ref["image_shape"])
    assert image.shape == (man["image"]["height"], man["image"]["width"], 3)
    assert np.isfinite(image).all() and 0 <= image.min() and image.max() <= 1 and image.std() > 0.01


def test_reference_is_run_bundles_image(smoke_bundle, tmp_path):
    from PIL import Image

    write_page(PageConfig(bundle=str(smoke_bundle), prompt="a small blue square", seed=3))
    out = tmp_path / "run"
    assert cli_main(["run-bundle", str(smoke_bundle), "--prompt", "a small blue square", "--seed", "3",
                     "--accelerator", "cpu", "--output", str(out)]) == 0
    ours = np.asarray(Image.open(smoke_bundle / "web/reference/image.png"))
    theirs = np.asarray(Image.open(out / "image.png"))
    np.testing.assert_array_equal(ours, theirs)


def test_existing_page_is_kept_without_overwrite(smoke_bundle):
    write_page(PageConfig(bundle=str(smoke_bundle), reference=False))
    marker = smoke_bundle / "web" / "mine.txt"
    marker.write_text("user file")
    with pytest.raises(PocketdiffError, match="--overwrite"):
        write_page(PageConfig(bundle=str(smoke_bundle), reference=False))
    assert marker.read_text() == "user file"
    write_page(PageConfig(bundle=str(smoke_bundle), reference=False, overwrite=True))
    assert not marker.exists() and (smoke_bundle / "web/index.html").is_file()
    assert not (smoke_bundle / "web/reference").exists()


def test_bundle_with_bad_sha256_is_refused_naming_the_file(smoke_bundle):
    path = smoke_bundle / "unet.tflite"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(PocketdiffError, match=r"sha256 mismatch for unet\.tflite"):
        write_page(PageConfig(bundle=str(smoke_bundle)))
    assert not (smoke_bundle / "web").exists()


def test_missing_litertjs_names_the_setup(smoke_bundle, tmp_path):
    with pytest.raises(PocketdiffError, match="scripts/setup.sh"):
        write_page(PageConfig(bundle=str(smoke_bundle), litertjs=str(tmp_path / "none")))
    assert not (smoke_bundle / "web").exists()


def test_cli(smoke_bundle, tmp_path, capsys):
    assert cli_main(["web", str(smoke_bundle), "--no-reference"]) == 0
    assert "pocketdiff serve" in capsys.readouterr().out
    assert cli_main(["web", str(tmp_path / "nope")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert cli_main(["web", str(smoke_bundle), "--seed", "-1", "--overwrite"]) == 2
    assert "seed" in capsys.readouterr().err
