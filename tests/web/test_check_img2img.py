"""Image-to-image and inpainting in the page (headless Chromium, check mode) and the Node runner, against run-bundle's
image from the same picture, mask, strength and noise (web/static/image_input.js, the twin of runtime/image_tasks.py):
the web smoke bundle with its VAE encoder exported here (`components: [vae_encoder]`) and grafted in, as
tests/runtime/test_image_tasks.py does. One encoder export per worker; each page has one reference (`pocketdiff web`'s
PageConfig init_image / mask / strength), so the img2img, inpainting and text runs each get a copy of the bundle."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from img2img_fixtures import graft_encoder, make_pictures  # tests/img2img_fixtures.py
from node_runner_cli import dawn_or_skip, run_node_runner  # tests/node_runner_cli.py

SMOKE = Path(__file__).resolve().parent / "smoke_bundle"


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    return make_pictures(tmp_path_factory.mktemp("pictures"))  # tests/img2img_fixtures.py


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, smoke_encoder_export, pictures) -> dict[str, Path]:
    """Per run, the grafted bundle with its page and run-bundle's reference: img2img at the default strength (0.8: 3 of
    the 4 DDIM steps), inpainting at 0.75, and text to image. The encoder: tests/conftest.py's smoke_encoder_export
    (exported once per worker)."""
    from pocketdiff.web.page import PageConfig, write_page

    root = tmp_path_factory.mktemp("img2img_bundles")
    runs = {"img2img": {"init_image": str(pictures / "pic.png")},
            "inpaint": {"init_image": str(pictures / "pic.png"), "mask": str(pictures / "mask.png"), "strength": 0.75},
            "text": {}}
    out = {}
    for name, picture in runs.items():
        bundle = root / name
        shutil.copytree(SMOKE, bundle, ignore=shutil.ignore_patterns("README.md", "web"))
        graft_encoder(bundle, smoke_encoder_export)
        write_page(PageConfig(bundle=str(bundle), **picture))
        out[name] = bundle
    return out


def _reference(bundle: Path) -> dict:
    return json.loads((bundle / "web/reference/reference.json").read_text())


def _picture_params(ref: dict) -> dict:
    params = {"init_image": f"reference/{ref['init_image']}", "strength": ref["strength"]}
    return {**params, "mask": f"reference/{ref['mask']}"} if ref.get("mask") else params


@pytest.mark.parametrize("run,task,strength,steps", [("img2img", "image_to_image", 0.8, 3), ("inpaint", "inpaint", 0.75, 3)])
def test_page_from_a_picture_matches_run_bundle(bundles, chromium, run, task, strength, steps):
    """>= 40 dB against run-bundle's image (fp32 WebGPU vs the CPU runner's arithmetic; the same noise, picture and
    mask). Not vacuous: the text run's image from the same noise differs (below), and the encoder ran golden-checked."""
    from pocketdiff.web.headless import check_page

    ref = _reference(bundles[run])
    assert ref["strength"] == strength and bool(ref["mask"]) == (task == "inpaint")
    r = check_page(bundles[run], prompt=ref["prompt"], seed=ref["seed"], timeout_s=600, executable=chromium,
                   min_image_psnr=40, **_picture_params(ref))
    assert r["ok"] is True, r.get("failures") or r.get("error")
    assert r["image"]["psnr_db"] >= 40, r["image"]
    assert r["picture"]["task"] == task and r["picture"]["strength"] == strength and r["picture"]["steps"] == steps
    assert len(r["latency_ms"]["unet_steps_ms"]) == steps
    enc = r["components"]["vae_encoder"]
    assert enc["fully_accelerated"] and enc["golden"]["pass"], enc


