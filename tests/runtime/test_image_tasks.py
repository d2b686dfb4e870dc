"""run-bundle's image-to-image and inpainting (runtime/image_tasks.py, the pipeline's encode_image stage) on the web
smoke bundle (the shipped shapes teacher, int8 RTN UNet, 4 DDIM steps, cfg 3.0) with its VAE encoder exported here
(`components: [vae_encoder]`, checked fully on the GPU delegate at export) and grafted in: against the torch sampler's
image from the same noise, and every bad input refused in one line, exit 2, nothing written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from img2img_fixtures import graft_encoder, make_pictures  # tests/img2img_fixtures.py

from pocketdiff.errors import PocketdiffError

SMOKE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle"
PROMPT = "a large red circle at the center"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, smoke_encoder_export):
    """The web smoke bundle with the shapes teacher's encoder (tests/conftest.py `smoke_encoder_export`) grafted in."""
    root = tmp_path_factory.mktemp("img2img")
    report = json.loads((smoke_encoder_export / "report.json").read_text())["components"]["vae_encoder"]
    assert report["fully_accelerated"] and report["cosine"] > 0.999, report
    shutil.copytree(SMOKE, root / "bundle")
    graft_encoder(root / "bundle", smoke_encoder_export)
    return root / "bundle"


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    return make_pictures(tmp_path_factory.mktemp("pictures"))


def _torch_image(man: dict, pic_path: Path, strength: float, noise: np.ndarray, mask_path=None) -> np.ndarray:
    """The torch sampler from the same noise, the same int8 RTN UNet as the smoke bundle's."""
    from PIL import Image

    from pocketdiff.export.int8 import apply_to_module, rtn_checkpoint
    from pocketdiff.models import ModelConfig, load_or_build
    from pocketdiff.sampling import ImageInput, ddim_sample, decode_latents, encode_images, encode_prompts

    pipe = load_or_build(ModelConfig(pretrained="pocketdiff:shapes-teacher"))
    apply_to_module(pipe.unet, rtn_checkpoint(pipe.unet, "unet"))
    pic = torch.from_numpy(np.asarray(Image.open(pic_path).convert("RGB"), np.float32) / 255).permute(2, 0, 1)[None]
    mask = None
    if mask_path is not None:
        m = (np.asarray(Image.open(mask_path).convert("L"), np.float32) / 255 >= 0.5).astype(np.float32)
        mask = torch.from_numpy(m[::4, ::4])[None, None]
    with torch.no_grad():
        lat = ddim_sample(pipe.unet, pipe.scheduler, encode_prompts(pipe, PROMPT), encode_prompts(pipe, ""),
                          steps=man["scheduler"]["steps"], guidance_scale=man["guidance"]["scale"],
                          latents=torch.from_numpy(noise), image=ImageInput(encode_images(pipe.vae, pic), strength, mask))
        return decode_latents(pipe.vae, lat)[0].permute(1, 2, 0).numpy()


@pytest.mark.parametrize("strength,masked", [(0.5, False), (0.75, True)])
def test_bundle_image_matches_the_torch_sampler(bundle, pictures, strength, masked):
    """CPU run-bundle vs pocketdiff.sampling from the same noise: >= 35 dB PSNR (the fp16-stored text encoder, encoder
    and decoder and the converted graphs' arithmetic differ). Not vacuous: the text-to-image run from the same noise,
    and (inpainting) the unmasked half, differ."""
    from pocketdiff.runtime.bundle import load_manifest
    from pocketdiff.runtime.image_tasks import load_init_image, load_mask
    from pocketdiff.runtime.parity import metrics
    from pocketdiff.runtime.run_bundle import BundleRunner

    man = load_manifest(bundle)
    noise = np.random.default_rng(7).standard_normal((1, 4, 8, 8)).astype(np.float32)
    pixels, size = load_init_image(str(pictures / "pic.png"), man)
    mask_path = pictures / "mask.png" if masked else None
    mask = load_mask(str(mask_path), man, size, "pic.png") if masked else None
    with BundleRunner(bundle, "cpu", manifest=man, image_input=True) as runner:
        image, stats = runner.run(PROMPT, seed=7, init_latents=noise, init_image=pixels, strength=strength, mask=mask)
        text_only, _ = runner.run(PROMPT, seed=7, init_latents=noise)
    ref = _torch_image(man, pictures / "pic.png", strength, noise, mask_path)
    m = metrics(ref, image)
    assert stats["finite"] and m["psnr_db"] >= 35, m
    assert metrics(ref, text_only)["psnr_db"] < 30
    assert "vae_encoder_run" in stats["latency_s"]
    if masked:  # the kept half stays close to the picture, the repainted half less so
        pic = pixels[0].transpose(1, 2, 0)
        kept, painted = np.abs(image[:, :16] - pic[:, :16]).mean(), np.abs(image[:, 16:] - pic[:, 16:]).mean()
        assert kept < painted, (kept, painted)


