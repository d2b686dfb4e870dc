"""A 9-channel inpainting UNet (StableDiffusionInpaintPipeline folders) through export and run-bundle: the tiny
inpainting folder of tests/img2img_fixtures.py exported with `tasks: [inpaint]` (fully on the GPU delegate: the UNet
takes `mask` and `masked_image_latents` as inputs of their own, declared by role; a second encode_image stage makes the
masked picture's latents), run on the CPU against the torch path (pocketdiff.sampling.inpaint_input + ddim_sample, which
tests/core/test_inpaint_unet_sampling.py holds to diffusers' StableDiffusionInpaintPipeline), and the bad inputs."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
import yaml

from img2img_fixtures import INPAINT_EXPORT as EXPORT  # tests/img2img_fixtures.py

PROMPT = "a large red circle at the center"


@pytest.fixture(scope="module")
def inpaint(inpaint_unet_export):
    """{model: the folder, bundle: its export, pictures}: tests/conftest.py's session fixture."""
    return inpaint_unet_export


def test_export_declares_the_inpainting_inputs_by_role(inpaint):
    man = json.loads((inpaint["bundle"] / "manifest.json").read_text())
    report = json.loads((inpaint["bundle"] / "report.json").read_text())["components"]
    block = man["pipeline"]
    assert block["tasks"] == ["inpaint"] and man["latent"]["channels"] == 4
    stages = {s["stage"]: s for s in block["stages"]}
    assert [s["kind"] for s in block["stages"]] == ["encode_prompt", "encode_image", "encode_image", "denoise", "decode"]
    assert stages["encode_masked_image"]["inputs"] == {"pixels": "masked_image"}
    assert stages["encode_masked_image"]["outputs"] == ["masked_image_latents"]
    assert {k: stages["denoise"]["inputs"][k] for k in ("mask", "masked_image_latents")} == {
        "mask": "mask", "masked_image_latents": "masked_image_latents"}
    shapes = {i["name"]: i["shape"] for i in man["components"]["unet"]["inputs"]}
    assert shapes["mask"] == [2, 1, 8, 8] and shapes["masked_image_latents"] == [2, 4, 8, 8] and shapes["sample"] == [2, 4, 8, 8]
    assert report["unet"]["fully_accelerated"] and report["vae_encoder"]["fully_accelerated"]


def _bundle_run(inpaint, strength: float, noise: np.ndarray, swap_masked: bool = False) -> np.ndarray:
    from pocketdiff.runtime.bundle import load_manifest
    from pocketdiff.runtime.image_tasks import image_inputs
    from pocketdiff.runtime.run_bundle import BundleRunner

    man = load_manifest(inpaint["bundle"])
    pics = inpaint["pictures"]
    args = argparse.Namespace(bundle=str(inpaint["bundle"]), init_image=str(pics / "pic.png"), mask=str(pics / "mask.png"),
                              strength=strength)
    picture = image_inputs(args, man)
    if swap_masked:  # the picture itself where the masked one belongs: the UNet's extra channels are read
        picture["masked_image"] = picture["init_image"]
    with BundleRunner(inpaint["bundle"], "cpu", manifest=man, image_input=True) as runner:
        image, stats = runner.run(PROMPT, seed=7, init_latents=noise, **picture)
    assert stats["finite"] and "vae_encoder_run" in stats["latency_s"]
    return image


def _torch_run(inpaint, strength: float, noise: np.ndarray) -> np.ndarray:
    from PIL import Image

    from pocketdiff.models import ModelConfig, load_or_build
    from pocketdiff.sampling import ddim_sample, decode_latents, encode_prompts, inpaint_input

    pipe = load_or_build(ModelConfig(pretrained=str(inpaint["model"])))
    pics = inpaint["pictures"]
    pic = torch.from_numpy(np.asarray(Image.open(pics / "pic.png").convert("RGB"), np.float32) / 255).permute(2, 0, 1)[None]
    mask = torch.from_numpy(np.asarray(Image.open(pics / "mask.png").convert("L"), np.float32) / 255)[None, None]
    image = inpaint_input(pipe.vae, pipe.unet, pic, mask, strength)
    with torch.no_grad():
        lat = ddim_sample(pipe.unet, pipe.scheduler, encode_prompts(pipe, PROMPT), encode_prompts(pipe, ""), steps=4,
                          guidance_scale=3.0, latents=torch.from_numpy(noise), image=image)
        return decode_latents(pipe.vae, lat)[0].permute(1, 2, 0).numpy()


@pytest.mark.parametrize("strength", [0.75, 1.0])
def test_bundle_matches_the_torch_path(inpaint, strength):
    """CPU run-bundle vs the torch path from the same noise: >= 35 dB PSNR (fp16-stored weights and the converted graphs'
    arithmetic; measured 65 / 79 dB); the masked picture swapped for the picture itself is < 35 dB (measured 21 / 32)."""
    from pocketdiff.runtime.parity import metrics

    noise = np.random.default_rng(7).standard_normal((1, 4, 8, 8)).astype(np.float32)
    ref = _torch_run(inpaint, strength, noise)
    assert metrics(ref, _bundle_run(inpaint, strength, noise))["psnr_db"] >= 35
    assert metrics(ref, _bundle_run(inpaint, strength, noise, swap_masked=True))["psnr_db"] < 35


def _cli(bundle, out, *flags):
    from pocketdiff.cli import main as cli_main

    return cli_main(["run-bundle", str(bundle), "--prompt", PROMPT, "--output", str(out), "--accelerator", "cpu", *flags])


def test_run_bundle_inpaints_and_refuses_what_an_inpainting_unet_cannot_do(inpaint, tmp_path, capsys):
    pics, bundle = inpaint["pictures"], inpaint["bundle"]
    out = tmp_path / "out"
    assert _cli(bundle, out, "--init-image", str(pics / "pic.png")) == 2  # image-to-image: no mask to feed the UNet
    assert _cli(bundle, out) == 2  # text to image: the same
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "serves inpaint only (its UNet inpaints): add --mask PATH" in err[0]
    assert "its UNet inpaints" in err[1] and "--init-image PATH and --mask PATH" in err[1]
    assert not out.exists()
    assert _cli(bundle, out, "--init-image", str(pics / "pic.png"), "--mask", str(pics / "mask.png"), "--strength", "0.75") == 0
    report = json.loads((out / "report.json").read_text())
    assert report["mask"] and report["strength"] == 0.75 and (out / "image.png").is_file()


@pytest.mark.parametrize("change,words", [({"tasks": ["text_to_image", "inpaint"]}, "tasks: the model's UNet inpaints"),
                                          ({"unet_chunks": 2, "rewrites": {"time_embedding_outside": True}}, "unet_chunks: an inpainting UNet"),
                                          ({"fp16_scan": {"enabled": True}}, "fp16_scan.enabled: must be false for an inpainting UNet")])
def test_export_refuses_an_inpainting_unet_with_other_tasks_or_in_chunks(inpaint, tmp_path, capsys, change, words):
    from pocketdiff.cli import main as cli_main

    (tmp_path / "export.yaml").write_text(yaml.safe_dump({**EXPORT, "model": {"pretrained": str(inpaint["model"])}, **change}))
    assert cli_main(["export", "--config", str(tmp_path / "export.yaml"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "out").exists()