def test_page_runs_text_to_image_on_a_bundle_with_an_encoder(bundles, chromium):
    """No picture: the encoder is never fetched or compiled, the image is run-bundle's text-to-image one; and the
    img2img reference's page without its picture says why it compares nothing."""
    from pocketdiff.web.headless import check_page

    ref = _reference(bundles["text"])
    assert "init_image" not in ref
    r = check_page(bundles["text"], prompt=ref["prompt"], seed=ref["seed"], timeout_s=600, executable=chromium, min_image_psnr=40)
    assert r["ok"] is True, r.get("failures") or r.get("error")
    assert r["image"]["psnr_db"] >= 40 and r["picture"]["task"] == "text_to_image"
    assert "vae_encoder" not in r["components"]
    img_ref = np.fromfile(bundles["img2img"] / "web/reference/image.bin", np.float32)
    txt_ref = np.fromfile(bundles["text"] / "web/reference/image.bin", np.float32)
    assert 10 * np.log10(1 / np.mean((img_ref - txt_ref) ** 2)) < 30  # the picture changes the image
    ref = _reference(bundles["img2img"])
    r = check_page(bundles["img2img"], prompt=ref["prompt"], seed=ref["seed"], timeout_s=600, executable=chromium)
    assert "psnr_db" not in r["image"] and r["image"]["skipped"].startswith("the reference is from picture"), r["image"]


def test_page_refuses_a_picture_of_another_aspect_ratio(bundles, chromium, pictures):
    from pocketdiff.web.headless import check_page

    shutil.copy(pictures / "wide.png", bundles["text"] / "web" / "wide.png")
    r = check_page(bundles["text"], timeout_s=300, executable=chromium, init_image="wide.png")
    assert r["ok"] is False and len(r["failures"]) == 1
    assert "48x32 px has another aspect ratio than the bundle's 32x32" in r["failures"][0]


# ------------------------------------------------------------------------------------------------- the Node runner


@pytest.fixture(scope="module")
def dawn(node) -> str:
    return dawn_or_skip(node)


@pytest.mark.parametrize("run", ["img2img", "inpaint"])
def test_node_runner_from_a_picture_matches_run_bundle(dawn, bundles, tmp_path, run):
    ref, bundle = _reference(bundles[run]), bundles[run]
    flags = ["--init-image", str(bundle / "web/reference" / ref["init_image"]), "--strength", str(ref["strength"])]
    if ref.get("mask"):
        flags += ["--mask", str(bundle / "web/reference" / ref["mask"])]
    out = tmp_path / "report.json"
    p = run_node_runner(dawn, str(bundle), "--out", str(out), "--min-image-psnr", "40", *flags, skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["image"]["psnr_db"] >= 40, report["image"]
    assert report["picture"]["task"] == ("inpaint" if ref.get("mask") else "image_to_image")
    assert report["components"]["vae_encoder"]["golden"]["pass"]


BAD_NODE = [  # (flags, what the one line names)
    (["--mask", "{d}/mask.png"], "--mask {d}/mask.png: only with --init-image"),
    (["--init-image", "{d}/pic.png", "--strength", "1.5"], "--strength 1.5: must be a number in (0, 1]"),
    (["--init-image", "{d}/wide.png"], "48x32 px has another aspect ratio"),
    (["--init-image", "{d}/pic64.png", "--mask", "{d}/mask.png"], "--mask {d}/mask.png: 32x32 px, but the picture is 64x64"),
    (["--init-image", "{d}/pic.png", "--strength", "0.2"], "keeps none of the 4 steps"),
]


@pytest.mark.parametrize("flags,names", BAD_NODE)
def test_node_runner_refuses_bad_picture_input_with_exit_2(dawn, bundles, pictures, flags, names):
    p = run_node_runner(dawn, str(bundles["text"]), "--no-goldens", *[f.format(d=pictures) for f in flags], timeout=300,
                        skip_without_adapter=True)
    assert p.returncode == 2, p.stderr[-2000:]
    assert names.format(d=pictures) in p.stderr and p.stderr.count("node_runner:") == 1, p.stderr[-2000:]


def test_node_runner_refuses_a_picture_for_a_bundle_without_an_encoder(dawn, smoke_bundle, pictures):
    p = run_node_runner(dawn, str(smoke_bundle), "--init-image", str(pictures / "pic.png"), timeout=300, skip_without_adapter=True)
    assert p.returncode == 2 and "not image_to_image" in p.stderr and "tasks" in p.stderr, p.stderr[-2000:]