def test_a_text_run_leaves_the_encoder_unloaded(bundle):
    from pocketdiff.runtime.run_bundle import BundleRunner

    with BundleRunner(bundle, "cpu") as runner:
        assert "vae_encoder" not in runner.pipeline.names()
        _, stats = runner.run(PROMPT, seed=0)
        assert "vae_encoder_load" not in stats["latency_s"]


def _cli(bundle, out, *flags):
    from pocketdiff.cli import main as cli_main

    return cli_main(["run-bundle", str(bundle), "--prompt", PROMPT, "--output", str(out), "--accelerator", "cpu", *flags])


def test_run_bundle_cli_writes_the_inpainted_image_and_reports_it(bundle, pictures, tmp_path, capsys):
    out = tmp_path / "out"
    assert _cli(bundle, out, "--init-image", str(pictures / "pic64.png"), "--mask", str(pictures / "mask.png"),
                "--strength", "0.75") == 2  # the mask is 32 px, the picture 64: refused
    assert not out.exists() and "warning" not in capsys.readouterr().err  # a refused run: its one line only
    assert _cli(bundle, out, "--init-image", str(pictures / "pic64.png"), "--strength", "0.5") == 0
    err = capsys.readouterr().err
    assert err.count("warning: --init-image") == 1 and "64x64" in err and "32x32" in err
    report = json.loads((out / "report.json").read_text())
    assert report["strength"] == 0.5 and report["init_image"].endswith("pic64.png") and report["mask"] is None


BAD = [  # (flags, what the one line names)
    (["--init-image", "{d}/not_an_image.png"], "--init-image"),
    (["--init-image", "{d}/wide.png"], "aspect ratio"),
    (["--init-image", "{d}/pic.png", "--mask", "{d}/mask16.png"], "--mask"),
    (["--init-image", "{d}/pic.png", "--mask", "{d}/not_an_image.png"], "--mask"),
    (["--init-image", "{d}/pic.png", "--strength", "0"], "--strength 0.0"),
    (["--init-image", "{d}/pic.png", "--strength", "1.5"], "--strength 1.5"),
    (["--init-image", "{d}/pic.png", "--strength", "nan"], "--strength nan"),
    (["--init-image", "{d}/pic.png", "--strength", "0.2"], "keeps none of the 4 steps"),  # int(4 x 0.2) = 0
    (["--mask", "{d}/mask.png"], "--mask"),
    (["--strength", "0.5"], "--strength"),
]


@pytest.mark.parametrize("flags,names", BAD)
def test_bad_image_input_is_one_line_exit_2_nothing_written(bundle, pictures, tmp_path, capsys, flags, names):
    out = tmp_path / "out"
    assert _cli(bundle, out, *[f.format(d=pictures) for f in flags]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and names in err[0], err
    assert not out.exists()


def test_img2img_of_a_bundle_without_an_encoder_is_refused(pictures, tmp_path, capsys):
    out = tmp_path / "out"
    assert _cli(SMOKE, out, "--init-image", str(pictures / "pic.png")) == 2
    err = capsys.readouterr().err
    assert "--init-image" in err and "image_to_image" in err and "tasks" in err
    assert not out.exists()
    with pytest.raises(PocketdiffError, match="encode_image"):
        from pocketdiff.runtime.run_bundle import BundleRunner

        BundleRunner(SMOKE, "cpu", image_input=True)
