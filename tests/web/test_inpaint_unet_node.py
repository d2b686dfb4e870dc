"""A 9-channel inpainting UNet's bundle in the Node runner (web/node_runner.mjs on Dawn) and the page (headless
Chromium), both through generate.js and image_input.js: the encoder runs on the picture and on the masked picture, the
UNet is fed the mask and the masked picture's latents every step and nothing is blended, as run-bundle does; the image
against run-bundle's reference from the same picture, mask, strength and noise (>= 40 dB: WebGPU fp32 vs the CPU
runner's arithmetic), and the runs such a bundle cannot make refused in one line."""
from __future__ import annotations

import json
import shutil

import pytest
from node_runner_cli import dawn_or_skip, run_node_runner  # tests/node_runner_cli.py


@pytest.fixture(scope="module")
def dawn(node) -> str:
    return dawn_or_skip(node)


@pytest.fixture(scope="module")
def page_bundle(inpaint_unet_export, tmp_path_factory):
    """The exported inpainting bundle with its page and run-bundle's inpainting reference (strength 0.75)."""
    from pocketdiff.web.page import PageConfig, write_page

    bundle = tmp_path_factory.mktemp("inpaint9_page") / "bundle"
    shutil.copytree(inpaint_unet_export["bundle"], bundle)
    pics = inpaint_unet_export["pictures"]
    write_page(PageConfig(bundle=str(bundle), init_image=str(pics / "pic.png"), mask=str(pics / "mask.png"), strength=0.75))
    return bundle


def test_node_runner_inpaints_as_run_bundle(dawn, page_bundle, tmp_path):
    ref = json.loads((page_bundle / "web/reference/reference.json").read_text())
    assert ref["mask"] and ref["strength"] == 0.75
    d = page_bundle / "web/reference"
    out = tmp_path / "report.json"
    p = run_node_runner(dawn, str(page_bundle), "--out", str(out), "--min-image-psnr", "40", "--init-image", str(d / ref["init_image"]),
                        "--mask", str(d / ref["mask"]), "--strength", "0.75", skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["image"]["psnr_db"] >= 40, report["image"]
    assert report["picture"]["task"] == "inpaint" and report["picture"]["steps"] == 3
    assert report["components"]["vae_encoder"]["golden"]["pass"] and report["components"]["unet"]["golden"]["pass"]


@pytest.mark.parametrize("flags,words", [([], "the bundle's UNet inpaints: it runs from a picture and a mask only"),
                                         (["--init-image", "PIC"], "serves inpaint only (its UNet inpaints): add a mask")])
def test_runs_it_cannot_make_are_one_line(dawn, page_bundle, inpaint_unet_export, flags, words):
    pic = str(inpaint_unet_export["pictures"] / "pic.png")
    p = run_node_runner(dawn, str(page_bundle), "--no-goldens", *[pic if f == "PIC" else f for f in flags], timeout=300,
                        skip_without_adapter=True)
    assert p.returncode == 2 and words in p.stderr and p.stderr.count("node_runner:") == 1, p.stderr[-2000:]


def test_the_page_inpaints_as_run_bundle(chromium, page_bundle):
    """The page in headless Chromium (picture_ui.js hands generate.js the mask's grey for the masked picture), from the
    reference's picture, mask and strength: >= 40 dB against run-bundle's image."""
    from pocketdiff.web.headless import check_page
    from pocketdiff.web.verb import check_params

    ref = json.loads((page_bundle / "web/reference/reference.json").read_text())
    r = check_page(page_bundle, prompt=ref["prompt"], seed=ref["seed"], timeout_s=600, executable=chromium, min_image_psnr=40,
                   **check_params(ref))
    assert r["ok"] is True, r.get("failures") or r.get("error")
    assert r["image"]["psnr_db"] >= 40 and r["picture"]["task"] == "inpaint", (r["image"], r["picture"])
